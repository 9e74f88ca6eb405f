"""Soak: job churn. Many short jobs through one worker; afterwards its state is freed and its
memory is back where it was.

Usage:
  python load-tests/soak_churn.py [--jobs 1000] [--gpus 8] [--steps 6] [--idle-s 5] [--rounds 4]
      [--store embedded|http]

What runs, on loopback: a tansu broker and one `flare worker` whose jobs are evicted after
`--idle-s` of silence (FLARE_JOB_IDLE_S; production keeps 600 s). One short simulated job
(no fault, with its start and end events) is the template; each job of the run is a copy
under its own job id. The worker first takes a warm-up round of `--jobs` / 10 jobs; once
they are evicted its memory (VmRSS) is the baseline. Then `--rounds` rounds of `--jobs` jobs
each, and after each, once every job is evicted: the worker's RSS, the jobs it still holds,
and the steps decoder's cached ranks. The state must be empty after each round, and the RSS
after the last round within 5% of the round before (flat, not growing with jobs). While it
holds jobs the worker keeps freed memory for their next steps (`streams.worker.tune_malloc`);
once it holds none it hands that back (`streams.worker.IdleTrim`), so the RSS after a round
is what the worker itself still holds (glibc's "kept free" figure below still counts the
trimmed pages, which are no longer resident). The embedded ClickHouse engine keeps its parts
and caches. The RSS is also shown split into anonymous memory and mapped files (`RssAnon`,
`RssFile`): code and libraries are the second. What its own allocators hold live can
(`streams.worker.memory_in_use`, in the worker's /worker/stats): glibc's heap in use, and
CPython's live blocks, each within 10% of the warm-up's after every round (8 MB of slack for
the heap). While a round drains, two threads ask `/livez` and `/readyz` every half second
and time the answers: the probes share the event loop that diagnoses, so a loop held by
long calls shows as late answers. `/livez` must answer within `--probe-max-s` (default 1 s, an
orchestrator's default probe timeout: past it, a liveness probe restarts the worker), else
exit 1; `/readyz` (a query to ClickHouse on a thread: more turns of the loop) is shown.

`--store` says where the rows go. `embedded` (the default): chDB inside the worker, as
`flare up` runs it, so the worker's RSS includes the engine's. `http`: the real engine
(chDB) behind the test front `chdb_http.py`, in a process of its own on a temporary data
directory, the worker storing through ClickHouse's HTTP interface as it does to a server in
production (`FLARE_CLICKHOUSE_URL`, as `reliability_storage_outage.py` runs it): the worker's
RSS is then the worker's alone, and the front's is shown in a column of its own (the
server's; a ClickHouse server binary would hold other caches). Everything else is the same
in both modes, so two runs compare.

Prints a markdown table; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from reliability_kill import ROOT, machine, wait_for
from reliability_storage_outage import Front

from flare.local.broker import free_port, start_tansu
from flare.local.processes import WorkerProcess, start_worker
from producers.publisher import KafkaPublisher
from producers.simulator import Scenario, layout_for_gpus
from producers.simulator.simulator import ClusterSimulator
from streams.kafka.topics import ensure_topics

PARTITIONS = 4


def template(gpus: int, steps: int) -> list[tuple[str, dict[str, Any]]]:
    sim = ClusterSimulator(Scenario(job="churn-template", layout=layout_for_gpus(gpus),
                                    steps=steps, seed=0, fault=None, step_time_s=0.5))
    return [(topic, value) for topic, _key, value, _ts in sim.events()]


def publish_round(pub: KafkaPublisher, events: list[tuple[str, dict[str, Any]]], prefix: str,
                  jobs: int) -> int:
    n = 0
    for j in range(jobs):
        job = f"{prefix}-{j}"
        for topic, value in events:
            pub.publish(topic, job, {**value, "job": job})
            n += 1
    pub.flush(120)
    return n


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A resident-size line of /proc/PID/status in MB (`VmRSS`, `RssAnon`, `RssFile`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class ProbeTimer:
    """Times a probe's answers from a thread of its own while a round drains."""

    def __init__(self, worker: WorkerProcess, path: str, every_s: float = 0.5) -> None:
        self.worker, self.path, self.every_s = worker, path, every_s
        self.answers: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import httpx

        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.worker.get(self.path, timeout_s=60.0)
            except httpx.HTTPError:
                pass  # a timeout is a minute's wait, counted as such
            self.answers.append(time.monotonic() - t0)
            self._stop.wait(self.every_s)

    def __enter__(self) -> ProbeTimer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def drained(worker: WorkerProcess, records: int) -> None:
    """Until the worker has read `records` in all and holds no job."""
    def done() -> bool:
        s = worker.stats(60.0)  # how late it answers is the probe's figure
        return s["records"] >= records and s["total_lag"] == 0 and s["jobs"] == 0
    wait_for("the worker to read and evict every job", done, 900, 1.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--probe-max-s", type=float, default=1.0)
    ap.add_argument("--store", choices=["embedded", "http"], default="embedded",
                    help="chDB in the worker, or chDB behind chdb_http.py in its own process")
    args = ap.parse_args(argv)
    events = template(args.gpus, args.steps)
    work = Path(tempfile.mkdtemp(prefix="flare-churn-"))
    rows: list[tuple[str, int, float, dict[str, Any], float, list[float], list[float]]] = []
    front: Front | None = None
    try:
        env = {"FLARE_JOB_IDLE_S": str(args.idle_s)}
        if args.store == "http":
            front = Front(work / "front-data", work / "front.log")
            front.start()
            env["FLARE_CLICKHOUSE_URL"] = front.url
        with start_tansu(free_port(), log_path=work / "tansu.log") as broker:
            ensure_topics(broker.connection, PARTITIONS)
            w = start_worker(broker.connection, work, name="w", group="g-churn",
                             partitions=PARTITIONS, api_port=free_port(), cwd=ROOT,
                             extra_env=env)
            try:
                w.wait_ready(120)
                total = 0
                with KafkaPublisher(broker.connection) as pub:
                    rounds = [("warm-up", max(args.jobs // 10, 1))] + [
                        (f"round {i}", args.jobs) for i in range(1, args.rounds + 1)]
                    for name, n in rounds:
                        t0 = time.monotonic()
                        with ProbeTimer(w, "/livez") as live, ProbeTimer(w, "/readyz") as ready:
                            total += publish_round(pub, events, name.replace(" ", ""), n)
                            drained(w, total)
                        s = w.stats()
                        mem = s.get("memory", {})
                        pid = w.process.pid
                        rows.append((name, n, rss_mb(pid), {
                            "anon_mb": rss_mb(pid, "RssAnon"), "file_mb": rss_mb(pid, "RssFile"),
                            "front_mb": (rss_mb(front.child.pid) if front and front.child
                                         else float("nan")),
                            "jobs": s["jobs"], "cached_ranks": s["steps_decoder"]["cached_ranks"],
                            "incident_events": s["incident_events"],
                            "heap_mb": mem.get("heap_in_use_mb", float("nan")),
                            "kept_mb": mem.get("heap_kept_free_mb", float("nan")),
                            "py_blocks": mem.get("python_blocks", float("nan"))},
                            time.monotonic() - t0, live.answers, ready.answers))
            finally:
                w.stop(60)  # before the front: the worker flushes its last rows on the way out
    finally:
        if front is not None:
            front.stop()
        shutil.rmtree(work, ignore_errors=True)

    print(f"`python load-tests/soak_churn.py {' '.join(argv or sys.argv[1:])}`\n")
    store = ("embedded chDB in the worker" if args.store == "embedded" else
             "chDB behind chdb_http.py in its own process (the server column)")
    print(f"{machine()}; store: {store}; each job: {args.gpus} GPUs, {args.steps} steps of "
          f"0.5 s, {len(events)} messages; evicted after {args.idle_s} s of silence\n")
    print("| round | jobs | worker RSS after (MB) | of which anon, file (MB) | "
          "server (front) RSS (MB) | heap in use (MB) | heap kept free (MB) | "
          "Python blocks live | jobs held | decoder cached ranks | incident events so far | "
          "wall (s) | /livez: median, slowest (s) | /readyz: median, slowest (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, n, rss, s, wall, live_s, ready_s in rows:
        server = "–" if math.isnan(s["front_mb"]) else f"{s['front_mb']:.0f}"
        print(f"| {name} | {n} | {rss:.0f} | {s['anon_mb']:.0f}, {s['file_mb']:.0f} | "
              f"{server} | {s['heap_mb']:.0f} | {s['kept_mb']:.0f} | "
              f"{s['py_blocks']:,.0f} | {s['jobs']} | {s['cached_ranks']} | "
              f"{s['incident_events']} | {wall:.0f} | {statistics.median(live_s):.3f}, "
              f"{max(live_s):.2f} | {statistics.median(ready_s):.3f}, {max(ready_s):.2f} |")
    empty = all(row[3]["jobs"] == 0 and row[3]["cached_ranks"] == 0 for row in rows)
    flat = rows[-1][2] <= rows[-2][2] * 1.05
    prompt = max(max(row[5]) for row in rows) <= args.probe_max_s
    base = rows[0][3]
    back = all(row[3]["heap_mb"] <= base["heap_mb"] * 1.1 + 8 and
               row[3]["py_blocks"] <= base["py_blocks"] * 1.1 for row in rows[1:])
    print(f"\nstate empty after every round: {empty}; RSS after the last round within 5% of "
          f"the round before: {flat}; heap in use and Python blocks within 10% of the "
          f"warm-up's after every round: {back}; every /livez answered within "
          f"{args.probe_max_s} s: {prompt}")
    return 0 if empty and flat and back and prompt else 1


if __name__ == "__main__":
    sys.exit(main())
