"""Benchmark: broker -> worker -> ClickHouse, the whole stream path of one training job.

Usage:
  python load-tests/bench_pipeline.py --gpus 1024 --steps 30              # throughput ceiling
  python load-tests/bench_pipeline.py --gpus 8192 --steps 8
  python load-tests/bench_pipeline.py --gpus 1024 --speed 1 --duration-s 600  # real time, lag
Options: --step-time 10, --microbatches 16 --chunks 12 (~830 ops per rank), --distinct 3,
--no-heartbeats, --first-step 60, --sample-s, --profile-s 30 (py-spy on the worker),
--fetch-max-wait-ms MS (the worker's FLARE_KAFKA_FETCH_MAX_WAIT_MS; faust's own is 1500).

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
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from flare.local.broker import free_port, start_tansu
from flare.settings import Settings
from producers.live import publish_events
from producers.publisher import producer_config
from producers.simulator import ClusterSimulator, Scenario, layout_for_gpus
from streams.kafka.topics import ensure_topics

STEPS, HEARTBEATS, JOBS = "flare.steps.v1", "flare.heartbeats.v1", "flare.jobs.v1"
INPUTS = (STEPS, HEARTBEATS, JOBS)
PARTITIONS = 4
_MARK = 7_777_000_000_000_000_000  # > any ns timestamp we emit, < 2**63: a hole in a template
_HOLE = re.compile(rb"7777000000000000(\d{3})")
CLI = "from flare.cli import main; main()"


# ---- the workload: byte templates of `distinct` steps, replayed in cycles -----------------
@dataclass(slots=True)
class Template:
    """One encoded message with holes: parts[0] hole0 parts[1] hole1 ... parts[n]."""

    topic: str
    parts: list[bytes]
    holes: list[tuple[bool, int]]  # (is_step, base value), in byte order
    step: int  # the message's step, counted from the first distinct step
    ts: int  # true time (ns) of the message in cycle 0
    n_ops: int

    def render(self, step_shift: int, time_shift: int) -> bytes:
        out = [self.parts[0]]
        for (is_step, base), part in zip(self.holes, self.parts[1:], strict=True):
            out.append(b"%d" % (base + (step_shift if is_step else time_shift)))
            out.append(part)
        return b"".join(out)


def _template(topic: str, value: dict[str, Any], ts: int, s0: int) -> Template:
    """Encode `value` with its step and time fields replaced by markers, then split."""
    holes: list[tuple[bool, int]] = []

    def mark(is_step: bool, base: int) -> int:
        holes.append((is_step, base))
        return _MARK + len(holes) - 1

    v = dict(value)
    v["step"] = mark(True, value["step"] - s0)
    n_ops = 0
    if topic == STEPS:
        v["t_start_ns"] = mark(False, value["t_start_ns"])
        v["t_end_ns"] = mark(False, value["t_end_ns"])
        n_ops = len(value["ops"]["kind"])
    else:
        v["ts_ns"] = mark(False, value["ts_ns"])
        v["inflight"] = [{**op, "start_ns": mark(False, op["start_ns"])}
                         for op in value["inflight"]]
    pieces = _HOLE.split(orjson.dumps(v))
    order = [int(x) for x in pieces[1::2]]
    if sorted(order) != list(range(len(holes))):
        raise RuntimeError(f"template holes lost in a {topic} message: {order}")
    return Template(topic, pieces[0::2], [holes[i] for i in order], value["step"] - s0, ts,
                    n_ops)


@dataclass(slots=True)
class Workload:
    job: str
    world: int
    distinct: int
    period_ns: int  # true-time length of one cycle of `distinct` steps
    start: bytes  # the job's start event
    templates: list[Template]
    first_step: int
    heartbeats: bool

    def cycles(self, steps: int) -> int:
        return -(-steps // self.distinct)

    def events(self, steps: int) -> Iterator[tuple[str, bytes, bytes, int]]:
        """(topic, key, value, true ts) of the whole run: the job's start, then `steps` steps.

        No `end` event: the last step completes when its last rank reports (the start event
        gives the world size), and an end racing the last ranks' messages across topics
        would close that step early in the worker's event-time merge.
        """
        key = self.job.encode()
        yield JOBS, key, self.start, self.templates[0].ts - 1
        for c in range(self.cycles(steps)):
            n = min(self.distinct, steps - c * self.distinct)
            shift_s, shift_t = self.first_step + c * self.distinct, c * self.period_ns
            for t in self.templates:
                if t.step < n:
                    yield t.topic, key, t.render(shift_s, shift_t), t.ts + shift_t

    def topic_index(self, topic: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Per offset of `topic` (one job: one partition): the message's true time, and the
        ops of the messages up to it (cumulative)."""
        if topic == JOBS:
            return np.array([self.templates[0].ts - 1], np.int64), np.zeros(1, np.int64)
        st = [t for t in self.templates if t.topic == topic]
        if not st:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        ts, ops, step = (np.array([getattr(t, a) for t in st], np.int64)
                         for a in ("ts", "n_ops", "step"))
        all_ts, all_ops = [], []
        for c in range(self.cycles(steps)):
            keep = step < min(self.distinct, steps - c * self.distinct)
            all_ts.append(ts[keep] + c * self.period_ns)
            all_ops.append(ops[keep])
        return np.concatenate(all_ts), np.cumsum(np.concatenate(all_ops))


