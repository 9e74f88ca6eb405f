"""Topic layout: every flare topic has one partition count, or a job's messages split."""

from __future__ import annotations

import pytest

from schemas.topics import ALL_TOPICS, STEPS
from streams.kafka.topics import TopicError, check_copartitioned


def test_topics_must_share_one_partition_count() -> None:
    assert check_copartitioned(dict.fromkeys(ALL_TOPICS, 6)) == 6
    counts = {**dict.fromkeys(ALL_TOPICS, 6), STEPS: 3}
    with pytest.raises(TopicError, match=r"same partition count.*flare.steps.v1=3"):
        check_copartitioned(counts)
