"""Reading a topic without joining a consumer group: `flare up`'s incident printer, tests.

A group member has to wait for a group join (about half the session timeout on tansu) and
commits offsets nobody needs; a follower that only prints or checks what flows by assigns
itself every partition instead. From the beginning on a fresh local broker, from the end on
a real Kafka (tansu answers ListOffsets(latest) off by a batch, so "end" is only trusted on
a real broker).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, TopicPartition

from schemas.clock import SecondsClock
from schemas.kafka import KafkaConnection


@dataclass(frozen=True, slots=True)
class Received:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def follower_config(conn: KafkaConnection) -> dict[str, Any]:
    """A consumer that assigns itself partitions: it never joins a group nor commits."""
    return {
        **conn.librdkafka(),
        "group.id": "flare-follower",  # required by librdkafka; never joined nor committed
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "log_level": 0,
    }


class TopicFollower:
    """All partitions of some topics, assigned (no group), from the beginning or the end."""

    def __init__(self, conn: KafkaConnection, topics: Iterable[str], *,
                 from_beginning: bool = True, timeout_s: float = 10.0) -> None:
        self._consumer = Consumer(follower_config(conn))
        start = OFFSET_BEGINNING if from_beginning else OFFSET_END
        assignment = []
        for topic in topics:
            md = self._consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
            if md is None or md.error is not None or not md.partitions:
                raise RuntimeError(f"topic {topic} does not exist on {conn.bootstrap}")
            assignment += [TopicPartition(topic, p, start) for p in sorted(md.partitions)]
        self._consumer.assign(assignment)

    def poll(self, timeout_s: float = 0.5, max_messages: int = 1000) -> list[Received]:
        out: list[Received] = []
        for m in self._consumer.consume(max_messages, timeout_s):
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                raise RuntimeError(f"reading {m.topic()}: {err}")
            out.append(Received(str(m.topic()), int(m.partition() or 0), int(m.offset() or 0),
                                m.key(), m.value()))
        return out

    def close(self) -> None:
        self._consumer.close()

    def __enter__(self) -> TopicFollower:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def read_until(
    follower: TopicFollower,
    done: Callable[[list[Received]], bool],
    *,
    timeout_s: float,
    clock: SecondsClock = time.monotonic,
) -> list[Received]:
    """Everything read until `done(all so far)` is true, or `timeout_s` passed."""
    got: list[Received] = []
    deadline = clock() + timeout_s
    while clock() < deadline:
        got.extend(follower.poll(0.5))
        if done(got):
            break
    return got