def build_workload(gpus: int, distinct: int, step_time_s: float, microbatches: int,
                   chunks: int, heartbeats: bool, first_step: int) -> Workload:
    """Simulate `distinct` + 2 steps, keep steps 1..distinct (step 0 is the job's first)."""
    s0 = 1
    sc = Scenario(job=f"bench-{gpus}-{uuid.uuid4().hex[:6]}", layout=layout_for_gpus(gpus),
                  steps=s0 + distinct + 1, seed=7, microbatches=microbatches, chunks=chunks,
                  step_time_s=step_time_s, heartbeats=heartbeats)
    sim = ClusterSimulator(sc)
    templates: list[Template] = []
    first_start: dict[int, int] = {}
    start = b""
    for topic, _key, value, ts in sim.events():
        if topic == JOBS:
            if value["event"] == "start":
                start = orjson.dumps(value)
            continue
        s = value["step"]
        if topic == STEPS:
            first_start[s] = min(first_start.get(s, value["t_start_ns"]), value["t_start_ns"])
        if s0 <= s < s0 + distinct:
            templates.append(_template(topic, value, ts, s0))
    period = first_start[s0 + distinct] - first_start[s0]
    return Workload(sc.job, sc.layout.world, distinct, period, start, templates, first_step,
                    heartbeats)


# ---- publishing: our own delivery counts per topic ---------------------------------------
class TrackingPublisher:
    """Flare's producer settings, plus acknowledged messages counted per topic (one job, so
    one partition per topic: the count is the next offset the broker has acknowledged)."""

    def __init__(self, bootstrap: str) -> None:
        from confluent_kafka import Producer

        self._p = Producer(producer_config(bootstrap, extra={"log_level": 0}))
        self.delivered: Counter[str] = Counter()
        self.failed = 0

    def _done(self, err: Any, msg: Any) -> None:
        if err is None:
            self.delivered[msg.topic()] += 1
        else:
            self.failed += 1

    def publish(self, topic: str, key: str | bytes, value: Any) -> None:
        while True:
            try:
                self._p.produce(topic, value=value, key=key, on_delivery=self._done)
                return
            except BufferError:
                self._p.poll(0.05)

    def poll(self, timeout_s: float = 0.0) -> None:
        self._p.poll(timeout_s)

    def flush(self, timeout_s: float) -> int:
        return self._p.flush(timeout_s)


