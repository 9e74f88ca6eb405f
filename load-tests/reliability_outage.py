"""Reliability: the broker goes away mid-stream, and comes back.

Usage:
  python load-tests/reliability_outage.py [--down-s 10] [--gpus 32] [--steps 80] [--speed 2]
      [--messages 5000] [--bound 1000] [--stall-s 5] [--persistent]

Needs the `reliability` extra (`pip install -e '.[reliability]'`): a local S3 server (moto)
where a tansu broker can keep its log, so that a restart of the broker loses nothing, as a
Kafka with its data on a volume would. Everything stays on loopback.

1. **Broker restart mid-stream: the worker survives and resumes.** A `flare worker`
   consumes a simulated job replayed at `--speed`; at 40% of the replay the broker is
   stopped (SIGTERM) for `--down-s`, then started again on the same port. This broker is in
   memory, so it comes back empty (topics created again), like a Kafka that lost its disk:
   the worker must not exit (the same PID throughout), and the next job, replayed after the
   restart, must be stored exactly as by a worker that never saw an outage: every table's
   row count (FINAL) and the incident set. `/readyz` is polled every 0.25 s while the broker
   is away and after: it must fail (503, naming the broker) once the broker has not
   answered for the worker's `FLARE_WORKER_STALL_S` (`--stall-s`, 5 s here so the run stays
   short; production's is 30 s), and be 200 again once the broker answers; the script
   reports the seconds from the stop to the first 503, and from the broker answering again
   to the first 200.
2. **The agent's queue while the broker is away.** The node agent's own `Outbox` over the
   real `KafkaPublisher`, against the S3-backed broker: with the broker stopped,
   `--messages` rank-step messages are put; the broker returns and the outbox is closed (it
   publishes and flushes). Must hold: every message arrives exactly once (idempotent
   producer, no duplicates). Then the bound: an outbox of `--bound` messages and a client
   queue of `--bound` (instead of the production 100,000 and 1,000,000 / 512 MiB): what does
   not fit is dropped and counted, and delivered + dropped = put exactly.
3. **With a persistent broker, nothing is lost** (`--persistent`). The same outage, with the
   worker on the S3-backed broker, which comes back with its log, committed offsets and
   group. The job is published at `--speed` through the agent's `Outbox` over the real
   `KafkaPublisher`, before, during (the outbox and the client keep what cannot go out) and
   after the outage. Must hold: the topics then hold every published message exactly once,
   the worker never exited, its rows (FINAL, every table) and incidents equal a clean
   run's, and `/readyz` failed and came back as in 1. The worker's fetch wait is raised to
   `S3_FETCH_WAIT_MS` there: tansu answers a fetch from S3 with nothing once the fetch wait
   is over, so the worker's 20 ms starved partitions of a few hundred batches for good
   (what was seen earlier as a partition that stops being fetched, with no outage at all).

Prints markdown tables and a verdict; exit 1 when a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import reliability_kill as rk

from flare.local.broker import TansuBroker, free_port, start_tansu
from flare.local.processes import flare_argv, start_worker, stop_process
from producers.agent.outbox import Outbox
from producers.live import publish_events
from producers.publisher import KafkaPublisher, encode_key, encode_value
from producers.recording import recording_events
from schemas.topics import INPUT_TOPICS, STEPS
from streams.kafka.follow import TopicFollower, read_until
from streams.kafka.topics import ensure_topics

PARTITIONS = 4
POLL_S = 0.25  # how often /readyz is polled through the outage
# The worker's fetch wait on the S3-backed broker. tansu (0.6) answers a fetch by listing
# every batch object of the partition, and answers *nothing* once the fetch wait is over:
# with the worker's 20 ms, a partition of a few hundred batches on the local S3 server got
# empty answers for good (the stall seen before). 100 ms was enough there; 1 s leaves room.
S3_FETCH_WAIT_MS = 1000


@dataclass
class S3:
    """A local S3 server and the environment a tansu broker needs to keep its log there."""

    url: str

    def env(self) -> dict[str, str]:
        return {"AWS_ENDPOINT": self.url, "AWS_ALLOW_HTTP": "true",
                "AWS_ACCESS_KEY_ID": "flare", "AWS_SECRET_ACCESS_KEY": "flare",
                "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_server(log: Path) -> Iterator[S3]:
    port = free_port()
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                                 "-p", str(port)], stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        rk.wait_for("the S3 server", lambda: _answers(port), 30)
        yield S3(url)
    finally:
        stop_process(proc)


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


class Broker:
    """A tansu broker on a fixed port, stopped and started at will: in memory (a restart
    empties it; the topics are created again) or with its log in a bucket of an S3 server
    (a restart loses nothing)."""

    def __init__(self, log: Path, s3: S3 | None = None, bucket: str = "") -> None:
        if s3 is not None:
            httpx.put(f"{s3.url}/{bucket}").raise_for_status()  # create the bucket
        self.s3, self.bucket, self.log = s3, bucket, log
        self.port = free_port()
        self.current: TansuBroker | None = None
        self.answered_at = 0.0  # time.monotonic() when the last start answered metadata

    def start(self) -> TansuBroker:
        if self.s3 is None:
            self.current = start_tansu(self.port, log_path=self.log)
        else:
            self.current = start_tansu(self.port, log_path=self.log,
                                       storage=f"s3://{self.bucket}/", env=self.s3.env())
        self.answered_at = time.monotonic()
        ensure_topics(self.current.connection, PARTITIONS)
        return self.current

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


def readyz(worker: rk.WorkerProcess) -> tuple[str, str]:
    """`/readyz`'s status code and its reason (the problem's detail), or the error."""
    try:
        r = worker.get("/readyz", 2)
    except httpx.HTTPError as exc:
        return type(exc).__name__, ""
    try:
        detail = str(r.json().get("detail") or "")
    except ValueError:
        detail = ""
    return str(r.status_code), detail


@dataclass
class Probe:
    """`/readyz` polled through an outage: what it said while the broker was away, how
    long after the stop its first 503 came, and how long after the broker answered again
    its first 200."""

    seen_while_away: set[str] = field(default_factory=set)
    changes: list[tuple[float, str]] = field(default_factory=list)  # (s after the stop, code)
    first_503_after_s: float | None = None
    first_503_reason: str = ""
    seen_after: set[str] = field(default_factory=set)
    ready_again_after_s: float | None = None

    def away(self, worker: rk.WorkerProcess, t_down: float, until: float) -> None:
        while time.monotonic() < until:
            code, detail = readyz(worker)
            self.seen_while_away.add(code)
            if not self.changes or self.changes[-1][1] != code:
                self.changes.append((round(time.monotonic() - t_down, 1), code))
            if code == "503" and self.first_503_after_s is None:
                self.first_503_after_s = round(time.monotonic() - t_down, 1)
                self.first_503_reason = detail
            time.sleep(POLL_S)

    def away_story(self) -> str:
        """E.g. "200 from 0.0 s, 503 from 5.4 s": each change of answer while away."""
        return ", ".join(f"{code} from {t} s" for t, code in self.changes)

    def back(self, worker: rk.WorkerProcess, t_back: float, timeout_s: float) -> None:
        while time.monotonic() - t_back < timeout_s:
            code, _ = readyz(worker)
            self.seen_after.add(code)
            if code == "200":
                self.ready_again_after_s = round(time.monotonic() - t_back, 1)
                return
            time.sleep(POLL_S)


def _worker(b: Any, work: Path, env: dict[str, str] | None = None) -> Any:
    """A worker consuming from broker `b` (started and ready), its data under `work`."""
    w = start_worker(b.connection, work, name="w", group=rk.GROUP, partitions=PARTITIONS,
                     api_port=free_port(), cwd=rk.ROOT, extra_env=env)
    w.wait_ready(120)
    return w


def _outage(broker: Broker, w: Any, probe: Probe, before_s: float, down_s: float) -> Any:
    """After `before_s`, the broker away for `down_s` (what `/readyz` said meanwhile is in
    `probe`), then started again; returns the broker's new handle."""
    time.sleep(before_s)
    broker.stop()
    t_down = time.monotonic()  # the broker process has exited: nothing answers
    probe.away(w, t_down, t_down + down_s)
    b = broker.start()
    probe.back(w, broker.answered_at, 60)
    return b


