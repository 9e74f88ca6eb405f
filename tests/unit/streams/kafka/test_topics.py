"""Topic layout: every flare topic has one partition count, or a job's messages split."""

from __future__ import annotations

import pytest

from schemas.topics import ALL_TOPICS, SHARD_STEPS, STEPS
from streams.kafka.topics import TopicError, check_copartitioned, check_shard_partitions


def test_topics_must_share_one_partition_count() -> None:
    assert check_copartitioned(dict.fromkeys(ALL_TOPICS, 6)) == 6
    counts = {**dict.fromkeys(ALL_TOPICS, 6), STEPS: 3}
    with pytest.raises(TopicError, match=r"same partition count.*flare.steps.v1=3"):
        check_copartitioned(counts)


def test_the_shard_topic_must_have_the_count_producers_place_shards_by() -> None:
    check_shard_partitions({SHARD_STEPS: 8}, 8)
    check_shard_partitions({STEPS: 4}, 8)  # not created (yet): nothing to disagree with
    for actual in (4, 16):
        with pytest.raises(TopicError, match=rf"has {actual} partitions but "
                                             r"FLARE_SHARD_PARTITIONS is 8"):
            check_shard_partitions({SHARD_STEPS: actual}, 8)