# ---- processes --------------------------------------------------------------------------
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


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    api: str
    log_path: Path

    def stats(self, timeout_s: float = 60.0) -> dict[str, Any]:
        return httpx.get(f"{self.api}/worker/stats", timeout=timeout_s).json()

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.api}{path}", params=params, timeout=120.0)
        return r.json() if r.status_code == 200 else {"status": r.status_code, "body": r.text}

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"worker exited:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.api}/readyz", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"worker not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def start_worker(bootstrap: str, tmp: Path, extra_env: list[str],
                 fetch_max_wait_ms: int | None = None) -> Worker:
    port = free_port()
    fetch = {} if fetch_max_wait_ms is None else {
        "FLARE_KAFKA_FETCH_MAX_WAIT_MS": str(fetch_max_wait_ms)}
    env = {**os.environ, "FLARE_KAFKA_BOOTSTRAP": bootstrap,
           "FLARE_CLICKHOUSE_URL": f"chdb:///{(tmp / 'chdb').as_posix().lstrip('/')}",
           "FLARE_GROUP_ID": f"bench-{uuid.uuid4().hex[:6]}", "FLARE_PARTITIONS": str(PARTITIONS),
           "FLARE_API_PORT": str(port), "FLARE_LOG_LEVEL": "info", **fetch,
           **dict(kv.split("=", 1) for kv in extra_env)}
    log_path = tmp / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-c", CLI, "worker", "--quiet"], env=env,
                                cwd=tmp, stdout=log, stderr=subprocess.STDOUT)
    return Worker(proc, f"http://127.0.0.1:{port}", log_path)


# ---- sampling ---------------------------------------------------------------------------
@dataclass(slots=True)
class Sample:
    t: float  # wall seconds since the worker started consuming (or publishing began)
    taken: dict[str, int]  # messages the worker took, per input topic (its processed offsets)
    delivered: dict[str, int]  # messages the broker acknowledged to us, per topic
    reports: int  # steps diagnosed and stored
    worker_lag: int  # the worker's own lag estimate (fetch high watermarks - processed)
    cpu: dict[str, float]  # CPU seconds: worker, tansu, bench, machine busy / total jiffies
    rss: dict[str, float] = field(default_factory=dict)


def taken_per_topic(stats: dict[str, Any]) -> dict[str, int]:
    out = dict.fromkeys(INPUTS, 0)
    for tp, off in stats.get("processed", {}).items():
        out[tp.rsplit("[", 1)[0]] += int(off) + 1
    return out


def take_sample(t0: float, worker: Worker, broker_pid: int, pub: TrackingPublisher) -> Sample:
    st = worker.stats()
    busy, total = machine_busy()
    pid = worker.process.pid
    return Sample(
        t=time.monotonic() - t0, taken=taken_per_topic(st),
        delivered=dict(pub.delivered),
        reports=int(st.get("reports", 0)), worker_lag=int(st.get("total_lag", 0)),
        cpu={"worker": cpu_s(pid), "tansu": cpu_s(broker_pid), "bench": time.process_time(),
             "busy": busy, "total": total},
        rss={"worker": rss_mb(pid), "tansu": rss_mb(broker_pid)},
    )


# ---- profiling --------------------------------------------------------------------------
def py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(exe).exists():
        print("(py-spy not installed: `pip install py-spy` into the venv to profile)")
        return None
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                             "--rate", "50", "--nonblocking", "--threads", "--format", "raw",
                             "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


BUCKETS = (  # first match wins, from the leaf up: where the worker's time goes
    ("sink: ClickHouse insert (chDB)", ("insert_arrow", "chdb")),
    ("sink: Arrow conversion", ("sink.py",)),
    ("detectors: step analysis (on_frame)", ("on_frame",)),
    ("detectors: step assembly", ("assembly.py",)),
    ("decode: JSON -> RankStep (msgspec, numpy)", ("decode.py", "steps_decoder.py", "rankstep.py",
                                                   "wire.py")),
    ("heartbeats, hang check, tick", ("on_heartbeat", "hang.py", "routing.py:tick")),
    ("pipeline, merge, routing", ("pipeline.py", "ordering.py", "routing.py", "progress.py")),
    ("Kafka client: fetch, records (aiokafka)", ("aiokafka",)),
    ("faust/mode stream machinery", ("faust", "mode/")),
)


_LINE = re.compile(r":\d+\)$")


