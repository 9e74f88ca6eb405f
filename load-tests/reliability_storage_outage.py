"""Reliability: ClickHouse away mid-stream (server mode), and back.

Usage:
  python load-tests/reliability_storage_outage.py [--down-s 30] [--gpus 32] [--steps 80]
      [--speed 2] [--signal kill|term|stop] [--connect-timeout-s N] [--read-timeout-s N]
      [--stop-worker-after-s N] [--keep-logs DIR]

There is no ClickHouse server on the test machines, so the server here is the real engine
(chDB) behind a test HTTP front, `chdb_http.py`, in a process of its own that owns the data
directory; the worker reaches it as it reaches a server in production
(`FLARE_CLICKHOUSE_URL=http://default@127.0.0.1:PORT/flare`, clickhouse-connect's HTTP
client). Everything stays on loopback.

1. **The front answers as the engine does.** Flare's migrations, its writer (the sample
   job of `storage.testing`) and its reads (every table read whole, and the API's
   questions through `storage.reader.Queries`) over HTTP to the front, and in this process
   on embedded chDB: the answers must be equal.
2. **Reference.** A `flare worker` on embedded chDB consumes a simulated job (one slow GPU)
   replayed at `--speed` on a tansu broker; its rows (FINAL, every table) and incidents.
   Each run waits, once the worker has caught up, for the job's end to resolve its
   incidents (`reliability_kill.settle`), so the stored status does not depend on how fast
   a run settled.
3. **The outage.** The same job, on a fresh broker, to a worker whose store is the front. At
   40% of the replay the front's process is stopped (`--signal`: SIGKILL by default, a
   crash; `term` for a clean stop) for `--down-s`, then started again on the same data
   directory and port. Or it hangs instead (`--signal stop`): SIGSTOP freezes it, so the
   kernel still accepts connections into its listen queue and nothing reads or answers
   them (a write on an open connection waits for the read timeout); the script then fills
   that queue, so that every further connect gets no answer at all, as from a host that
   drops packets (a new connection waits for the connect timeout); after `--down-s`,
   SIGCONT, and the front answers again, queued requests included. While it is away
   `/readyz` and `/livez` are polled every 0.25 s (each answer timed), and every second the
   worker's counters (`/worker/stats`: records read, offsets stored and acked, how long the
   write out has waited) and the consumer group's committed offsets and the topics' end
   offsets (from the broker). Must hold: the worker never exited (the same PID, alive at
   every poll); `/livez` answered every poll (within 2 s); the worker's API answered
   each of the reads asked of it one after another meanwhile (`/v1/incidents`, 200 or
   503, each timed: a read must not wait behind the write out); `/readyz` turned 503 naming
   ClickHouse or storage, and 200 again after the front returned; back-pressure: a flush
   failed or a write stayed out (its rows kept, its batch not acked), from then to the
   restart the worker's stored-and-acked offsets did not move, and at no sample did the
   group's committed offsets pass them; after the job, every table's rows (FINAL) and the
   incidents (ids and fields) equal the reference's. Reported, not checked: the records the
   worker read while the front was away (it stops taking input), the backlog growing in the
   topics, and how long the probes took. The stored rows are read back straight from the
   data directory with embedded chDB, not through the front.
4. **A stop during the hang** (`--signal stop --stop-worker-after-s N`, instead of 3): N s
   into the freeze the worker gets a SIGTERM. Must hold: it exits by itself with code 0,
   within compose's 30 s stop_grace_period (its last write's wait is bounded by
   FLARE_WORKER_SHUTDOWN_WRITE_S); the front thaws, a second worker in the same group
   finishes the job, and every table's rows (FINAL) and the incidents equal the
   reference's.

Prints markdown tables and a verdict; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import math
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import reliability_kill as rk
import reliability_outage as ro

from flare.local.broker import free_port, start_tansu
from flare.local.processes import Child, WorkerProcess, flare_argv, spawn, start_worker
from schemas.kafka import KafkaConnection
from schemas.topics import INPUT_TOPICS
from storage.client import ClickHouse, connect
from storage.migrations import applied_migrations, apply_schema
from storage.reader import Queries, read_columns, select_list
from storage.tables import TABLES
from storage.testing import SAMPLE_JOB, load_sample, step_ts
from storage.writer import Sink
from streams.kafka.history import history_config
from streams.kafka.topics import ensure_topics

FRONT = Path(__file__).resolve().parent / "chdb_http.py"
PARTITIONS = 4
POLL_S = 0.25  # /readyz and /livez through the outage
PROBE_TIMEOUT_S = 2.0  # a probe not answered within this counts as not answered
SAMPLE_S = 1.0  # the worker's counters and the group's offsets
READ_WAIT_S = 120.0  # how long a /v1 read through the outage is given to answer
EXIT_WAIT_S = 120.0  # how long a worker told to stop during a hang is given to exit
GRACE_S = 30.0  # docker-compose.yml's stop_grace_period for the worker (then SIGKILL)
TPS = [(t, p) for t in INPUT_TOPICS for p in range(PARTITIONS)]
# Every written column of each table, for reading it whole (storage.reader's rules).
WHOLE_ROWS = {t.name: select_list(read_columns(t)) for t in TABLES}
# The API's questions asked of both stores in the parity check (storage.reader.Queries).
READS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("ping", (), {}),
    ("incidents", (), {}),
    ("incidents", (), {"job": SAMPLE_JOB, "status": "open"}),
    ("incidents", (), {"since_ns": step_ts(100), "limit": 3, "offset": 1}),
    ("incident", (f"{SAMPLE_JOB}/gpu/rank:1/30",), {}),
    ("detections", (SAMPLE_JOB, "rank:1", 0, 100), {"limit": 5}),
    ("jobs", (), {}),
    ("job", (SAMPLE_JOB,), {}),
    ("last_step", (SAMPLE_JOB,), {}),
    ("steps", (SAMPLE_JOB,), {"from_step": 30, "to_step": 59, "stride": 3}),
    ("steps", (SAMPLE_JOB,), {"irregular": ["spike", "pause"]}),
    ("rank_scores", (SAMPLE_JOB, 0, 59), {"sort": "caused_wait"}),
    ("op_steps", (SAMPLE_JOB, 0, 59), {}),
    ("ops", (SAMPLE_JOB, [0, 45, 59]), {}),
    ("dead_letters", (), {}),
]


class Front:
    """`chdb_http.py` on a data directory and a fixed port, stopped and started at will."""

    def __init__(self, data: Path, log: Path) -> None:
        self.data, self.log = data, log
        self.port = free_port()
        self.url = f"http://default@127.0.0.1:{self.port}/flare"
        self.child: Child | None = None
        self.answered_at = 0.0  # time.monotonic() when the last start answered /ping

    def start(self, timeout_s: float = 60.0) -> None:
        argv = [sys.executable, str(FRONT), "--path", str(self.data), "--port", str(self.port),
                "--scratch", str(self.data.parent / "front-scratch")]  # gone with the workdir
        self.child = spawn("front", argv, self.log, dict(os.environ))
        child = self.child
        rk.wait_for("the ClickHouse front", lambda: self._pings(child), timeout_s, 0.05)
        self.answered_at = time.monotonic()

    def _pings(self, child: Child) -> bool:
        if not child.alive():
            raise RuntimeError(f"the front exited:\n{child.log_tail()}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/ping", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def freeze(self) -> tuple[float, int]:
        """SIGSTOP the front, then fill its listen queue: returns time.monotonic() once
        frozen, and how many connections the kernel still accepted for it before the first
        that got no answer. Those and that one are held open until `thaw`."""
        assert self.child is not None
        self.child.process.send_signal(signal.SIGSTOP)
        t = time.monotonic()
        self._held: list[socket.socket] = []
        while len(self._held) < 1024:
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", self.port))
            self._held.append(s)
            _, writable, _ = select.select([], [s], [], 1.0)
            if not writable:  # no SYN-ACK in 1 s: the queue is full, connects now hang
                return t, len(self._held) - 1
        raise RuntimeError("the frozen front's listen queue never filled")

    def thaw(self) -> float:
        """Let the held connections go and SIGCONT the front; returns time.monotonic() once
        it answers /ping again (also kept in `answered_at`)."""
        for s in getattr(self, "_held", []):
            s.close()
        self._held = []
        child = self.child
        assert child is not None
        child.process.send_signal(signal.SIGCONT)
        rk.wait_for("the ClickHouse front to answer again", lambda: self._pings(child), 60,
                    0.05)
        self.answered_at = time.monotonic()
        return self.answered_at

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> float:
        """Stop the front with `sig`; returns time.monotonic() once its process is gone."""
        if getattr(self, "_held", None):
            self.thaw()  # a frozen process takes no SIGTERM
        if self.child is not None and self.child.alive():
            if sig == signal.SIGTERM:
                self.child.stop(30)
            else:
                self.child.process.send_signal(sig)
                self.child.process.wait(30)
        self.child = None
        return time.monotonic()


# -- 1. parity --------------------------------------------------------------------------------


def comparable(value: Any) -> Any:
    """NaN equal to NaN, for comparing answers."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, dict):
        return {k: comparable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [comparable(v) for v in value]
    return value


def answers(db: ClickHouse) -> dict[str, Any]:
    """Everything the parity check compares, from one store: the migrations applied, every
    table read whole, and the API's questions."""
    out: dict[str, Any] = {"migrations": [m.name for m in apply_schema(db)]}
    out["ledger"] = {v: (r["name"], r["checksum"]) for v, r in applied_migrations(db).items()}
    load_sample(Sink(db))
    for table in TABLES:
        out[table.name] = db.rows(f"SELECT {WHOLE_ROWS[table.name]} FROM "
                                  f"{db.table(table.name)} FINAL ORDER BY ALL")
    q = Queries(db)
    for i, (method, args, kwargs) in enumerate(READS):
        out[f"{i}:{method}"] = getattr(q, method)(*args, **kwargs)
    return comparable(out)


def parity(work: Path) -> tuple[int, int, list[str], dict[str, int]]:
    """The answers over HTTP to the front against those of embedded chDB: (questions,
    equal, the keys that differ, rows per table)."""
    front = Front(work / "front-data", work / "front.log")
    front.start()
    try:
        over_http = connect(front.url)
        try:
            got = answers(over_http)
        finally:
            over_http.close()
    finally:
        front.stop()
    embedded = connect(f"chdb:///{(work / 'embedded').as_posix().lstrip('/')}")
    try:
        want = answers(embedded)
    finally:
        embedded.close()
    differ = [k for k in want if got.get(k) != want[k]]
    rows = {t.name: len(want[t.name]) for t in TABLES}
    return len(want), len(want) - len(differ), differ, rows


# -- 2. and 3. the worker runs ----------------------------------------------------------------


@dataclass
class Sample:
    """The worker and the group, `t` seconds after the front's stop."""

    t: float
    records: int  # read by the worker
    acked: dict[str, int]  # per "topic[p]": last offset stored and acked
    committed: dict[str, int]  # per "topic[p]": the group's committed offset (next to read)
    end: dict[str, int]  # per "topic[p]": the broker's end offset
    storage_ok: bool
    storage_failures: int
    writing_s: float  # how long the worker's write out had waited (0: none out)
    readyz: str  # /readyz's status code

    @property
    def acked_total(self) -> int:
        return sum(o + 1 for o in self.acked.values())

    @property
    def committed_total(self) -> int:
        return sum(max(o, 0) for o in self.committed.values())

    @property
    def backlog(self) -> int:
        """Messages in the topics past the group's committed offsets."""
        return sum(max(0, e - max(self.committed.get(k, 0), 0)) for k, e in self.end.items())


@dataclass
class Outage:
    """What was seen through the outage."""

    signal: str = ""
    queue_accepted: int | None = None  # connects the frozen front's kernel still accepted
    livez: list[tuple[float, str, float]] = field(default_factory=list)  # t, code, seconds
    readyz: list[tuple[float, str, float]] = field(default_factory=list)
    reads: list[tuple[float, str, float]] = field(default_factory=list)  # /v1, t, code, s
    livez_before: list[tuple[float, str, float]] = field(default_factory=list)  # streaming
    readyz_before: list[tuple[float, str, float]] = field(default_factory=list)
    worker_alive_throughout: bool = True
    worker_same_pid: bool = False
    readyz_changes: list[tuple[float, str]] = field(default_factory=list)
    first_503_after_s: float | None = None
    first_503_reason: str = ""
    reasons: list[str] = field(default_factory=list)  # distinct 503 reasons, in order
    ready_again_after_s: float | None = None
    at_stop: Sample | None = None  # read once the front's process was gone
    samples: list[Sample] = field(default_factory=list)  # through the outage
    at_restart: Sample | None = None
    after: Sample | None = None  # once /readyz was 200 again


class GroupOffsets:
    """The consumer group's committed offsets and the topics' end offsets, asked of the
    broker by a consumer that never joins the group nor commits."""

    def __init__(self, conn: KafkaConnection) -> None:
        from confluent_kafka import Consumer

        self._consumer = Consumer(history_config(conn, rk.GROUP))

    def read(self) -> tuple[dict[str, int], dict[str, int]]:
        from confluent_kafka import TopicPartition

        got = self._consumer.committed([TopicPartition(t, p) for t, p in TPS], timeout=10)
        committed = {f"{x.topic}[{x.partition}]": int(x.offset) for x in got}
        end = {}
        for t, p in TPS:
            _low, high = self._consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10,
                                                              cached=False)
            end[f"{t}[{p}]"] = int(high)
        return committed, end

    def close(self) -> None:
        self._consumer.close()


