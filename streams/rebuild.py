"""Re-reading a partition's recent history so a new owner rebuilds its jobs' detector state.

Detector state lives in plain objects owned by the worker that owns the job's partition
(DESIGN §6), so when a partition moves (a rebalance, a restart) the new owner starts with
nothing: no baseline, no evidence, no knowledge of the incidents already open. It would need
a warm-up window before diagnosing again and would open the same incident under a new id.

Instead, on assignment, the worker re-reads the last `max_per_tp` messages before the
group's committed offset of each input topic-partition and feeds them to fresh diagnosers
with their outputs discarded (the previous owner already stored and published them). With
enough history the rebuilt state is the state the previous owner had, so incidents keep
their ids and steps it left pending are completed here.

This reads with a plain consumer that only fetches the group's committed offsets (it never
joins the group nor commits), so it cannot disturb the rebalance it runs in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from confluent_kafka import Consumer, KafkaError, TopicPartition

from streams.pipeline import Record


def read_history(
    bootstrap: str,
    group_id: str,
    tps: Iterable[tuple[str, int]],
    *,
    max_per_tp: int,
    timeout_s: float = 15.0,
    clock: Callable[[], float] = time.monotonic,
) -> list[Record]:
    """Records [committed - max_per_tp, committed) of each topic-partition, per-tp in order.

    Topic-partitions without a committed offset (a fresh group) have no history to rebuild.
    Stops early at `timeout_s`, returning what was read (a partial rebuild beats none).
    """
    wanted = [TopicPartition(t, p) for t, p in tps]
    if not wanted or max_per_tp <= 0:
        return []
    consumer = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "log_level": 0,
    })
    try:
        committed = consumer.committed(wanted, timeout=timeout_s)
        ranges: dict[tuple[str, int], tuple[int, int]] = {}
        for tp in committed:
            if tp.error is None and tp.offset > 0:
                ranges[(tp.topic, tp.partition)] = (max(0, tp.offset - max_per_tp), tp.offset)
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