def profile_tables(path: Path, seconds: float, rate: int = 50
                   ) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """Share of wall time per bucket (a sample counts in the first bucket any frame hits),
    and the functions where the samples were taken (self time, top 12)."""
    buckets: Counter[str] = Counter()
    leaves: Counter[str] = Counter()
    if not path.exists():
        return [], []
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        thread, *frames = stack.split(";")
        if not frames:
            continue
        if frames[-1].startswith("EpollSelector.select"):
            continue  # waiting (py-spy may sample a thread inside select as active)
        if "MainThread" not in thread:  # faust runs the aiokafka consumer in its own thread
            buckets["(other threads: the aiokafka consumer thread, HTTP)"] += int(n)
            continue
        label = "other Python"
        for name, needles in BUCKETS:
            if any(nd in fr for fr in frames for nd in needles):
                label = name
                break
        buckets[label] += int(n)
        leaves[_LINE.sub(")", frames[-1])] += int(n)
    wall = seconds * rate
    other = buckets.pop("(other threads: the aiokafka consumer thread, HTTP)", 0)
    rows = [(k, v / wall) for k, v in buckets.most_common()]
    rows.append(("main thread idle (waiting for records or I/O)",
                 max(0.0, 1 - sum(buckets.values()) / wall)))
    rows.append(("(other threads: the aiokafka consumer thread, HTTP)", other / wall))
    return rows, [(k, v / wall) for k, v in leaves.most_common(12)]


# ---- the run ----------------------------------------------------------------------------
@dataclass
class Outcome:
    """Everything a run measured, for the report."""

    samples: list[Sample]
    final: dict[str, Any]  # the worker's last /worker/stats
    stored: Any  # /v1/jobs/{job}
    series: Any  # /v1/jobs/{job}/steps
    ranks: Any  # /v1/jobs/{job}/ranks at the newest step
    assignments: int  # "assigned partitions" lines in the worker's log (1 = no rebalance)
    publish_s: float  # pre-load time (throughput mode)
    published: int
    profile: tuple[list[tuple[str, float]], list[tuple[str, float]]]  # buckets, functions
    profile_at: float | None


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
        worker: Worker | None = None
        spy: subprocess.Popen[bytes] | None = None
        stop = threading.Event()
        try:
            ensure_topics(broker.bootstrap, PARTITIONS)
            pub = TrackingPublisher(broker.bootstrap)
            publish_s = 0.0
            if not paced:  # pre-load: the producer must not compete with the worker
                p0 = time.perf_counter()
                publish_events(wl.events(steps), pub, None)
                if pub.flush(600) or pub.failed:
                    raise RuntimeError(f"publishing failed ({pub.failed} failed)")
                publish_s = time.perf_counter() - p0
                print(f"pre-loaded {sum(pub.delivered.values()):,} messages in "
                      f"{publish_s:.1f} s", file=sys.stderr)
            worker = start_worker(broker.bootstrap, tmp, args.worker_env, args.fetch_max_wait_ms)
            worker.wait_ready()
            publisher = None
            if paced:
                def publish() -> None:
                    publish_events(wl.events(steps), pub, args.speed, should_stop=stop.is_set)
                    pub.flush(120)

                publisher = threading.Thread(target=publish, daemon=True)
            t0 = time.monotonic()
            if publisher is not None:
                publisher.start()
            samples: list[Sample] = []
            spy_at = None
            last_progress = (-1, t0)
            while True:
                s = take_sample(t0, worker, broker.pid, pub)
                samples.append(s)
                print(f"  t={s.t:6.1f}s delivered={s.delivered.get(STEPS, 0):>8,} "
                      f"taken={s.taken[STEPS]:>8,} steps stored={s.reports}", file=sys.stderr)
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
            final = worker.stats()
            stored = worker.get(f"/v1/jobs/{wl.job}")
            series = worker.get(f"/v1/jobs/{wl.job}/steps", limit=10000)
            newest = stored.get("last_step") if isinstance(stored, dict) else None
            ranks = (worker.get(f"/v1/jobs/{wl.job}/ranks", step=newest, limit=100000)
                     if newest is not None else {})
            assignments = worker.log_path.read_text(errors="replace").count(
                "(new here:")
        finally:
            stop.set()
            if worker is not None:
                worker.stop()
            broker.stop()
            if args.keep_logs is not None:
                args.keep_logs.mkdir(parents=True, exist_ok=True)
                for f in ("worker.log", "tansu.log", "spy.txt"):
                    if (tmp / f).exists():
                        shutil.copy(tmp / f, args.keep_logs / f)
        profile = (profile_tables(tmp / "spy.txt", args.profile_s) if spy is not None
                   else ([], []))
    return Outcome(samples, final, stored, series, ranks, assignments, publish_s,
                   sum(pub.delivered.values()), profile, spy_at)