def sample(w: WorkerProcess, offsets: GroupOffsets, t: float) -> Sample:
    """The worker's counters and `/readyz`, and the group's offsets, now."""
    stats = w.stats()
    committed, end = offsets.read()
    return Sample(round(t, 1), int(stats["records"]), dict(stats["acked"]), committed, end,
                  bool(stats["storage_ok"]), int(stats["storage_failures"]),
                  float(stats.get("storage_writing_s", 0.0)), ro.readyz(w)[0])


def timed(probe: Any) -> tuple[Any, float]:
    """A probe's answer and the seconds it took."""
    t0 = time.perf_counter()
    out = probe()
    return out, time.perf_counter() - t0


def probes(w: WorkerProcess, t: float
           ) -> tuple[tuple[float, str, float], tuple[float, str, float], str]:
    """`/livez` then `/readyz`, each as (t, status code, seconds it took), and `/readyz`'s
    reason."""
    live, live_s = timed(lambda: livez(w))
    (code, detail), ready_s = timed(lambda: ro.readyz(w))
    return (t, live, live_s), (t, code, ready_s), detail


def livez(w: WorkerProcess) -> str:
    """`/livez`'s status code, or the error's name."""
    try:
        return str(w.get("/livez", PROBE_TIMEOUT_S).status_code)
    except httpx.HTTPError as exc:
        return type(exc).__name__


