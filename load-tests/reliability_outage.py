"""Reliability: the broker goes away mid-stream, and comes back.

Usage:
  python load-tests/reliability_outage.py [--down-s 10] [--gpus 32] [--steps 80] [--speed 2]
      [--messages 5000] [--bound 1000]

Needs the `reliability` extra (`pip install -e '.[reliability]'`): a local S3 server (moto)
where a tansu broker can keep its log, so that a restart of the broker loses nothing, as a
Kafka with its data on a volume would. Everything stays on loopback.

1. **Broker restart mid-stream: the worker survives and resumes.** A `flare worker`
   consumes a simulated job replayed at `--speed`; at 40% of the replay the broker is
   stopped (SIGTERM) for `--down-s`, then started again on the same port. This broker is in
   memory, so it comes back empty (topics created again), like a Kafka that lost its disk:
   the worker must not exit (the same PID throughout), and the next job, replayed after the
   restart, must be stored exactly as by a worker that never saw an outage: every table's
   row count (FINAL) and the incident set. `/readyz` is sampled while the broker is away and
   after. (A worker consuming from tansu's S3 storage while a producer appends was seen to
   stop fetching one partition for good, with no outage at all, so the worker side of this
   check runs on the in-memory broker; on Kafka the committed offsets survive a restart and
   `reliability_kill.py` shows that resuming from them loses nothing.)
2. **The agent's queue while the broker is away.** The node agent's own `Outbox` over the
   real `KafkaPublisher`, against the S3-backed broker: with the broker stopped,
   `--messages` rank-step messages are put; the broker returns and the outbox is closed (it
   publishes and flushes). Must hold: every message arrives exactly once (idempotent
   producer, no duplicates). Then the bound: an outbox of `--bound` messages and a client
   queue of `--bound` (instead of the production 100,000 and 1,000,000 / 512 MiB): what does
   not fit is dropped and counted, and delivered + dropped = put exactly.

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
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import reliability_kill as rk

from flare.local.broker import TansuBroker, free_port, start_tansu
from flare.local.processes import flare_argv, start_worker, stop_process
from producers.agent.outbox import Outbox
from producers.publisher import KafkaPublisher
from schemas.topics import STEPS
from streams.kafka.follow import TopicFollower, read_until
from streams.kafka.topics import ensure_topics

PARTITIONS = 4


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

    def start(self) -> TansuBroker:
        if self.s3 is None:
            self.current = start_tansu(self.port, log_path=self.log)
        else:
            self.current = start_tansu(self.port, log_path=self.log,
                                       storage=f"s3://{self.bucket}/", env=self.s3.env())
        ensure_topics(self.current.connection, PARTITIONS)
        return self.current

    def stop(self) -> None:
        if self.current is not None:
            self.current.stop()
            self.current = None


def readyz(worker: rk.WorkerProcess) -> str:
    try:
        return str(worker.get("/readyz", 2).status_code)
    except httpx.HTTPError as exc:
        return type(exc).__name__


def worker_run(broker: Broker, first: Path, second: Path, work: Path, speed: float,
               replay_s: float, down_s: float) -> tuple[rk.Run, dict[str, object]]:
    """Job `first` streams in; at 40% of it the broker is away for `down_s`; then job
    `second` is replayed whole. Returns what was stored of `second`, and the notes."""
    run = rk.Run(1, None)
    notes: dict[str, object] = {}
    work.mkdir()
    b = broker.start()
    w = start_worker(b.connection, work, name="w", group=rk.GROUP, partitions=PARTITIONS,
                     api_port=free_port(), cwd=rk.ROOT)
    try:
        w.wait_ready(120)
        pid = w.process.pid
        player = subprocess.Popen(
            flare_argv("replay", str(first), "--bootstrap", b.bootstrap, "--speed",
                       str(speed)), cwd=rk.ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT)
        time.sleep(0.4 * replay_s)
        broker.stop()
        t_down = time.monotonic()
        seen = set()
        while time.monotonic() - t_down < down_s:
            seen.add(readyz(w))
            time.sleep(0.5)
        notes["readyz_while_away"] = sorted(seen)
        if player.poll() is None:
            player.kill()  # what it had not sent is gone with the broker's memory anyway
        b = broker.start()
        after = set()
        t_back = time.monotonic()
        while time.monotonic() - t_back < 30 and "200" not in after:
            after.add(readyz(w))
            time.sleep(0.5)
        notes["readyz_after"] = sorted(after)
        notes["ready_again_after_s"] = round(time.monotonic() - t_back, 1)
        rk.replay_whole(second, b.bootstrap)
        rk.settle(w, 300)
        notes["worker_same_pid"] = w.alive() and w.process.pid == pid
        code = w.stop(60)
        if code != 0:
            raise RuntimeError(f"the worker exited with {code}:\n{w.log_tail()}")
        run.counts, run.incidents = rk.read_back(w.chdb_dir, rk.JOB)
    finally:
        if w.alive():
            w.stop(30)
        broker.stop()
    return run, notes


def reference(rec: Path, work: Path) -> rk.Run:
    """Job `rec` alone through a worker on a broker that never goes away."""
    run = rk.Run(0, None)
    work.mkdir()
    broker = Broker(work / "tansu.log")
    b = broker.start()
    w = start_worker(b.connection, work, name="w", group=rk.GROUP, partitions=PARTITIONS,
                     api_port=free_port(), cwd=rk.ROOT)
    try:
        w.wait_ready(120)
        rk.replay_whole(rec, b.bootstrap)
        rk.settle(w, 300)
        w.stop(60)
        run.counts, run.incidents = rk.read_back(w.chdb_dir, rk.JOB)
    finally:
        if w.alive():
            w.stop(30)
        broker.stop()
    return run


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
    args = ap.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="flare-outage-"))
    replay_s = args.steps * 0.5 / args.speed
    try:
        first = rk.simulate(workdir / "first.jsonl", args.gpus, args.steps, 1, "slow_node",
                            job="outage-first")
        second = rk.simulate(workdir / "second.jsonl", args.gpus, args.steps, 0, "slow_gpu")
        ref = reference(second, workdir / "ref")
        out, notes = worker_run(Broker(workdir / "out.log"), first, second, workdir / "out",
                                args.speed, replay_s, args.down_s)
        with s3_server(workdir / "s3.log") as s3:
            prod = agent_queue(Broker(workdir / "agent.log", s3, "agent"), args.messages,
                               None, args.down_s)
            small = agent_queue(Broker(workdir / "bound.log", s3, "bound"), args.messages,
                                args.bound, args.down_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"`python load-tests/reliability_outage.py {' '.join(argv or sys.argv[1:])}`\n")
    print(f"{rk.machine()}; jobs: {args.gpus} GPUs, {args.steps} steps of 0.5 s; the broker "
          f"away {args.down_s} s at 40% of the first job's replay at {args.speed}x\n")
    resumed = rk.same(out, ref)
    ok = resumed and bool(notes.get("worker_same_pid"))
    print("| broker restart mid-stream (in-memory broker) | |\n|---|---|")
    print(f"| the worker never exited (same PID) | {notes.get('worker_same_pid')} |")
    print(f"| /readyz while the broker was away | {notes.get('readyz_while_away')} |")
    print(f"| /readyz once it was back | {notes.get('readyz_after')}, ready after "
          f"{notes.get('ready_again_after_s')} s |")
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
    print(f"\n{'all checks hold' if ok else 'A CHECK FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