def main() -> None:
    args = parse_args()
    paced = args.speed > 0
    if args.duration_s and paced:
        steps = max(1, int(args.duration_s * args.speed / args.step_time))
    else:
        steps = args.steps or 30
    load0 = os.getloadavg()
    g0 = time.perf_counter()
    wl = build_workload(args.gpus, args.distinct, args.step_time, args.microbatches,
                        args.chunks, args.heartbeats, args.first_step)
    gen_s = time.perf_counter() - g0
    n = Counter(t.topic for t in wl.templates)
    print(f"generated {wl.distinct} distinct steps of {wl.world:,} ranks in {gen_s:.1f} s "
          f"({n[STEPS]:,} step and {n[HEARTBEATS]:,} heartbeat messages)", file=sys.stderr)
    out = run(args, wl, steps)
    report(args, wl, steps, out, gen_s, load0)


# ---- the report -------------------------------------------------------------------------
def _at(arr: np.ndarray, n: int) -> int:
    """Value of a per-offset array after n messages (0 before any)."""
    return int(arr[min(n, len(arr)) - 1]) if n > 0 else 0


def _window(samples: list[Sample], paced: bool) -> tuple[Sample, Sample]:
    """The measuring window. Paced: the run after its first minute. Throughput: the whole
    drain, from the worker's readiness to the sample where its last step was stored, with
    everything it took meanwhile (a job's heartbeats are fetched ahead of its steps, so a
    window between stored steps would leave some of them out)."""
    if paced:
        win = [s for s in samples if s.t >= min(60.0, samples[-1].t / 4)]
    else:
        end = next((i for i, s in enumerate(samples) if s.reports >= samples[-1].reports),
                   len(samples) - 1)
        win = samples[:end + 1]
    return (win[0], win[-1]) if len(win) >= 2 else (samples[0], samples[-1])


