"""ShardingPublisher: ranks' steps go to the shard topic keyed `<job>/<shard>`, on the
shard's partition, everything else passes through as it was given; `sharded(p, 0, ...)`
leaves a publisher as it is."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
import pytest

from producers.publisher import ShardingPublisher, sharded
from producers.testing import MemoryPublisher
from schemas import topics
from schemas.shard_key import shard_partition


class Recorder:
    """A publisher that keeps exactly what it was handed (key and value untouched)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, str | bytes, bytes | Mapping[str, Any]]] = []
        self.placed: list[int | None] = []
        self.flushes: list[float] = []
        self.polls: list[float] = []

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any],
                partition: int | None = None) -> None:
        self.published.append((topic, key, value))
        self.placed.append(partition)

    def flush(self, timeout_s: float = 30.0) -> str:
        self.flushes.append(timeout_s)
        return "flushed"

    def poll(self, timeout_s: float = 0.0) -> None:
        self.polls.append(timeout_s)


def steps(rank: int, job: str = "job-7") -> dict[str, Any]:
    return {"v": 1, "job": job, "rank": rank, "node": "n0", "step": 3}


@pytest.mark.parametrize("key", ["job-7", b"job-7"])
def test_steps_dict_goes_to_the_shard_topic_keyed_job_and_shard(key: str | bytes) -> None:
    inner = Recorder()
    msg = steps(70)
    ShardingPublisher(inner, 64, partitions=8).publish(topics.STEPS, key, msg)
    assert inner.published == [(topics.SHARD_STEPS, "job-7/1", msg)]
    assert inner.published[0][2] is msg  # the value is not re-encoded


def test_steps_bytes_are_read_for_their_rank() -> None:
    inner = Recorder()
    raw = orjson.dumps(steps(130))
    ShardingPublisher(inner, 64, partitions=8).publish(topics.STEPS, "job-7", raw)
    assert inner.published == [(topics.SHARD_STEPS, "job-7/2", raw)]


def test_shard_is_rank_floor_divided_by_shard_ranks() -> None:
    inner = MemoryPublisher()
    pub = ShardingPublisher(inner, 4, partitions=8)
    for rank in (0, 3, 4, 7, 8):
        pub.publish(topics.STEPS, "j", steps(rank, job="j"))
    assert [(t, k) for t, k, _ in inner.messages] == [
        (topics.SHARD_STEPS, b"j/0"), (topics.SHARD_STEPS, b"j/0"), (topics.SHARD_STEPS, b"j/1"),
        (topics.SHARD_STEPS, b"j/1"), (topics.SHARD_STEPS, b"j/2")]
    assert [m["rank"] for m in inner.on(topics.SHARD_STEPS)] == [0, 3, 4, 7, 8]


@pytest.mark.parametrize("job", ["job-7", "llama-405b/run-3", "j"])
def test_a_jobs_shards_spread_evenly_over_the_partitions(job: str) -> None:
    """16 shards on 8 partitions: two each, whatever the job, where hashing 16 keys put up to
    5 on one partition (the 4-worker bound in BENCHMARKS.md); each shard on one partition."""
    inner = MemoryPublisher()
    pub = ShardingPublisher(inner, 4, partitions=8)
    for rank in range(64):
        pub.publish(topics.STEPS, job, steps(rank, job=job))
    where: dict[bytes, set[int | None]] = {}
    for (_t, key, _v), part in zip(inner.messages, inner.partitions, strict=True):
        where.setdefault(key, set()).add(part)
    assert all(len(parts) == 1 for parts in where.values()), "a shard split over partitions"
    per_partition = [sum(parts == {p} for parts in where.values()) for p in range(8)]
    assert per_partition == [2] * 8
    # consecutive shards on consecutive partitions, from the job's own offset
    first = shard_partition(job, 0, partitions=8)
    assert where[f"{job}/5".encode()] == {(first + 5) % 8}


def test_other_topics_keep_their_keys_partition() -> None:
    inner = Recorder()
    pub = ShardingPublisher(inner, 2, partitions=8)
    pub.publish(topics.HEARTBEATS, "j", {"v": 1, "job": "j", "rank": 5, "ts_ns": 1})
    pub.publish(topics.STEPS, "j", steps(5, job="j"))
    assert inner.placed == [None, shard_partition("j", 2, partitions=8)]


@pytest.mark.parametrize("topic", [topics.HEARTBEATS, topics.JOBS])
def test_heartbeats_and_job_events_pass_unchanged(topic: str) -> None:
    inner = Recorder()
    pub = ShardingPublisher(inner, 2, partitions=8)
    as_dict = {"v": 1, "job": "j", "rank": 5, "ts_ns": 1}
    as_bytes = orjson.dumps(as_dict)
    pub.publish(topic, "j", as_dict)
    pub.publish(topic, b"j", as_bytes)
    assert inner.published == [(topic, "j", as_dict), (topic, b"j", as_bytes)]


def test_sharded_with_zero_shard_ranks_is_the_publisher_itself() -> None:
    inner = Recorder()
    assert sharded(inner, 0, partitions=8) is inner


def test_sharded_with_shard_ranks_wraps_the_publisher() -> None:
    inner = Recorder()
    pub = sharded(inner, 8, partitions=6)
    assert isinstance(pub, ShardingPublisher)
    assert (pub.inner, pub.shard_ranks, pub.partitions) == (inner, 8, 6)


def test_zero_shard_ranks_or_partitions_is_refused() -> None:
    with pytest.raises(ValueError, match="shard_ranks"):
        ShardingPublisher(Recorder(), 0, partitions=8)
    with pytest.raises(ValueError, match="partitions"):
        ShardingPublisher(Recorder(), 8, partitions=0)


def test_flush_and_poll_reach_the_inner_publisher() -> None:
    inner = Recorder()
    pub = ShardingPublisher(inner, 2, partitions=8)
    assert pub.flush(3.0) == "flushed"
    pub.poll(0.5)
    assert (inner.flushes, inner.polls) == ([3.0], [0.5])


def test_poll_without_one_inside_does_nothing() -> None:
    inner = MemoryPublisher()  # has no poll
    ShardingPublisher(inner, 2, partitions=8).poll(0.1)
    assert inner.messages == [] and inner.flushes == 0
