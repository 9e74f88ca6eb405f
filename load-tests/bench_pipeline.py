"""Benchmark: broker -> worker -> ClickHouse, the whole stream path of one training job.

Usage:
  python load-tests/bench_pipeline.py --gpus 1024 --steps 30              # throughput ceiling
  python load-tests/bench_pipeline.py --gpus 8192 --steps 8
  python load-tests/bench_pipeline.py --gpus 1024 --speed 1 --duration-s 600  # real time, lag
Options: --step-time 10, --microbatches 16 --chunks 12 (~830 ops per rank), --distinct 3,
--no-heartbeats, --first-step 60, --sample-s, --profile-s 30 (py-spy on the worker),
--fetch-max-wait-ms MS (the worker's FLARE_KAFKA_FETCH_MAX_WAIT_MS; faust's own is 1500),
--fault FAMILY:SEVERITY (in every step: an incident stays open, and its what-if runs).

What runs: a throwaway tansu broker and one `flare worker` process (embedded chDB in a temp
dir, its API on a free port), all on loopback; everything stops by itself.

Generation is not measured: `--distinct` steps of the job are simulated first and encoded
once as byte templates; the run cycles through them, rewriting the step numbers and every
timestamp (steps' t_start/t_end, heartbeats' ts and in-flight start) so the worker sees one
long job whose steps follow each other. A cycle is `distinct` simulated steps of
`--step-time` each, with the simulator's clean noise (jitter, skew, data-dependent work).

Two modes:
- throughput (`--speed 0`, the default): the whole run is published before the worker
  starts, so the producer does not compete for the CPU; the worker then drains the backlog
  and we measure the drain, from its readiness to its last stored step.
- paced (`--speed 1` real time, or `--speed X` X times faster): the worker runs first and
  the events are published on their own timestamps; lag is sampled every `--sample-s`.

Every figure comes from the worker's own progress (`/worker/stats`: its processed offsets
and the steps it diagnosed and stored) and from what our producer got acknowledged, never
from the broker's end offsets. At the end the stored steps are read back through the API.

The broker, the worker process and the producer are the product's own (`flare.local`,
`producers.publisher`), so the benchmark measures what `flare up` runs. This file runs the
benchmark; the workload is `pipeline_workload.py`, the tables `pipeline_report.py`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline_report import Outcome, Sample, profile_tables, report
from pipeline_workload import Workload, build_workload

from flare.local.broker import free_port, start_tansu
from flare.local.processes import WorkerProcess, start_worker
from producers.live import publish_events
from producers.publisher import KafkaPublisher, PublishError
from producers.simulator import Fault
from schemas.kafka import KafkaConnection
from schemas.topics import HEARTBEATS, INPUT_TOPICS
from streams.kafka.topics import ensure_topics

PARTITIONS = 4


# ---- publishing: the product's publisher, with our own delivery counts per topic ---------
class CountingProducer:
    """The confluent-kafka producer under `KafkaPublisher`, counting acknowledged messages
    per topic into `delivered` (one job, so one partition per topic: the count is the next
    offset the broker has acknowledged). Lag is measured against these, never against the
    broker's offsets."""

    def __init__(self, config: dict[str, Any], delivered: Counter[str]) -> None:
        from confluent_kafka import Producer

        self._producer = Producer(config)
        self._then: Callable[[Any, Any], None] | None = None
        self.delivered = delivered

    def _done(self, err: Any, msg: Any) -> None:
        if err is None:
            self.delivered[msg.topic()] += 1
        if self._then is not None:
            self._then(err, msg)

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                on_delivery: Callable[[Any, Any], None] | None = None) -> None:
        self._then = on_delivery
        self._producer.produce(topic, value=value, key=key, on_delivery=self._done)

    def poll(self, timeout: float = 0.0) -> int:
        return self._producer.poll(timeout)

    def flush(self, timeout: float = 30.0) -> int:
        return self._producer.flush(timeout)

    def close(self) -> Any:
        return self._producer.close()


# ---- sampling ---------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    return 0.0


def machine_busy() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs: other helpers' load shows up here."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return float(sum(f) - idle), float(sum(f))


def taken_per_topic(stats: dict[str, Any]) -> dict[str, int]:
    out = dict.fromkeys(INPUT_TOPICS, 0)
    for tp, off in stats.get("processed", {}).items():
        out[tp.rsplit("[", 1)[0]] += int(off) + 1
    return out