def _stop_and_read(w: Any, run: rk.Run) -> None:
    """Stop the worker (an exit code other than 0 is an error) and read back its job."""
    code = w.stop(60)
    if code != 0:
        raise RuntimeError(f"the worker exited with {code}:\n{w.log_tail()}")
    run.counts, run.incidents = rk.read_back(w.chdb_dir, rk.JOB)


def worker_run(broker: Broker, first: Path, second: Path, work: Path, speed: float,
               replay_s: float, down_s: float, stall_s: float
               ) -> tuple[rk.Run, dict[str, object], Probe]:
    """Job `first` streams in; at 40% of it the broker is away for `down_s`; then job
    `second` is replayed whole. The worker's `/readyz` fails after `stall_s` of silence
    (`FLARE_WORKER_STALL_S`). Returns what was stored of `second`, the notes and what
    `/readyz` said."""
    run = rk.Run(1, None)
    notes: dict[str, object] = {}
    probe = Probe()
    work.mkdir()
    b = broker.start()
    w = _worker(b, work, {"FLARE_WORKER_STALL_S": str(stall_s)})
    try:
        pid = w.process.pid
        player = subprocess.Popen(
            flare_argv("replay", str(first), "--bootstrap", b.bootstrap, "--speed",
                       str(speed)), cwd=rk.ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        b = _outage(broker, w, probe, 0.4 * replay_s, down_s)
        if player.poll() is None:
            player.kill()  # what it had not sent is gone with the broker's memory anyway
        rk.replay_whole(second, b.bootstrap)
        rk.settle(w, 300)
        notes["worker_same_pid"] = w.alive() and w.process.pid == pid
        _stop_and_read(w, run)
    finally:
        if w.alive():
            w.stop(30)
        broker.stop()
    return run, notes, probe


def reference(rec: Path, work: Path) -> rk.Run:
    """Job `rec` alone through a worker on a broker that never goes away."""
    run = rk.Run(0, None)
    work.mkdir()
    broker = Broker(work / "tansu.log")
    b = broker.start()
    w = _worker(b, work)
    try:
        rk.replay_whole(rec, b.bootstrap)
        rk.settle(w, 300)
        _stop_and_read(w, run)
    finally:
        if w.alive():
            w.stop(30)
        broker.stop()
    return run


class OutboxPublisher:
    """`publish_events`' publisher over the agent's `Outbox`: puts never block, so the pace
    holds while the broker is away and the outbox keeps what cannot go out."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any]) -> None:
        self.outbox.put([(topic, encode_key(key), encode_value(value))])

    def poll(self, timeout_s: float = 0.0) -> None:
        pass


def persistent_run(broker: Broker, rec: Path, work: Path, speed: float, replay_s: float,
                   down_s: float, stall_s: float
                   ) -> tuple[rk.Run, dict[str, object], Probe]:
    """Job `rec` published at `speed` through the agent's outbox while a worker consumes;
    at 40% of it the S3-backed broker is away for `down_s`, then started again on the same
    bucket (nothing lost). Returns what was stored, the notes (messages published, in the
    topics, read by the worker) and what `/readyz` said."""
    run = rk.Run(2, None)
    notes: dict[str, object] = {}
    probe = Probe()
    work.mkdir()
    b = broker.start()
    w = _worker(b, work, {"FLARE_WORKER_STALL_S": str(stall_s),
                          "FLARE_KAFKA_FETCH_MAX_WAIT_MS": str(S3_FETCH_WAIT_MS)})
    outbox = Outbox(KafkaPublisher(b.connection))
    try:
        pid = w.process.pid
        outbox.start()
        events = list(recording_events(rec))
        player = threading.Thread(
            target=publish_events, args=(events, OutboxPublisher(outbox), speed), daemon=True)
        player.start()
        # back on the same bucket: the log, the offsets and the group are there again
        b = _outage(broker, w, probe, 0.4 * replay_s, down_s)
        player.join(replay_s * 2 + 60)
        outbox.close(timeout_s=120)
        notes["published"] = len(events)
        notes["outbox"] = {"published": outbox.stats.published, "dropped": outbox.stats.dropped,
                           "publish_errors": outbox.stats.publish_errors,
                           "flush_errors": outbox.stats.flush_errors}
        rk.settle(w, 300)
        stats = w.stats()
        notes["worker_records"] = stats["records"]
        notes["skipped_redelivered"] = stats["skipped_redelivered"]
        notes["worker_same_pid"] = w.alive() and w.process.pid == pid
        _stop_and_read(w, run)
        # What the broker holds of the job: each message once (idempotent producer)?
        want = Counter((t, encode_value(v)) for t, _k, v, _ts in events)
        with TopicFollower(b.connection, INPUT_TOPICS) as f:
            got = read_until(f, lambda ms: len(ms) >= len(events), timeout_s=120)
        held = Counter((m.topic, m.value) for m in got if m.key == rk.JOB.encode())
        notes["in_topics"] = sum(held.values())
        notes["in_topics_distinct"] = len(held)
        notes["in_topics_equal_published"] = held == want
    finally:
        if w.alive():
            w.stop(30)
        broker.stop()
    return run, notes, probe


def agent_queue(broker: Broker, messages: int, bound: int | None, down_s: float
                ) -> dict[str, int]:
    """Put `messages` into the agent's outbox while the broker is away, then bring it back."""
    job = f"outage-agent-{bound or 'prod'}"
    conn = broker.start().connection
    broker.stop()
    extra = {"queue.buffering.max.messages": bound} if bound else None
    publisher = KafkaPublisher(conn, extra=extra) if extra else KafkaPublisher(conn)
    outbox = Outbox(publisher, **({"max_messages": bound} if bound else {}))
    outbox.start()
    t0 = time.monotonic()
    for i in range(messages):
        value = b'{"v":1,"job":"%s","rank":%d,"step":%d}' % (job.encode(), i % 64, i // 64)
        outbox.put([(STEPS, job.encode(), value)])
    time.sleep(max(0.0, down_s - (time.monotonic() - t0)))
    broker.start()
    outbox.close(timeout_s=120)
    with TopicFollower(broker.current.connection if broker.current else conn, [STEPS]) as f:
        got = read_until(f, lambda ms: sum(m.key == job.encode() for m in ms)
                         >= messages - outbox.stats.dropped, timeout_s=60)
    mine = [m.value for m in got if m.key == job.encode()]
    broker.stop()
    return {"put": messages, "delivered": len(mine), "distinct": len(set(mine)),
            "dropped": outbox.stats.dropped, "publish_errors": outbox.stats.publish_errors}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--down-s", type=float, default=10.0)
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--speed", type=float, default=2.0)
    ap.add_argument("--messages", type=int, default=5000)
    ap.add_argument("--bound", type=int, default=1000)
    ap.add_argument("--stall-s", type=float, default=5.0,
                    help="the worker's FLARE_WORKER_STALL_S: /readyz fails after this long "
                    "with no answer from the broker and nothing processed (production: 30)")
    ap.add_argument("--persistent", action="store_true",
                    help="also run the outage with the worker on the S3-backed broker, whose "
                    "restart loses nothing: every message must be stored once")
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="flare-outage-"))
    replay_s = args.steps * 0.5 / args.speed
    try:
        first = rk.simulate(workdir / "first.jsonl", args.gpus, args.steps, 1, "slow_node",
                            job="outage-first")
        second = rk.simulate(workdir / "second.jsonl", args.gpus, args.steps, 0, "slow_gpu")
        ref = reference(second, workdir / "ref")
        out, notes, probe = worker_run(Broker(workdir / "out.log"), first, second,
                                       workdir / "out", args.speed, replay_s, args.down_s,
                                       args.stall_s)
        with s3_server(workdir / "s3.log") as s3:
            prod = agent_queue(Broker(workdir / "agent.log", s3, "agent"), args.messages,
                               None, args.down_s)
            small = agent_queue(Broker(workdir / "bound.log", s3, "bound"), args.messages,
                                args.bound, args.down_s)
            kept = (persistent_run(Broker(workdir / "kept.log", s3, "kept"), second,
                                   workdir / "kept", args.speed, replay_s, args.down_s,
                                   args.stall_s)
                    if args.persistent else None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"`python load-tests/reliability_outage.py {' '.join(argv or sys.argv[1:])}`\n")
    print(f"{rk.machine()}; jobs: {args.gpus} GPUs, {args.steps} steps of 0.5 s; the broker "
          f"away {args.down_s} s at 40% of the first job's replay at {args.speed}x; the "
          f"worker's FLARE_WORKER_STALL_S={args.stall_s:g}\n")
    resumed = rk.same(out, ref)
    ok = resumed and bool(notes.get("worker_same_pid"))
    # /readyz must fail during the outage, saying why, and come back once the broker does
    ok &= probe.first_503_after_s is not None and "broker" in probe.first_503_reason
    ok &= probe.ready_again_after_s is not None
    print("| broker restart mid-stream (in-memory broker) | |\n|---|---|")
    print(f"| the worker never exited (same PID) | {notes.get('worker_same_pid')} |")
    print(f"| /readyz while the broker was away (s after its stop) | {probe.away_story()} |")
    print(f"| first 503 after the broker's stop | {probe.first_503_after_s} s: "
          f"\"{probe.first_503_reason}\" |")
    print(f"| /readyz once the broker answered again | {sorted(probe.seen_after)}; 200 after "
          f"{probe.ready_again_after_s} s |")
    print(f"| the next job's rows equal a clean run's (FINAL, every table) | "
          f"{out.counts == ref.counts} |")
    print(f"| the next job's incidents equal a clean run's | {out.incidents == ref.incidents} |")
    print(f"\nclean run's rows: {ref.counts}\n")
    print("| agent outbox, broker away (S3-backed broker) | put | delivered | distinct | "
          "dropped | errors |")
    print("|---|---|---|---|---|---|")
    for name, r in (("production bounds", prod), (f"bound {args.bound} + {args.bound}", small)):
        print(f"| {name} | {r['put']} | {r['delivered']} | {r['distinct']} | {r['dropped']} "
              f"| {r['publish_errors']} |")
    ok &= prod["delivered"] == prod["distinct"] == prod["put"] and prod["dropped"] == 0
    ok &= small["delivered"] == small["distinct"] == small["put"] - small["dropped"]
    ok &= small["dropped"] > 0
    if kept is not None:
        ok &= print_persistent(*kept, ref)
    print(f"\n{'all checks hold' if ok else 'A CHECK FAILED'}")
    return 0 if ok else 1


