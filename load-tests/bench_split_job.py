"""Benchmark: one job through 1, 2 and 4 stage-1 workers on this machine (issue #17).

Usage: python load-tests/bench_split_job.py [--gpus 1024] [--steps 12] [--shard-ranks 64]
       [--workers 1,2,4] [--cpu-each 0.2] [--kill-one] [--fault slow_gpu:1.5]
       [--placement even,hashed]

Per worker count K, on a fresh throwaway tansu broker: the job's start and `--steps` steps
(~830 ops per rank, no heartbeats) are published first, split into shards (the producers'
FLARE_SHARD_RANKS), so producing competes with nothing. Then one `flare worker` (the job's
worker, stage 2) and K `flare shard-worker`s start. Each stage-1 worker is held to
`--cpu-each` of a core by a cgroup v1 CPU quota (needs root). The machine has 2 cores, so
this is "at reduced speed": stage 1's CPU grows with K (K × cpu-each cores), and the
throughput it buys is what scales.

The drain is timed two ways, from the job's worker's own counters (`/worker/stats` reports,
sampled every 0.5 s): whole, from when every stage-1 worker holds partitions (its log says
so) to the job's last diagnosed step; and from the first diagnosed step to the last, which
leaves out how long the first step took to complete (that is reported too: when stage 1
reads every shard's backlog at once, the first step completes late and this view flatters).
Each worker's count of the job's shards is read from the partitions it holds at the end.
Then every step is read back through its API (`POST /v1/sql` on job_steps): each must be
stored once, with all ranks and none missing. `--kill-one` kills (SIGKILL) one stage-1
worker of the largest K once a third of the steps are diagnosed; its partitions move to
the others, which re-read what it had not committed. With `--fault`, the fault is in every
step, and each run's incidents (through the job's worker's API) are compared with those one
`JobDiagnoser` gives the same stream unsplit, field by field.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import signal
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import msgspec
from aiokafka.partitioner import murmur2  # type: ignore[import-untyped]
from bench_header import header
from pipeline_workload import Workload, build_workload

from detectors.diagnoser import JobDiagnoser
from flare.local.broker import free_port, start_tansu
from flare.local.processes import Child, start_shard_worker, start_worker
from producers.publisher import KafkaPublisher, ShardingPublisher
from producers.simulator import Fault
from schemas.shard_key import shard_partition
from schemas.steps_decoder import StepsDecoder
from schemas.topics import ALL_TOPICS, STAGE1_TOPICS
from streams.kafka.topics import ensure_topics
from streams.routing import decode_input, feed

PARTITIONS = 4  # the job-keyed topics
SHARD_PARTITIONS = 8  # flare.shardsteps.v1: up to 8 stage-1 workers share the shards
CGROUP = Path("/sys/fs/cgroup/cpu")
POLL_S = 0.5  # the job's worker's counters, through the drain
PERIOD_US = 100_000


def _limit(pid: int, cores: float, name: str) -> Path:
    group = CGROUP / name
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (group / "cpu.cfs_quota_us").write_text(str(int(cores * PERIOD_US)))
    (group / "cgroup.procs").write_text(str(pid))
    return group


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a live process used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sql(url: str, statement: str) -> list[list[object]]:
    r = httpx.post(f"{url}/v1/sql", json={"query": statement}, timeout=30)
    r.raise_for_status()
    rows: list[list[object]] = r.json()["rows"]
    return rows


COMPARED = ("id", "kind", "culprit", "status", "onset_step", "opened_step", "last_step",
            "evidence_steps")


def _fault(spec: str) -> Fault | None:
    if not spec:
        return None
    family, _, severity = spec.partition(":")
    return Fault(family, float(severity or 1.5), onset_step=0)


def one_process(wl: Workload, steps: int) -> set[tuple[object, ...]]:
    """The incidents one diagnoser gives the same stream, unsplit: what every run must give."""
    diag, decoder = JobDiagnoser(wl.job), StepsDecoder()
    final: dict[str, dict[str, object]] = {}
    for topic, _key, value, _ts in wl.events(steps):
        for inc in feed(diag, decode_input(topic, value, decoder)).incidents:
            final[inc.id] = msgspec.to_builtins(inc)
    return {tuple(i[f] for f in COMPARED) for i in final.values()}


def _incidents(url: str, job: str) -> set[tuple[object, ...]]:
    r = httpx.get(f"{url}/v1/incidents", params={"job": job, "limit": 100}, timeout=30)
    r.raise_for_status()
    return {tuple(i[f] for f in COMPARED) for i in r.json()["items"]}


class KeyHashed:
    """The producer as it was before shards were placed (`--placement hashed`): each shard
    on the partition its key hashes to (murmur2), the partition it is given ignored."""

    def __init__(self, inner: KafkaPublisher) -> None:
        self.inner = inner

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any],
                partition: int | None = None) -> None:
        self.inner.publish(topic, key, value)

    def flush(self, timeout_s: float = 30.0) -> object:
        return self.inner.flush(timeout_s)


def _partition_of(job: str, shard: int, placement: str) -> int:
    if placement == "hashed":
        return (murmur2(f"{job}/{shard}".encode()) & 0x7FFFFFFF) % SHARD_PARTITIONS
    return shard_partition(job, shard, partitions=SHARD_PARTITIONS)


def run(k: int, placement: str, args: argparse.Namespace, wl: Workload, work: Path,
        kill_one: bool) -> dict[str, object]:
    run_dir = work / f"k{k}-{placement}"
    run_dir.mkdir()
    groups: list[Path] = []
    shards: list[Child] = []
    with start_tansu(free_port(), log_path=run_dir / "tansu.log") as broker:
        conn = broker.connection
        ensure_topics(conn, PARTITIONS, topics=ALL_TOPICS)
        ensure_topics(conn, SHARD_PARTITIONS, topics=STAGE1_TOPICS)
        with KafkaPublisher(conn, max_message_bytes=16 * 2**20) as kafka:
            placing = KeyHashed(kafka) if placement == "hashed" else kafka
            pub = ShardingPublisher(placing, args.shard_ranks, partitions=SHARD_PARTITIONS)
            for topic, key, value, _ts in wl.events(args.steps):
                pub.publish(topic, key, value)
                kafka.poll(0)
            kafka.flush()
        worker = start_worker(conn, run_dir, name="job", group="g-job", partitions=PARTITIONS,
                              api_port=free_port())
        try:
            worker.wait_ready(120)
            for n in range(k):
                child = start_shard_worker(conn, run_dir, name=f"shard-{n}", group="g-shards",
                                           shard_ranks=args.shard_ranks, partitions=PARTITIONS,
                                           shard_partitions=SHARD_PARTITIONS)
                shards.append(child)
                groups.append(_limit(child.pid, args.cpu_each, f"flare-bench-{uuid.uuid4().hex}"))
            cpu0, t_cpu0 = _cpu_s(worker.process.pid), time.monotonic()
            first = last = joined = None
            spread: list[int] = []
            killed = False
            deadline = time.monotonic() + 1800
            while time.monotonic() < deadline:
                done = worker.stats()["reports"]
                now = time.monotonic()
                if joined is None and all(_held(c.log()) for c in shards):
                    joined = now  # every stage-1 worker holds partitions: the drain is on
                if done >= 1 and first is None:
                    first = (now, done)
                if kill_one and not killed and done >= args.steps // 3:
                    shards[0].process.send_signal(signal.SIGKILL)
                    killed = True
                if done >= args.steps:
                    last = (now, done)
                    spread = [_shards_held(_held(c.log()), wl.job, placement, args)
                              for c in shards]
                    break
                time.sleep(POLL_S)
            if first is None or last is None:
                raise SystemExit(f"K={k}: the job's worker diagnosed {done} of {args.steps} "
                                 f"steps in time; logs in {run_dir}")
            job_cores = (_cpu_s(worker.process.pid) - cpu0) / (time.monotonic() - t_cpu0)
            # the run's worker has a store of its own, with this one job in it
            rows = _sql(worker.api, "SELECT step, n_ranks, n_missing FROM job_steps FINAL "
                                    "ORDER BY step")
            incidents = _incidents(worker.api, wl.job)
        finally:
            for c in shards:
                if c.alive():
                    c.process.terminate()
            for c in shards:
                c.stop()
            worker.stop()
            for g in groups:
                g.rmdir()
    steps_s = (last[0] - first[0]) / max(1, last[1] - first[1])
    drain_s = last[0] - (joined or t_cpu0)
    complete = sum(1 for _step, n, miss in rows if n == args.gpus and miss == 0)
    return {"s_per_step": steps_s, "rank_steps_per_s": args.gpus / steps_s,
            "drain_s": drain_s, "drain_rank_steps_per_s": args.gpus * args.steps / drain_s,
            "first_after_s": first[0] - (joined or t_cpu0),
            "job_worker_cores": job_cores,
            "stored": len(rows), "complete": complete, "killed": float(killed),
            "incidents": incidents, "shards_held": spread}


def _held(log: str) -> set[int]:
    """The partitions a stage-1 worker holds now, by its log's last word on them."""
    said = [ln for ln in log.splitlines() if "partitions" in ln]
    if not said:
        return set()
    return {int(p) for p in said[-1].rsplit("[", 1)[1].rstrip("] \n").split(",") if p.strip()}