def report(args: argparse.Namespace, wl: Workload, steps: int, out: Outcome, gen_s: float,
           load0: tuple[float, float, float]) -> None:
    paced = args.speed > 0
    ncpu = os.cpu_count() or 1
    load1 = os.getloadavg()
    index = {t: wl.topic_index(t, steps) for t in INPUTS}
    step_ts, cum_ops = index[STEPS]
    ops_per_rank = cum_ops[-1] / len(step_ts)
    sim_step_s = wl.period_ns / wl.distinct / 1e9
    mode = f"paced x{args.speed:g}" if paced else "throughput (pre-loaded backlog)"
    print(f"\n## Pipeline benchmark: {wl.world:,} GPUs, {mode}\n")
    print(f"- command: `python load-tests/{Path(sys.argv[0]).name} {shlex.join(sys.argv[1:])}`")
    print(f"- machine: {ncpu} cores, {cpu_model()}, {platform.system()} {platform.release()}, "
          f"Python {platform.python_version()}; load average before "
          f"{load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, after "
          f"{load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}")
    hb = "on (agent cadence: 1 Hz samples, keepalive 5 s)" if wl.heartbeats else "off"
    pre = f"; pre-load of {out.published:,} messages {out.publish_s:.1f} s" if not paced else ""
    print(f"- job: {wl.world:,} ranks, {ops_per_rank:.0f} ops per rank-step, simulated step "
          f"{sim_step_s:.2f} s, {steps} steps (cycling {wl.distinct} simulated steps), "
          f"heartbeats {hb}; generation {gen_s:.1f} s (not measured){pre}")
    wait = (Settings().kafka_fetch_max_wait_ms if args.fetch_max_wait_ms is None
            else args.fetch_max_wait_ms)
    fetch = f"fetch wait {wait} ms (faust's own is 1,500 ms)"
    print("- stack: tansu (memory storage) + one `flare worker` process (faust-streaming, "
          f"embedded chDB), loopback; {fetch}")

    s = out.samples
    a, b = _window(s, paced)
    dt = max(b.t - a.t, 1e-9)
    d_steps = b.reports - a.reports
    taken = b.taken[STEPS] - a.taken[STEPS]
    ops = _at(cum_ops, b.taken[STEPS]) - _at(cum_ops, a.taken[STEPS])
    # simulated seconds taken per wall second, from the rank-step rate (the stream time of
    # the offsets taken moves in steps of a whole step, too coarse for a short window)
    rtf = taken / dt * sim_step_s / wl.world
    msgs = sum(b.taken.values()) - sum(a.taken.values())
    cpu = {k: (b.cpu[k] - a.cpu[k]) / dt for k in ("worker", "tansu", "bench")}
    busy = (b.cpu["busy"] - a.cpu["busy"]) / max(b.cpu["total"] - a.cpu["total"], 1) * ncpu
    others = max(0.0, busy - sum(cpu.values()))
    print(f"\n| figure (window {a.t:.0f}–{b.t:.0f} s of the run) | value |")
    print("|---|---:|")
    print(f"| steps diagnosed and stored in the window | {d_steps} |")
    print(f"| rank-steps/s through to ClickHouse (stored steps x ranks) | "
          f"{d_steps * wl.world / dt:,.0f} |")
    print(f"| rank-steps/s taken by the worker (its processed offsets) | {taken / dt:,.0f} |")
    print(f"| ops/s (ops of the rank-steps taken) | {ops / dt:,.0f} |")
    print(f"| input messages/s (steps + heartbeats + job events) | {msgs / dt:,.0f} |")
    print(f"| rank-steps/s the job produces in real time | {wl.world / sim_step_s:,.0f} |")
    print(f"| real-time factor (simulated s taken per wall s) | {rtf:.2f} |")
    print(f"| worker CPU, cores / ms per rank-step taken | {cpu['worker']:.2f} / "
          f"{1e3 * cpu['worker'] * dt / max(taken, 1):.2f} |")
    print(f"| CPU of tansu / the bench / everything else on the machine, cores | "
          f"{cpu['tansu']:.2f} / {cpu['bench']:.2f} / {others:.2f} |")
    print(f"| RSS at the end, worker / tansu, MB | {s[-1].rss['worker']:,.0f} / "
          f"{s[-1].rss['tansu']:,.0f} |")
    if paced:
        lag_table(s, wl, {t: ix[0] for t, ix in index.items()}, sim_step_s)
    stored, series, ranks, final = out.stored, out.series, out.ranks, out.final
    n_stored = stored.get("steps") if isinstance(stored, dict) else stored
    pts = series.get("steps", []) if isinstance(series, dict) else []
    full = sum(1 for p in pts if p.get("n_ranks") == wl.world and p.get("n_missing") == 0)
    partial = [f"{p.get('step')} ({p.get('n_ranks')} ranks)" for p in pts
               if p.get("n_ranks") != wl.world or p.get("n_missing")]
    n_rows = len(ranks.get("ranks", [])) if isinstance(ranks, dict) else 0
    print(f"\nClickHouse, read back through the API: {n_stored} steps stored of {steps} "
          f"published, {full} of them with all {wl.world:,} ranks; {n_rows:,} rank_steps rows "
          f"at the newest step. Worker counters: {final.get('records', 0):,} records, "
          f"{final.get('reports', 0)} step reports, dead letters "
          f"{final.get('dead_letters', {}).get('total', final.get('dead_letters'))}, forced "
          f"order releases {final.get('forced_order_releases')} (waiting on: "
          f"{final.get('forced_order_releases_waiting_on')}), re-delivered and skipped "
          f"{final.get('skipped_redelivered')}, partition assignments {out.assignments} "
          "(1 = no rebalance)." + (f" Steps stored incomplete: {', '.join(partial[:10])}."
                                   if partial else ""))
    buckets, functions = out.profile
    if buckets:
        print(f"\nWorker profile: py-spy, {args.profile_s:.0f} s from t={out.profile_at:.0f} s; "
              "share of the main thread's wall time (where faust runs the agent), a sample "
              "counted in the first of these it touches:\n")
        print("| where | share |")
        print("|---|---:|")
        for name, share in buckets:
            print(f"| {name} | {100 * share:.0f}% |")
        print("\n| main thread: function where the sample was taken (self time) | share |")
        print("|---|---:|")
        for name, share in functions:
            print(f"| `{name}` | {100 * share:.1f}% |")


