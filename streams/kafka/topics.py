"""Creating Flare's Kafka topics and checking their layout (the names are `schemas.topics`).

All five topics are keyed by job and get the same partition count: faust's assignor gives a
worker the same partition number of every input topic only when the counts agree, and that
is what lets one worker see all steps, heartbeats and job events of a job. A mismatch is
therefore an error, not a warning.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from schemas.kafka import KafkaConnection
from schemas.topics import ALL_TOPICS, SHARD_STEPS


class TopicError(RuntimeError):
    """Topics could not be created, or exist with an unusable layout."""


def partition_counts(admin: AdminClient, timeout_s: float = 10.0) -> dict[str, int]:
    """Partition count of every topic the broker knows."""
    md = admin.list_topics(timeout=timeout_s)
    return {name: len(t.partitions) for name, t in md.topics.items() if t.error is None}


def check_copartitioned(counts: Mapping[str, int], topics: Iterable[str] = ALL_TOPICS) -> int:
    """The one partition count shared by `topics`; TopicError if they disagree."""
    wanted = {t: counts[t] for t in topics if t in counts}
    distinct = set(wanted.values())
    if len(distinct) > 1:
        detail = ", ".join(f"{t}={n}" for t, n in sorted(wanted.items()))
        raise TopicError(
            "the flare topics must all have the same partition count so that a job's "
            f"messages meet on one worker; found {detail}"
        )
    return distinct.pop() if distinct else 0


def ensure_topics(
    conn: KafkaConnection,
    partitions: int,
    *,
    replication: int = 1,
    topics: Iterable[str] = ALL_TOPICS,
    timeout_s: float = 15.0,
) -> dict[str, int]:
    """Create the missing topics with `partitions` partitions; idempotent.

    Returns the partition count of each topic. Existing topics are left alone (their count
    wins, so a restart with another FLARE_PARTITIONS does not silently reshuffle jobs), but
    they must agree with each other.
    """
    if partitions < 1:
        raise TopicError(f"partitions must be >= 1, got {partitions}")
    names = list(topics)
    config: dict[str, Any] = {**conn.librdkafka()}
    admin = AdminClient(config)
    existing = partition_counts(admin, timeout_s)
    missing = [t for t in names if t not in existing]
    if missing:
        futures = admin.create_topics(
            [NewTopic(t, num_partitions=partitions, replication_factor=replication)
             for t in missing],
            operation_timeout=timeout_s,
            request_timeout=timeout_s,
        )
        for name, fut in futures.items():
            try:
                fut.result(timeout=timeout_s)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue  # another process created it meanwhile
                raise TopicError(f"could not create topic {name}: {exc}") from exc
        existing = partition_counts(admin, timeout_s)
    counts = {t: existing[t] for t in names if t in existing}
    absent = [t for t in names if t not in counts]
    if absent:
        raise TopicError(f"topics {absent} do not show up in the broker's metadata")
    check_copartitioned(counts, names)
    return counts


def check_shard_partitions(counts: Mapping[str, int], configured: int) -> None:
    """TopicError unless `flare.shardsteps.v1` has the `configured` partition count
    (`FLARE_SHARD_PARTITIONS`): producers place shard s of a job on partition (h(job) + s)
    mod that count (`schemas.shard_key.shard_partition`), so a topic with more partitions
    would leave some idle and one with fewer would refuse the shards placed past its end."""
    actual = counts.get(SHARD_STEPS)
    if actual is not None and actual != configured:
        raise TopicError(
            f"{SHARD_STEPS} has {actual} partitions but FLARE_SHARD_PARTITIONS is {configured}: "
            "producers place a job's shards by that setting, so it must be the topic's count"
        )