def take_sample(t0: float, worker: WorkerProcess, broker_pid: int,
                delivered: Counter[str]) -> Sample:
    st = worker.stats(timeout_s=60.0)
    busy, total = machine_busy()
    pid = worker.process.pid
    return Sample(
        t=time.monotonic() - t0, taken=taken_per_topic(st),
        delivered=dict(delivered),
        reports=int(st.get("reports", 0)), worker_lag=int(st.get("total_lag", 0)),
        cpu={"worker": cpu_s(pid), "tansu": cpu_s(broker_pid), "bench": time.process_time(),
             "busy": busy, "total": total},
        rss={"worker": rss_mb(pid), "tansu": rss_mb(broker_pid)},
    )


def launch_worker(conn: KafkaConnection, tmp: Path, args: argparse.Namespace
                  ) -> WorkerProcess:
    """One `flare worker` (chDB in `tmp`, API on a free port, a fresh consumer group) with
    the settings under test: the fetch wait and any `--worker-env`."""
    fetch = {} if args.fetch_max_wait_ms is None else {
        "FLARE_KAFKA_FETCH_MAX_WAIT_MS": str(args.fetch_max_wait_ms)}
    extra = {**fetch, **dict(kv.split("=", 1) for kv in args.worker_env)}
    return start_worker(conn, tmp, name="worker", group=f"bench-{uuid.uuid4().hex[:6]}",
                        partitions=PARTITIONS, api_port=free_port(), extra_env=extra, cwd=tmp)


def api_json(worker: WorkerProcess, path: str, **params: Any) -> Any:
    r = worker.get(path, timeout_s=120.0, **params)
    return r.json() if r.status_code == 200 else {"status": r.status_code, "body": r.text}


def py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        print("(py-spy not installed: `pip install py-spy` into the venv to profile)")
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", "50", "--nonblocking", "--threads", "--format", "raw",
                             "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# ---- the run ----------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=0, help="steps to publish (default: 30)")
    ap.add_argument("--duration-s", type=float, default=0.0,
                    help="paced: run this long (steps = duration * speed / step time)")
    ap.add_argument("--speed", type=float, default=0.0,
                    help="0: pre-load, then drain as fast as possible; 1: real time; X: X times")
    ap.add_argument("--step-time", type=float, default=10.0, help="simulated step, seconds")
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--distinct", type=int, default=3, help="distinct simulated steps cycled")
    ap.add_argument("--first-step", type=int, default=60,
                    help="number of the first published step (every 100th step stores its ops)")
    ap.add_argument("--heartbeats", action=argparse.BooleanOptionalAction, default=True,
                    help="heartbeats with the agents' cadence (1 Hz samples, ~14 per rank-minute)")
    ap.add_argument("--sample-s", type=float, default=0.0, help="default: 1 s, paced 10 s")
    ap.add_argument("--profile-s", type=float, default=0.0, help="py-spy the worker this long")
    ap.add_argument("--timeout-s", type=float, default=3600.0, help="hard stop")
    ap.add_argument("--fault", default="", help="FAMILY:SEVERITY in every step")
    ap.add_argument("--encoding", choices=("v1", "v2"), default="v1",
                    help="steps as v1 JSON (flare.steps.v1) or v2 binary (flare.steps.v2)")
    ap.add_argument("--fetch-max-wait-ms", type=int, default=None,
                    help="the worker's fetch wait (FLARE_KAFKA_FETCH_MAX_WAIT_MS; default: "
                    "the setting's default)")
    ap.add_argument("--worker-env", action="append", default=[], metavar="FLARE_X=VALUE",
                    help="extra environment of the worker, e.g. a setting to try (repeatable)")
    ap.add_argument("--keep-logs", type=Path, default=None,
                    help="copy the worker's and tansu's logs (and the profile) to this folder")
    return ap.parse_args()