def print_persistent(run: rk.Run, notes: dict[str, object], probe: Probe, ref: rk.Run
                     ) -> bool:
    """The persistent run's table; True when every check of it holds."""
    print(f"\n| broker restart mid-stream, S3-backed broker (worker fetch wait "
          f"{S3_FETCH_WAIT_MS} ms) | |\n|---|---|")
    print(f"| the worker never exited (same PID) | {notes.get('worker_same_pid')} |")
    print(f"| /readyz while the broker was away (s after its stop) | {probe.away_story()} |")
    print(f"| first 503 after the broker's stop | {probe.first_503_after_s} s: "
          f"\"{probe.first_503_reason}\" |")
    print(f"| /readyz once the broker answered again | {sorted(probe.seen_after)}; 200 after "
          f"{probe.ready_again_after_s} s |")
    print(f"| messages published (before, during and after the outage) | "
          f"{notes.get('published')}; outbox {notes.get('outbox')} |")
    print(f"| the job's messages in the topics afterwards / distinct / equal to those "
          f"published | {notes.get('in_topics')} / {notes.get('in_topics_distinct')} / "
          f"{notes.get('in_topics_equal_published')} |")
    print(f"| records the worker read / redeliveries it skipped | "
          f"{notes.get('worker_records')} / {notes.get('skipped_redelivered')} |")
    print(f"| the job's rows equal a clean run's (FINAL, every table) | "
          f"{run.counts == ref.counts} |")
    print(f"| the job's incidents equal a clean run's | {run.incidents == ref.incidents} |")
    if run.counts != ref.counts:
        print(f"\nrows: {run.counts}")
    return (rk.same(run, ref) and bool(notes.get("worker_same_pid"))
            and bool(notes.get("in_topics_equal_published"))
            and probe.first_503_after_s is not None
            and probe.ready_again_after_s is not None)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
