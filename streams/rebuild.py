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

The reading itself is Kafka's business (`streams/kafka/history.py`); the core only sees a
`HistoryReader`, so a test hands it a list.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from schemas.topics import INPUT_TOPICS
from streams.pipeline import Pipeline, Record


class HistoryReader(Protocol):
    """Where the already-processed records of some topic-partitions can be read again."""

    def read(self, tps: Iterable[tuple[str, int]], max_per_tp: int) -> list[Record]:
        """Up to `max_per_tp` records before the committed offset of each topic-partition,
        in order within each."""
        ...


def rebuild_partitions(pipeline: Pipeline, history: HistoryReader, partitions: Iterable[int],
                       *, max_per_tp: int) -> int:
    """Replay the recent history of every input topic of `partitions` into the pipeline's
    state; returns how many messages were replayed."""
    tps = [(t, p) for t in INPUT_TOPICS for p in sorted(partitions)]
    return pipeline.rebuild(history.read(tps, max_per_tp))