def run(args: argparse.Namespace, wl: Workload, steps: int) -> Outcome:
    """Broker, worker, publish, sample until every step is stored (or a stop condition)."""
    paced = args.speed > 0
    sample_s = args.sample_s or (10.0 if paced else 1.0)
    with tempfile.TemporaryDirectory(prefix="flare-bench-") as tmpdir:
        tmp = Path(tmpdir)
        broker = start_tansu(free_port(), log_path=tmp / "tansu.log")
        worker: WorkerProcess | None = None
        spy: subprocess.Popen[bytes] | None = None
        stop = threading.Event()
        delivered: Counter[str] = Counter()
        try:
            ensure_topics(broker.connection, PARTITIONS)
            pub = KafkaPublisher(broker.connection, extra={"log_level": 0},
                                 producer_factory=lambda conf: CountingProducer(conf, delivered))
            publish_s = 0.0
            if not paced:  # pre-load: the producer must not compete with the worker
                p0 = time.perf_counter()
                publish_events(wl.events(steps), pub, None)
                pub.flush(600)  # PublishError if anything was not delivered
                publish_s = time.perf_counter() - p0
                print(f"pre-loaded {sum(delivered.values()):,} messages in "
                      f"{publish_s:.1f} s", file=sys.stderr)
            worker = launch_worker(broker.connection, tmp, args)
            worker.wait_ready(120.0)
            publisher = None
            if paced:
                def publish() -> None:
                    publish_events(wl.events(steps), pub, args.speed, should_stop=stop.is_set)
                    try:
                        pub.flush(120)
                    except PublishError as exc:
                        print(f"publishing: {exc}", file=sys.stderr)

                publisher = threading.Thread(target=publish, daemon=True)
            t0 = time.monotonic()
            if publisher is not None:
                publisher.start()
            samples: list[Sample] = []
            spy_at = None
            last_progress = (-1, t0)
            while True:
                s = take_sample(t0, worker, broker.pid, delivered)
                samples.append(s)
                print(f"  t={s.t:6.1f}s delivered={s.delivered.get(wl.steps_topic, 0):>8,} "
                      f"taken={s.taken[wl.steps_topic]:>8,} steps stored={s.reports}",
                      file=sys.stderr)
                if args.profile_s and spy is None and s.reports >= 2:
                    spy_at = s.t
                    spy = py_spy(worker.process.pid, args.profile_s, tmp / "spy.txt")
                now = time.monotonic()
                progress = sum(s.taken.values()) + s.reports
                if progress != last_progress[0]:
                    last_progress = (progress, now)
                published = publisher is None or not publisher.is_alive()
                if published and s.reports >= steps:
                    break
                if worker.process.poll() is not None:
                    raise RuntimeError(f"worker died:\n{worker.log_tail()}")
                if now - t0 > args.timeout_s or (published and now - last_progress[1] > 120):
                    print("stopping early: timeout, or no progress for 120 s", file=sys.stderr)
                    break
                time.sleep(max(0.0, sample_s - (now - t0 - s.t)))
            stop.set()
            if spy is not None:
                spy.wait(timeout=args.profile_s + 60)
            final = worker.stats(timeout_s=60.0)
            stored = api_json(worker, f"/v1/jobs/{wl.job}")
            found = api_json(worker, "/v1/incidents", job=wl.job)
            items = found.get("items", []) if isinstance(found, dict) else []
            print("incidents: " + (", ".join(
                f"{i['kind']} {i['culprit']} ({i['status']}, {i['evidence_steps']} steps)"
                for i in items) or "none"), file=sys.stderr)
            series = api_json(worker, f"/v1/jobs/{wl.job}/steps", limit=10000)
            newest = stored.get("last_step") if isinstance(stored, dict) else None
            ranks = (api_json(worker, f"/v1/jobs/{wl.job}/ranks", step=newest, limit=100000)
                     if newest is not None else {})
            assignments = worker.log_path.read_text(errors="replace").count(
                "(new here:")
        finally:
            stop.set()
            if worker is not None:
                worker.stop(60.0)
            broker.stop()
            if args.keep_logs is not None:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for f in ("worker.log", "tansu.log", "spy.txt"):
                    if (tmp / f).exists():
                        shutil.copy(tmp / f, args.keep_logs / f)
        profile = (profile_tables(tmp / "spy.txt", args.profile_s) if spy is not None
                   else ([], []))
    return Outcome(samples, final, stored, series, ranks, assignments, publish_s,
                   sum(delivered.values()), profile, spy_at)


def main() -> None:
    args = parse_args()
    paced = args.speed > 0
    if args.duration_s and paced:
        steps = max(1, int(args.duration_s * args.speed / args.step_time))
    else:
        steps = args.steps or 30
    load0 = os.getloadavg()
    g0 = time.perf_counter()
    fault = None
    if args.fault:
        family, _, severity = args.fault.partition(":")
        fault = Fault(family, float(severity or 1.5), onset_step=0)
    wl = build_workload(args.gpus, args.distinct, args.step_time, args.microbatches,
                        args.chunks, args.heartbeats, args.first_step, fault, args.encoding)
    gen_s = time.perf_counter() - g0
    n = Counter(t.topic for t in wl.templates)
    print(f"generated {wl.distinct} distinct steps of {wl.world:,} ranks in {gen_s:.1f} s "
          f"({n[wl.steps_topic]:,} step and {n[HEARTBEATS]:,} heartbeat messages)",
          file=sys.stderr)
    out = run(args, wl, steps)
    report(args, wl, steps, out, gen_s, load0)


if __name__ == "__main__":
    main()
