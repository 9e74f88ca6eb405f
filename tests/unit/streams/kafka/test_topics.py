"""Small pure pieces of the Kafka side: topic layout checks, broker URLs, dead-letter limits."""

from __future__ import annotations

import base64

import pytest

from flare.settings import Settings
from schemas.topics import ALL_TOPICS, STEPS
from streams.deadletter import cause_of, make_dead_letter
from streams.kafka.topics import TopicError, check_copartitioned
from streams.worker import faust_broker_urls, local_bootstrap


def test_topics_must_share_one_partition_count() -> None:
    assert check_copartitioned(dict.fromkeys(ALL_TOPICS, 6)) == 6
    counts = {**dict.fromkeys(ALL_TOPICS, 6), STEPS: 3}
    with pytest.raises(TopicError, match=r"same partition count.*flare.steps.v1=3"):
        check_copartitioned(counts)


def test_broker_addresses() -> None:
    assert faust_broker_urls("a:9092, b:9093") == ["kafka://a:9092", "kafka://b:9093"]
    with pytest.raises(ValueError, match="empty"):
        faust_broker_urls(" , ")
    assert local_bootstrap(Settings(kafka_bootstrap="", kafka_port=19999)) == "127.0.0.1:19999"
    assert local_bootstrap(Settings(kafka_bootstrap="k:1")) == "k:1"


def test_a_dead_letter_carries_the_payload_but_never_an_oversized_one() -> None:
    small = make_dead_letter(STEPS, 1, 2, "$.v: bad", b"abc")
    assert base64.b64decode(small.payload_b64) == b"abc" and small.reason == "$.v: bad"
    big = make_dead_letter(STEPS, 1, 2, "$: too big", b"x" * 100, max_payload_bytes=10)
    assert base64.b64decode(big.payload_b64) == b"x" * 10
    assert "cut to its first 10 of 100 bytes" in big.reason
    assert "flare.steps.v1[1]@2" in big.reason  # where the original still is


def test_causes_do_not_explode_into_one_label_per_index() -> None:
    assert cause_of("$.ops.dur_ns[3]") == cause_of("$.ops.dur_ns[71]") == "$.ops.dur_ns"