def _shards_held(held: set[int], job: str, placement: str, args: argparse.Namespace) -> int:
    """How many of the job's shards a stage-1 worker holding partitions `held` reads, by
    where the producers placed each shard."""
    n_shards = -(-args.gpus // args.shard_ranks)
    return sum(_partition_of(job, s, placement) in held for s in range(n_shards))


def _ratio(run: dict[str, object], base: dict[str, object], field: str) -> float:
    return float(run[field]) / float(base[field])  # type: ignore[arg-type]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--shard-ranks", type=int, default=64)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--cpu-each", type=float, default=0.2)
    ap.add_argument("--kill-one", action="store_true")
    ap.add_argument("--placement", default="even", help="where producers put a job's shards, "
                    "one run each: even (shard s on partition (h(job) + s) mod n, as Flare's "
                    "producers do) and/or hashed (the key's murmur2, as they did before)")
    ap.add_argument("--fault", default="", help="FAMILY:SEVERITY in every step; the incidents "
                    "are then compared with one process's")
    args = ap.parse_args()
    print(header())
    ks = [int(x) for x in args.workers.split(",")]
    placements = args.placement.split(",")
    print(f"load: {args.gpus} GPUs, {args.steps} steps of ~830 ops per rank, shards of "
          f"{args.shard_ranks} ranks; each stage-1 worker held to {args.cpu_each} of a core")
    wl = build_workload(args.gpus, 3, 10.0, 16, 12, False, 0, _fault(args.fault))
    want = one_process(wl, args.steps)
    # the workload's millions of objects live to the end: out of the collector's way, or
    # every full collection in this process walks them while the measured ones run (at
    # 8,192 GPUs this process took 0.25-0.5 of a core through a drain, polling)
    gc.collect()
    gc.freeze()
    work = Path(tempfile.mkdtemp(prefix="flare-split-"))
    try:
        out = {(k, pl): run(k, pl, args, wl, work, args.kill_one and k == max(ks))
               for k in ks for pl in placements}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = out[ks[0], placements[0]]
    print(f"\none process's incidents: {sorted(want)}")
    print("\n| stage-1 workers (cores) | placement | shards held, each | whole drain: s, "
          "rank-steps/s, × first | first step after | first to last step: s per step, "
          "rank-steps/s, × first | job's worker, cores used | steps stored / complete | "
          "incidents as one process's |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for (k, pl), r in out.items():
        note = " (one killed)" if r["killed"] else ""
        held = ", ".join(str(n) for n in r["shards_held"])  # type: ignore[attr-defined]
        print(f"| {k} ({k * args.cpu_each:.1f}){note} | {pl} | {held} | {r['drain_s']:.1f} | "
              f"{r['drain_rank_steps_per_s']:.0f} | "
              f"{_ratio(r, base, 'drain_rank_steps_per_s'):.2f} | "
              f"{r['first_after_s']:.1f} s | {r['s_per_step']:.2f} | "
              f"{r['rank_steps_per_s']:.0f} | "
              f"{_ratio(r, base, 'rank_steps_per_s'):.2f} | "
              f"{r['job_worker_cores']:.2f} | {r['stored']:.0f} / {r['complete']:.0f} | "
              f"{'same' if r['incidents'] == want else r['incidents']} |")


if __name__ == "__main__":
    main()
