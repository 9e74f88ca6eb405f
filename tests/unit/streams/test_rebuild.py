"""Rebuilding the state of newly assigned partitions from a history reader."""

from __future__ import annotations

from collections.abc import Iterable

import orjson

from schemas.topics import HEARTBEATS, INPUT_TOPICS, JOBS
from streams.pipeline import Pipeline, Record
from streams.rebuild import rebuild_partitions

T0 = 1_790_000_000_000_000_000


class ListHistory:
    """A HistoryReader over a list: what Kafka would give back, and what was asked."""

    def __init__(self, records: list[Record]) -> None:
        self.records = records
        self.asked: list[tuple[list[tuple[str, int]], int]] = []

    def read(self, tps: Iterable[tuple[str, int]], max_per_tp: int) -> list[Record]:
        wanted = list(tps)
        self.asked.append((wanted, max_per_tp))
        return [r for r in self.records if (r.topic, r.partition) in wanted]


def test_every_input_topic_of_the_new_partitions_is_replayed_silently(
        null_pipeline: Pipeline) -> None:
    start = orjson.dumps({"v": 1, "job": "j", "event": "start", "ts_ns": T0, "world_size": 2})
    beat = orjson.dumps({"v": 1, "job": "j", "rank": 0, "node": "n0", "ts_ns": T0 + 1,
                         "step": 1, "inflight": []})
    history = ListHistory([Record(JOBS, 3, 0, b"j", start), Record(HEARTBEATS, 3, 0, b"j", beat),
                           Record(JOBS, 5, 0, b"k", start.replace(b'"j"', b'"k"'))])

    assert rebuild_partitions(null_pipeline, history, {3, 1}, max_per_tp=500) == 2
    assert history.asked == [([(t, p) for t in INPUT_TOPICS for p in (1, 3)], 500)]
    assert null_pipeline.router.jobs() == ["j"]
    assert null_pipeline.stats.rebuilt == 2 and null_pipeline.stats.records == 0