def reason_kind(detail: str) -> str:
    """A 503's reason, shortened to what kind of storage trouble it names."""
    if not detail.startswith("storage"):
        return detail[:100]
    low = detail.lower()
    for needle, kind in (("has waited", "storage: a write waiting for an answer"),
                         ("read timed out", "storage: read timed out"),
                         ("connect timeout", "storage: connect timed out"),
                         ("connecttimeout", "storage: connect timed out"),
                         ("timed out", "storage: timed out"),
                         ("refused", "storage: connection refused")):
        if needle in low:
            return kind
    return detail.split(":")[0]


def read_rows(data: Path) -> tuple[dict[str, int], dict[str, int], dict[str, dict[str, Any]]]:
    """A stopped store's rows of the job (FINAL and as stored) and its incidents, read
    straight from its data directory with embedded chDB."""
    final, incidents = rk.read_back(data, rk.JOB)
    db = connect(f"chdb:///{data.as_posix().lstrip('/')}")
    stored: dict[str, int] = {}
    try:
        for table in TABLES:
            if "job" in {c.name for c in table.columns}:
                stored[table.name] = int(db.rows(
                    f"SELECT count() AS n FROM {db.table(table.name)} WHERE job = {{job:String}}",
                    {"job": rk.JOB})[0]["n"])
    finally:
        db.close()
    return final, stored, incidents


