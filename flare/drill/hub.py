"""The drill's broker host: a tansu broker in the hub namespace, and what it received.

In a real cluster each node's agent publishes over the node's own NIC to a Kafka cluster
elsewhere. The drill does the same: the broker runs in the hub namespace of the run's
testbed, so every agent's messages cross its node's veth to reach it. A NIC fault therefore
slows the faulty node's telemetry too, as it would in production. Without root the broker
runs on loopback instead.

The broker is reached only from inside the hub, so the two clients of it run there as
separate processes (`python -m flare.drill.hub topics|collect`):
- `topics` waits for the broker and creates the input topics before any agent starts;
- `collect` reads back every message of the run once the agents have stopped, as the
  recording the verdict is drawn from. The agents' own copies (`flare agent --record`) say
  how many messages were sent, so a loss in transit shows as a count, not as a miss.

    python -m flare.drill.hub collect 10.77.0.1:39092 run.jsonl --expect 4127
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

COLLECT_IDLE_S = 5.0  # no new message for this long: the broker holds nothing more
COLLECT_LIMIT_S = 120.0  # at most this long to read back a run, whatever it expected
FIRST_MESSAGE_S = 30.0  # a consumer that has read nothing by then will read nothing


class HubError(RuntimeError):
    """The broker of the run did not start, or its messages could not be read back."""


@dataclass(slots=True)
class HubBroker:
    """A tansu broker on `address:port`, run through `wrap` (the hub namespace, or nothing).

    A context manager: the broker stops on exit, and with it every message it held.
    """

    address: str
    port: int
    wrap: list[str]  # argv prefix that runs a command in the hub ("ip netns exec …"), or []
    log: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.address}:{self.port}"

    def __enter__(self) -> HubBroker:
        from flare.local.broker import tansu_argv

        with open(self.log, "ab") as log:
            self.process = subprocess.Popen([*self.wrap, *tansu_argv(self.address, self.port)],
                                            stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT)
        try:
            self._client("topics", self.bootstrap)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def collect(self, out: Path, expect: int) -> int:
        """Read every message the broker holds into the recording `out`; returns the count."""
        got = self._client("collect", self.bootstrap, str(out), "--expect", str(expect))
        return int(got.split()[0])

    def _client(self, *args: str) -> str:
        argv = [*self.wrap, sys.executable, "-m", "flare.drill.hub", *args]
        done = subprocess.run(argv, capture_output=True, text=True,
                              timeout=COLLECT_LIMIT_S + 60)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])
            raise HubError(f"the broker host could not {args[0]} ({tail}); broker log: "
                           f"{self.log}")
        return done.stdout


def _create_topics(bootstrap: str) -> None:
    from flare.local.broker import wait_for_broker
    from schemas.kafka import KafkaConnection
    from schemas.topics import INPUT_TOPICS
    from streams.kafka.topics import ensure_topics

    conn = KafkaConnection(bootstrap=bootstrap)
    wait_for_broker(conn, timeout_s=30.0)
    ensure_topics(conn, 1, topics=INPUT_TOPICS)


def _read_back(bootstrap: str, expect: int) -> Iterator[bytes]:
    """Every message on the input topics, as recording lines, until `expect` were read or
    the broker stayed silent for `COLLECT_IDLE_S`."""
    import orjson
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from producers.recording import recording_line
    from schemas.topics import INPUT_TOPICS

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"drill-{time.time_ns()}",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False})
    # every partition from its start, assigned rather than subscribed: nothing else reads
    # these topics, and a consumer group's join cost the broker host some 20 s of each drill
    meta = consumer.list_topics(timeout=FIRST_MESSAGE_S)
    consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in INPUT_TOPICS
                     if t in meta.topics for p in meta.topics[t].partitions])
    start = last = time.monotonic()
    n = 0
    try:
        while n < expect and time.monotonic() - start < COLLECT_LIMIT_S:
            msg = consumer.poll(0.5)
            if msg is None or msg.error() is not None:
                silent = time.monotonic() - last
                if silent > (COLLECT_IDLE_S if n else FIRST_MESSAGE_S):
                    break  # (the group join takes a few seconds before the first message)
                continue
            last = time.monotonic()
            n += 1
            key = (msg.key() or b"").decode()
            yield recording_line(msg.topic() or "", key, orjson.loads(msg.value() or b"{}"))
    finally:
        consumer.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m flare.drill.hub")
    sub = ap.add_subparsers(dest="what", required=True)
    sub.add_parser("topics").add_argument("bootstrap")
    col = sub.add_parser("collect")
    col.add_argument("bootstrap")
    col.add_argument("out", type=Path)
    col.add_argument("--expect", type=int, required=True)
    a = ap.parse_args(argv)
    if a.what == "topics":
        _create_topics(a.bootstrap)
        return
    n = 0
    with open(a.out, "wb") as f:
        for line in _read_back(a.bootstrap, a.expect):
            f.write(line)
            n += 1
    print(f"{n} messages")


if __name__ == "__main__":
    main()
