"""Reading the history of topic-partitions before a consumer group's committed offsets.

The Kafka half of rebuilding detector state on assignment (`streams/rebuild.py` says why):
a plain confluent-kafka consumer that only fetches the group's committed offsets and assigns
itself the ranges before them. It never joins the group nor commits, so it cannot disturb
the rebalance it runs in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from schemas.clock import SecondsClock
from schemas.kafka import KafkaConnection
from streams.pipeline import Record


def history_config(conn: KafkaConnection, group_id: str) -> dict[str, Any]:
    """A consumer that can read the group's committed offsets but never commits itself."""
    return {
        **conn.librdkafka(),
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "log_level": 0,
    }


class KafkaHistory:
    """`streams.rebuild.HistoryReader` over a Kafka cluster, for one consumer group."""

    def __init__(self, conn: KafkaConnection, group_id: str, *, timeout_s: float = 15.0,
                 clock: SecondsClock = time.monotonic,
                 consumer_factory: Callable[[dict[str, Any]], Any] = Consumer) -> None:
        self._config = history_config(conn, group_id)
        self._timeout_s = timeout_s
        self._clock = clock
        self._consumer_factory = consumer_factory

    def read(self, tps: Iterable[tuple[str, int]], max_per_tp: int) -> list[Record]:
        """Records [committed - max_per_tp, committed) of each topic-partition, per-tp in order.

        Topic-partitions without a committed offset (a fresh group) have no history to
        rebuild. Stops early at the timeout, returning what was read (a partial rebuild
        beats none).
        """
        wanted = [TopicPartition(t, p) for t, p in tps]
        if not wanted or max_per_tp <= 0:
            return []
        timeout_s, clock = self._timeout_s, self._clock
        consumer = self._consumer_factory(self._config)
        try:
            committed = consumer.committed(wanted, timeout=timeout_s)
            ranges: dict[tuple[str, int], tuple[int, int]] = {}
            for tp in committed:
                if tp.error is None and tp.offset > 0:
                    ranges[(tp.topic, tp.partition)] = (max(0, tp.offset - max_per_tp),
                                                        tp.offset)
            if not ranges:
                return []
            consumer.assign([TopicPartition(t, p, lo) for (t, p), (lo, _hi) in ranges.items()])
            out: list[Record] = []
            open_tps = set(ranges)
            deadline = clock() + timeout_s
            while open_tps and clock() < deadline:
                for m in consumer.consume(1000, 0.5):
                    key = (str(m.topic()), int(m.partition() or 0))
                    err = m.error()
                    if err is not None:
                        if err.code() == KafkaError._PARTITION_EOF:
                            open_tps.discard(key)
                        continue
                    offset = m.offset()
                    if key not in open_tps or offset is None:
                        continue
                    if offset >= ranges[key][1]:
                        open_tps.discard(key)
                        continue
                    out.append(Record(key[0], key[1], offset, m.key(), m.value()))
                    if offset >= ranges[key][1] - 1:
                        open_tps.discard(key)
            return out
        finally:
            consumer.close()