def backlog_age_s(s: Sample, ts: dict[str, np.ndarray]) -> float:
    """Lag in simulated seconds: how much older than the newest message the broker has
    acknowledged is the oldest message the worker has not taken yet (0: nothing waiting).
    Unlike "newest acknowledged - newest taken" it does not jump by a whole step when the
    burst of a step's rank messages has just arrived."""
    newest = max((int(ts[t][n - 1]) for t in INPUTS
                  if (n := min(s.delivered.get(t, 0), len(ts[t]))) > 0), default=0)
    ages = [newest - int(ts[t][s.taken[t]]) for t in INPUTS
            if s.taken[t] < min(s.delivered.get(t, 0), len(ts[t]))]
    return max(0.0, max(ages, default=0) / 1e9)


def lag_table(samples: list[Sample], wl: Workload, ts: dict[str, np.ndarray],
              sim_step_s: float) -> None:
    """Lag per sample, ours (acknowledged - taken) and the worker's own, and its trend."""
    print("\n| wall s | step msgs published | taken | lag, msgs | worker's own lag, msgs "
          "| lag, simulated s | steps published - stored | worker cores | tansu cores | "
          "tansu RSS, MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lags, times, published = [], [], []
    prev: Sample | None = None
    for s in samples:
        pub_n, took = s.delivered.get(STEPS, 0), s.taken[STEPS]
        lag_msgs = max(0, sum(s.delivered.get(t, 0) for t in INPUTS) - sum(s.taken.values()))
        lag_s = backlog_age_s(s, ts)
        behind = max(0, pub_n // wl.world - s.reports)
        dt = max(s.t - prev.t, 1e-9) if prev is not None else 0.0
        cores, broker = ((s.cpu["worker"] - prev.cpu["worker"]) / dt,
                         (s.cpu["tansu"] - prev.cpu["tansu"]) / dt) if prev else (0.0, 0.0)
        prev = s
        lags.append(lag_s)
        times.append(s.t)
        published.append(sum(s.delivered.values()))
        print(f"| {s.t:.0f} | {pub_n:,} | {took:,} | {lag_msgs:,} | {s.worker_lag:,} | "
              f"{lag_s:.1f} | {behind} | {cores:.2f} | {broker:.2f} | "
              f"{s.rss.get('tansu', 0):,.0f} |")
    t, lag = np.array(times), np.array(lags)
    # only while events were still being published: the drain after the end is no test
    done = t[int(np.argmax(np.array(published) >= published[-1]))]
    steady = (t >= min(60.0, done / 4)) & (t <= done)
    if steady.sum() >= 3:
        slope = float(np.polyfit(t[steady], lag[steady], 1)[0])
        grew = slope * (t[steady][-1] - t[steady][0])
        verdict = "flat" if grew < sim_step_s else "GROWS"
        print(f"\nLag trend from the first minute to the end of publishing (t={done:.0f} s): "
              f"{slope * 60:+.2f} simulated s per minute ({grew:+.1f} s; max "
              f"{lag[steady].max():.1f} s): **{verdict}** (flat: it grows by less than one step). "
              f"Drained {t[-1] - done:.0f} s after the last message was published.")


if __name__ == "__main__":
    main()