def _player(rec: Path, bootstrap: str, speed: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen(flare_argv("replay", str(rec), "--bootstrap", bootstrap, "--speed",
                                       str(speed)), cwd=rk.ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def _finish(player: subprocess.Popen[bytes], replay_s: float) -> None:
    out, _ = player.communicate(timeout=replay_s * 4 + 120)
    if player.returncode != 0:
        raise RuntimeError(f"replay failed: {out.decode(errors='replace')[-500:]}")


def _stop_worker(w: WorkerProcess) -> None:
    code = w.stop(60)
    if code != 0:
        raise RuntimeError(f"the worker exited with {code}:\n{w.log_tail()}")


def reference(rec: Path, work: Path, speed: float, replay_s: float
              ) -> tuple[rk.Run, dict[str, int]]:
    """The job through a worker on embedded chDB, no outage: its rows (FINAL) and incidents,
    and its rows as stored."""
    run = rk.Run(0, None)
    work.mkdir()
    with start_tansu(free_port(), log_path=work / "tansu.log") as broker:
        ensure_topics(broker.connection, PARTITIONS)
        w = start_worker(broker.connection, work, name="w", group=rk.GROUP,
                         partitions=PARTITIONS, api_port=free_port(), cwd=rk.ROOT)
        try:
            w.wait_ready(120)
            _finish(_player(rec, broker.bootstrap, speed), replay_s)
            rk.settle(w, 300)
            _stop_worker(w)
        finally:
            if w.alive():
                w.stop(30)
    run.counts, stored, run.incidents = read_rows(w.chdb_dir)
    return run, stored


def outage_run(rec: Path, work: Path, speed: float, replay_s: float, down_s: float,
               sig: signal.Signals, worker_env: dict[str, str]
               ) -> tuple[rk.Run, dict[str, int], Outage]:
    """The job through a worker whose store is the front; the front away (or frozen:
    SIGSTOP) for `down_s` at 40% of the replay. Returns the rows (FINAL), the rows as
    stored, and what was seen."""
    run = rk.Run(1, None)
    seen = Outage(signal=sig.name)
    work.mkdir()
    front = Front(work / "front-data", work / "front.log")
    front.start()
    with start_tansu(free_port(), log_path=work / "tansu.log") as broker:
        ensure_topics(broker.connection, PARTITIONS)
        offsets = GroupOffsets(broker.connection)
        w = start_worker(broker.connection, work, name="w", group=rk.GROUP,
                         partitions=PARTITIONS, api_port=free_port(), cwd=rk.ROOT,
                         extra_env={"FLARE_CLICKHOUSE_URL": front.url, **worker_env})
        player: subprocess.Popen[bytes] | None = None
        try:
            w.wait_ready(120)
            pid = w.process.pid
            player = _player(rec, broker.bootstrap, speed)
            _before(w, seen, time.monotonic() + 0.4 * replay_s)
            if sig == signal.SIGSTOP:  # frozen: connections accepted, or not, never answered
                t_down, seen.queue_accepted = front.freeze()
            else:
                t_down = front.stop(sig)  # its process is gone: nothing answers on the port
            seen.at_stop = sample(w, offsets, time.monotonic() - t_down)
            reader = threading.Thread(target=_reads, args=(w, seen, t_down, down_s, READ_WAIT_S))
            reader.start()
            _away(w, offsets, seen, t_down, down_s)
            reader.join(READ_WAIT_S + 5)
            seen.at_restart = sample(w, offsets, time.monotonic() - t_down)
            if sig == signal.SIGSTOP:
                front.thaw()
            else:
                front.start()
            _back(w, seen, front.answered_at, 120)
            seen.after = sample(w, offsets, time.monotonic() - t_down)
            _finish(player, replay_s)
            rk.settle(w, 300)
            seen.worker_same_pid = w.alive() and w.process.pid == pid
            _stop_worker(w)
        finally:
            if player is not None and player.poll() is None:
                player.kill()
            if w.alive():
                w.stop(30)
            offsets.close()
            front.stop()
    run.counts, stored, run.incidents = read_rows(front.data)
    return run, stored, seen


@dataclass
class StopInHang:
    """A worker told to stop while its store hangs, and its successor."""

    stop_after_s: float  # into the freeze, the SIGTERM
    exit_code: int | None = None
    exit_s: float | None = None  # SIGTERM → the process gone
    killed: bool = False  # it had not exited after EXIT_WAIT_S, so SIGKILL
    acked_at_term: int = 0  # messages stored and acked when it was told to stop
    writing_s_at_term: float = 0.0  # how long its write out had waited by then
    successor_ready_s: float | None = None  # the front answering → the next worker ready
    log_tail: str = ""


def stop_in_hang_run(rec: Path, work: Path, speed: float, replay_s: float, stop_after_s: float,
                     worker_env: dict[str, str]) -> tuple[rk.Run, dict[str, int], StopInHang]:
    """The job through a worker whose store is the front; at 40% of the replay the front
    freezes (SIGSTOP, its listen queue filled) and `stop_after_s` later the worker gets a
    SIGTERM, as an orchestrator's rollout or a node drain sends it. It must exit by itself,
    its wait for the write out bounded by its timeouts; the front then thaws, a second
    worker in the same group takes over, and the job's rows and incidents must be the
    reference's: what the first had not acked is read again."""
    seen = StopInHang(stop_after_s)
    work.mkdir()
    front = Front(work / "front-data", work / "front.log")
    front.start()
    env = {"FLARE_CLICKHOUSE_URL": front.url, **worker_env}
    with start_tansu(free_port(), log_path=work / "tansu.log") as broker:
        ensure_topics(broker.connection, PARTITIONS)
        offsets = GroupOffsets(broker.connection)
        w = start_worker(broker.connection, work, name="w", group=rk.GROUP,
                         partitions=PARTITIONS, api_port=free_port(), cwd=rk.ROOT,
                         extra_env=env)
        w2: WorkerProcess | None = None
        player: subprocess.Popen[bytes] | None = None
        try:
            w.wait_ready(120)
            player = _player(rec, broker.bootstrap, speed)
            time.sleep(0.4 * replay_s)
            t_down, _ = front.freeze()
            time.sleep(max(0.0, t_down + stop_after_s - time.monotonic()))
            at_term = sample(w, offsets, time.monotonic() - t_down)
            seen.acked_at_term, seen.writing_s_at_term = at_term.acked_total, at_term.writing_s
            t_term = time.monotonic()
            w.process.terminate()
            try:
                seen.exit_code = w.process.wait(EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                seen.killed = True
                w.process.kill()
                seen.exit_code = w.process.wait(30)
            seen.exit_s = round(time.monotonic() - t_term, 1)
            seen.log_tail = w.log_tail(8)
            front.thaw()
            w2 = start_worker(broker.connection, work, name="w2", group=rk.GROUP,
                              partitions=PARTITIONS, api_port=free_port(), cwd=rk.ROOT,
                              extra_env=env)
            w2.wait_ready(120)
            seen.successor_ready_s = round(time.monotonic() - front.answered_at, 1)
            _finish(player, replay_s)
            rk.settle(w2, 300)
            _stop_worker(w2)
        finally:
            if player is not None and player.poll() is None:
                player.kill()
            for x in (w, w2):
                if x is not None and x.alive():
                    x.stop(30)
            offsets.close()
            front.stop()
    run = rk.Run(1, None)
    run.counts, stored, run.incidents = read_rows(front.data)
    return run, stored, seen


def _run_header(argv: list[str] | None, args: argparse.Namespace, replay_s: float,
                wall_s: float, how: str) -> None:
    """The command, the machine, the job and what was done to the front."""
    print(f"`python load-tests/reliability_storage_outage.py "
          f"{' '.join(argv or sys.argv[1:])}`\n")
    timeouts = ", ".join(f"{k}={v}" for k, v in (
        ("FLARE_CLICKHOUSE_CONNECT_TIMEOUT_S", args.connect_timeout_s),
        ("FLARE_CLICKHOUSE_READ_TIMEOUT_S", args.read_timeout_s)) if v is not None)
    print(f"{rk.machine()}; job: {args.gpus} GPUs, {args.steps} steps of 0.5 s, one GPU "
          f"slowed x1.5, replayed at {args.speed}x ({replay_s:.0f} s); ClickHouse = chDB "
          f"behind load-tests/chdb_http.py (a test HTTP front, not a ClickHouse server "
          f"binary), {how}; worker timeouts: {timeouts or 'its defaults'}; "
          f"{wall_s / 60:.1f} min in all\n")


def report_stop_in_hang(argv: list[str] | None, args: argparse.Namespace, replay_s: float,
                        wall_s: float, ref: rk.Run, out: rk.Run, seen: StopInHang) -> int:
    """Print the stop-during-a-hang table; 0 when every check holds, else 1."""
    _run_header(argv, args, replay_s, wall_s,
                f"frozen by SIGSTOP at 40% of the replay; the worker sent SIGTERM "
                f"{seen.stop_after_s:g} s into the freeze")
    exited = seen.exit_code == 0 and not seen.killed
    print("| a stop while ClickHouse hangs | |\n|---|---|")
    print(f"| messages stored and acked when told to stop; its write out had waited | "
          f"{seen.acked_at_term}; {seen.writing_s_at_term:.1f} s |")
    print(f"| the worker exited by itself (code 0, no SIGKILL after {EXIT_WAIT_S:g} s) | "
          f"{exited} (code {seen.exit_code}) |")
    in_grace = seen.exit_s is not None and seen.exit_s < GRACE_S
    print(f"| SIGTERM → exit; within compose's stop_grace_period ({GRACE_S:g} s) | "
          f"{seen.exit_s} s; {in_grace} |")
    print(f"| the next worker ready after the front answered | {seen.successor_ready_s} s |")
    print(f"| rows equal the reference's (FINAL, every table) | {out.counts == ref.counts} |")
    print(f"| incidents equal the reference's (ids and fields) | "
          f"{out.incidents == ref.incidents} ({len(out.incidents)}) |")
    print(f"\nthe stopped worker's last lines:\n```\n{seen.log_tail}\n```")
    if out.incidents != ref.incidents:
        print(f"reference incidents: {ref.incidents}\nrun incidents: {out.incidents}")
    ok = exited and in_grace and rk.same(out, ref) and bool(ref.incidents)
    print(f"\n{'all checks hold' if ok else 'A CHECK FAILED'}")
    return 0 if ok else 1


def _away(w: WorkerProcess, offsets: GroupOffsets, seen: Outage, t_down: float,
          down_s: float) -> None:
    """Poll `/livez` and `/readyz`, timed (and the counters every SAMPLE_S), until `down_s`
    after the stop."""
    next_sample = t_down + SAMPLE_S
    while (now := time.monotonic()) < t_down + down_s:
        seen.worker_alive_throughout &= w.alive()
        t = round(now - t_down, 1)
        live, ready, detail = probes(w, t)
        seen.livez.append(live)
        seen.readyz.append(ready)
        code = ready[1]
        if not seen.readyz_changes or seen.readyz_changes[-1][1] != code:
            seen.readyz_changes.append((t, code))
        if code == "503":
            if seen.first_503_after_s is None:
                seen.first_503_after_s, seen.first_503_reason = t, detail
            reason = reason_kind(detail)
            if reason not in seen.reasons:
                seen.reasons.append(reason)
        if now >= next_sample:
            seen.samples.append(sample(w, offsets, now - t_down))
            next_sample += SAMPLE_S
        time.sleep(POLL_S)


def _reads(w: WorkerProcess, seen: Outage, t_down: float, down_s: float,
           timeout_s: float) -> None:
    """Ask the worker's API for its incidents (`/v1/incidents`, a read of the store the
    writes go to) one after the other, each timed, until `down_s` after the stop: each
    must answer, 200 or 503, within its own timeouts, not wait behind a write out."""
    while (now := time.monotonic()) < t_down + down_s:
        try:
            code = str(w.get("/v1/incidents", timeout_s, limit=1).status_code)
        except httpx.HTTPError as exc:
            code = type(exc).__name__
        seen.reads.append((round(now - t_down, 1), code, time.monotonic() - now))
        time.sleep(POLL_S)


def _before(w: WorkerProcess, seen: Outage, until: float) -> None:
    """Time the probes while the worker streams with its store answering, for comparison."""
    while (now := time.monotonic()) < until:
        live, ready, _detail = probes(w, now)
        seen.livez_before.append(live)
        seen.readyz_before.append(ready)
        time.sleep(POLL_S)


def _back(w: WorkerProcess, seen: Outage, t_back: float, timeout_s: float) -> None:
    """Poll `/readyz` until it is 200 again: seconds from the front answering."""
    while time.monotonic() - t_back < timeout_s:
        seen.worker_alive_throughout &= w.alive()
        code, _ = ro.readyz(w)
        if code == "200":
            seen.ready_again_after_s = round(time.monotonic() - t_back, 1)
            return
        time.sleep(POLL_S)


# -- verdict ----------------------------------------------------------------------------------


def back_pressure(seen: Outage) -> dict[str, bool]:
    """The back-pressure checks: once a flush failed (the front gone; its rows kept, its
    batch not acked) or a write stayed out (the front frozen), the worker's stored-and-acked
    offsets stay where they are until the front is back, and at no time does the group's
    committed offset pass them. (Before that a batch that produced no rows may still be
    acked: it has nothing to store; and a write answered just before the stop is acked just
    after it.)"""
    stop, restart = seen.at_stop, seen.at_restart
    assert stop is not None and restart is not None
    during = [stop, *seen.samples, restart]
    stuck = [s for s in during if s.storage_failures > stop.storage_failures
             or (s is not stop and s.writing_s >= SAMPLE_S)]
    stuck = during[during.index(stuck[0]):] if stuck else []
    return {
        "a flush failed or a write stayed out while away (its rows kept, its batch not "
        "acked)": bool(stuck),
        "acked offsets frozen from then to the restart": bool(stuck) and all(
            s.acked == stuck[0].acked for s in stuck),
        "no committed offset past the acked ones": all(
            s.committed.get(k, -1) <= restart.acked.get(k, -1) + 1
            for s in during for k in s.committed),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--down-s", type=float, default=30.0)
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--speed", type=float, default=2.0)
    ap.add_argument("--signal", choices=("kill", "term", "stop"), default="kill",
                    help="how the front is stopped: SIGKILL (a crash, default), SIGTERM, or "
                    "SIGSTOP (it hangs: connections accepted, or not, and never answered; "
                    "SIGCONT after --down-s)")
    ap.add_argument("--connect-timeout-s", type=int, default=None,
                    help="the worker's FLARE_CLICKHOUSE_CONNECT_TIMEOUT_S (default: its own)")
    ap.add_argument("--read-timeout-s", type=int, default=None,
                    help="the worker's FLARE_CLICKHOUSE_READ_TIMEOUT_S (default: its own)")
    ap.add_argument("--stop-worker-after-s", type=float, default=None,
                    help="with --signal stop: SIGTERM the worker this long into the freeze, "
                    "thaw once it exits, and let a second worker finish the job")
    ap.add_argument("--keep-logs", type=Path, default=None,
                    help="copy the worker's, the front's and tansu's logs here")
    args = ap.parse_args(argv)
    if args.stop_worker_after_s is not None and args.signal != "stop":
        ap.error("--stop-worker-after-s needs --signal stop (a store that hangs)")
    sig = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP}[args.signal]
    worker_env = {name: str(value) for name, value in (
        ("FLARE_CLICKHOUSE_CONNECT_TIMEOUT_S", args.connect_timeout_s),
        ("FLARE_CLICKHOUSE_READ_TIMEOUT_S", args.read_timeout_s)) if value is not None}
    workdir = Path(tempfile.mkdtemp(prefix="flare-storage-outage-"))
    replay_s = args.steps * 0.5 / args.speed
    t0 = time.monotonic()
    try:
        checked, equal, differ, sample_rows = parity(workdir / "parity")
        print(f"parity: {equal} of {checked} answers equal", file=sys.stderr)
        rec = rk.simulate(workdir / "job.jsonl", args.gpus, args.steps, 0, "slow_gpu")
        ref, ref_stored = reference(rec, workdir / "ref", args.speed, replay_s)
        print(f"reference: {ref.counts}", file=sys.stderr)
        if args.stop_worker_after_s is not None:
            out, _, stopped = stop_in_hang_run(rec, workdir / "out", args.speed, replay_s,
                                               args.stop_worker_after_s, worker_env)
        else:
            out, stored, seen = outage_run(rec, workdir / "out", args.speed, replay_s,
                                           args.down_s, sig, worker_env)
    finally:
        if args.keep_logs is not None:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            for log in workdir.rglob("*.log"):
                shutil.copy(log, args.keep_logs / "-".join(log.relative_to(workdir).parts))
        shutil.rmtree(workdir, ignore_errors=True)
    wall_s = time.monotonic() - t0
    if args.stop_worker_after_s is not None:
        return report_stop_in_hang(argv, args, replay_s, wall_s, ref, out, stopped)
    return report(argv, args, replay_s, wall_s, (checked, equal, differ, sample_rows), ref,
                  out, {"reference": ref_stored, "outage": stored}, seen)


def report(argv: list[str] | None, args: argparse.Namespace, replay_s: float, wall_s: float,
           par: tuple[int, int, list[str], dict[str, int]], ref: rk.Run, out: rk.Run,
           stored: dict[str, dict[str, int]], seen: Outage) -> int:
    """Print the tables; 0 when every check holds, else 1."""
    checked, equal, differ, sample_rows = par
    stop, restart, after = seen.at_stop, seen.at_restart, seen.after
    assert stop is not None and restart is not None and after is not None
    frozen = seen.signal == "SIGSTOP"
    _run_header(argv, args, replay_s, wall_s,
                f"frozen by SIGSTOP (its listen queue then filled: {seen.queue_accepted} "
                f"connections accepted, further connects unanswered) at 40% of the replay for "
                f"{args.down_s:g} s, then SIGCONT" if frozen else
                f"stopped by SIG{seen.signal[3:]} at 40% of the replay for {args.down_s:g} s")

    print("| the front answers as embedded chDB does | |\n|---|---|")
    print(f"| migrations, every table read whole (FINAL), {len(READS)} API questions | "
          f"{equal} of {checked} equal{'; differ: ' + ', '.join(differ) if differ else ''} |")
    print(f"| sample rows compared | {sample_rows} |\n")

    ok = equal == checked
    bp = back_pressure(seen)
    during = [stop, *seen.samples, restart]
    story = ", ".join(f"{code} from {t} s" for t, code in seen.readyz_changes)
    names = any(k in seen.first_503_reason for k in ("storage", "ClickHouse"))
    print("| ClickHouse away mid-stream | |\n|---|---|")
    print(f"| the worker never exited (same PID, alive at every poll) | "
          f"{seen.worker_same_pid and seen.worker_alive_throughout} |")
    print(f"| /readyz while the front was away (s after its stop) | {story} |")
    print(f"| first 503 after the stop | {seen.first_503_after_s} s: "
          f"\"{seen.first_503_reason[:160]}\" |")
    print(f"| 503 reasons seen while away | {'; '.join(r[:100] for r in seen.reasons)} |")
    print(f"| 200 again after the front answered | {seen.ready_again_after_s} s |")
    live_ok = bool(seen.livez) and all(code == "200" for _t, code, _s in seen.livez)
    for name, when, polls in (("/livez", "while away", seen.livez),
                              ("/readyz", "while away", seen.readyz),
                              ("/livez", "before the stop", seen.livez_before),
                              ("/readyz", "before the stop", seen.readyz_before)):
        took = sorted(x for _t, _c, x in polls)
        answered = sum(code in ("200", "503") for _t, code, _s in polls)
        print(f"| {name} {when}: polls answered (200 or 503) / polled; median, slowest "
              f"answer | {answered} / {len(polls)}; {statistics.median(took) * 1e3:.0f} ms, "
              f"{took[-1] * 1e3:.0f} ms |")
    reads = sorted(x for _t, _c, x in seen.reads)
    read_codes = sorted({c for _t, c, _s in seen.reads})
    reads_ok = bool(reads) and all(c in ("200", "503") for _t, c, _s in seen.reads)
    if reads:
        print(f"| /v1/incidents while away, one after another: answered (200 or 503) / "
              f"asked; codes; median, slowest answer | "
              f"{sum(c in ('200', '503') for _t, c, _s in seen.reads)} / {len(reads)}; "
              f"{', '.join(read_codes)}; {statistics.median(reads):.1f} s, {reads[-1]:.1f} s |")
    for name, held in bp.items():
        print(f"| back-pressure: {name} | {held} |")
    print(f"| storage_ok false at the counters' samples while away | "
          f"{sum(not s.storage_ok for s in seen.samples)} of {len(seen.samples)} |")
    print(f"| records read by the worker: at the stop / at the restart | {stop.records} / "
          f"{restart.records} |")
    print(f"| messages stored and acked: at the stop / at the restart | {stop.acked_total} / "
          f"{restart.acked_total} |")
    print(f"| group's committed offsets (sum): at the stop / highest while away / at the "
          f"restart / once ready again | {stop.committed_total} / "
          f"{max(s.committed_total for s in during)} / {restart.committed_total} / "
          f"{after.committed_total} |")
    print(f"| backlog in the topics past the committed offsets: at the stop / at the restart "
          f"| {stop.backlog} / {restart.backlog} |")
    print(f"| failed flushes while away | {restart.storage_failures - stop.storage_failures} |")
    print(f"| rows equal the reference's (FINAL, every table) | {out.counts == ref.counts} |")
    print(f"| incidents equal the reference's (ids and fields) | "
          f"{out.incidents == ref.incidents} ({len(out.incidents)}) |")
    print("\n| s after the stop | /readyz | records read | stored and acked | committed "
          "(group) | backlog past committed | storage_ok | write out for (s) |\n"
          "|---|---|---|---|---|---|---|---|")
    every = max(1, round(5 / SAMPLE_S))
    shown = [(" (stop)", stop), *(("", s) for s in seen.samples[every - 1::every]),
             (" (restart)", restart), (" (ready again)", after)]
    for label, s in shown:
        print(f"| {s.t}{label} | {s.readyz} | {s.records} | {s.acked_total} | "
              f"{s.committed_total} | {s.backlog} | {s.storage_ok} | {s.writing_s:.1f} |")
    print(f"\nreference rows (FINAL): {ref.counts}")
    print(f"outage run rows (FINAL): {out.counts}")
    print(f"rows before FINAL (an incident's states and any re-sent row, until background "
          f"merges fold them; their timing varies): reference {stored['reference']}; outage "
          f"run {stored['outage']}")
    print(f"incidents: {[(i['kind'], i['culprit'], i['status']) for i in ref.incidents.values()]}")
    if out.incidents != ref.incidents:
        print(f"reference incidents: {ref.incidents}\noutage run incidents: {out.incidents}")

    ok &= seen.worker_same_pid and seen.worker_alive_throughout and live_ok and reads_ok
    ok &= seen.first_503_after_s is not None and names
    ok &= seen.ready_again_after_s is not None
    ok &= all(bp.values())
    ok &= rk.same(out, ref) and bool(ref.incidents)
    print(f"\n{'all checks hold' if ok else 'A CHECK FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
