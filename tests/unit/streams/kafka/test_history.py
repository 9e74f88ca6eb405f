"""Reading the history before a group's committed offsets, with a scripted consumer."""

from __future__ import annotations

from typing import Any

from confluent_kafka import KafkaError, TopicPartition

from schemas.kafka import KafkaConnection
from schemas.testing import FakeClock
from schemas.topics import HEARTBEATS, STEPS
from streams.kafka.history import KafkaHistory
from streams.pipeline import Record


class Msg:
    def __init__(self, topic: str, partition: int, offset: int, eof: bool = False) -> None:
        self._tp = (topic, partition, offset)
        self._err = KafkaError(KafkaError._PARTITION_EOF) if eof else None

    def topic(self) -> str:
        return self._tp[0]

    def partition(self) -> int:
        return self._tp[1]

    def offset(self) -> int:
        return self._tp[2]

    def key(self) -> bytes:
        return b"j"

    def value(self) -> bytes:
        return b"%d" % self._tp[2]

    def error(self) -> KafkaError | None:
        return self._err


class ScriptedConsumer:
    """Committed offsets and the log of each topic-partition; `consume` serves what was
    assigned, then an end-of-partition event."""

    def __init__(self, committed: dict[tuple[str, int], int], log_end: int) -> None:
        self.committed_at = committed
        self.log_end = log_end
        self.assigned: list[TopicPartition] = []
        self.closed = False
        self.config: dict[str, Any] = {}

    def committed(self, tps: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition,
                               self.committed_at.get((tp.topic, tp.partition), -1001))
                for tp in tps]

    def assign(self, tps: list[TopicPartition]) -> None:
        self.assigned = tps

    def consume(self, n: int, timeout: float) -> list[Msg]:
        out: list[Msg] = []
        for tp in self.assigned:
            out += [Msg(tp.topic, tp.partition, o) for o in range(tp.offset, self.log_end)]
            out.append(Msg(tp.topic, tp.partition, self.log_end, eof=True))
        self.assigned = []
        return out

    def close(self) -> None:
        self.closed = True


def reader(consumer: ScriptedConsumer) -> KafkaHistory:
    def factory(config: dict[str, Any]) -> ScriptedConsumer:
        consumer.config = config
        return consumer

    return KafkaHistory(KafkaConnection(bootstrap="k:1"), "g", clock=FakeClock().seconds,
                        consumer_factory=factory)


def test_reads_up_to_max_per_tp_before_the_committed_offset_of_each_partition() -> None:
    consumer = ScriptedConsumer({(STEPS, 0): 10, (STEPS, 1): 2}, log_end=50)
    got = reader(consumer).read([(STEPS, 0), (STEPS, 1), (HEARTBEATS, 0)], max_per_tp=3)
    assert [(r.topic, r.partition, r.offset) for r in got] == [
        (STEPS, 0, 7), (STEPS, 0, 8), (STEPS, 0, 9), (STEPS, 1, 0), (STEPS, 1, 1)]
    assert got[0] == Record(STEPS, 0, 7, b"j", b"7")
    assert consumer.closed and consumer.config["group.id"] == "g"
    assert consumer.config["enable.auto.commit"] is False  # it never commits for the group


def test_a_fresh_group_has_no_history() -> None:
    consumer = ScriptedConsumer({}, log_end=50)
    assert reader(consumer).read([(STEPS, 0)], max_per_tp=100) == []
    assert reader(consumer).read([(STEPS, 0)], max_per_tp=0) == []
    assert consumer.closed
