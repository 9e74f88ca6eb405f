"""The local broker and topic creation, each test with its own throwaway tansu."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from flare.local.broker import BrokerError, free_port, port_in_use, start_tansu
from schemas.topics import ALL_TOPICS, STEPS
from streams.kafka.topics import TopicError, ensure_topics

pytestmark = pytest.mark.integration


def test_tansu_starts_answers_and_is_gone_after_stop(tmp_path: Path) -> None:
    port = free_port()
    with start_tansu(port, log_path=tmp_path / "t.log") as broker:
        assert broker.alive() and port_in_use("127.0.0.1", port)
        counts = ensure_topics(broker.connection, 3)
        assert counts == dict.fromkeys(ALL_TOPICS, 3)
        assert ensure_topics(broker.connection, 8) == counts  # idempotent: existing count wins
    assert not broker.alive() and not port_in_use("127.0.0.1", port)


def test_a_taken_port_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} .* already in use"):
            start_tansu(port)


def test_topics_with_mismatched_partition_counts_are_refused() -> None:
    with start_tansu(free_port()) as broker:
        admin = AdminClient(broker.connection.librdkafka())
        for f in admin.create_topics([NewTopic(STEPS, 2, 1)]).values():
            f.result()
        with pytest.raises(TopicError, match="same partition count"):
            ensure_topics(broker.connection, 4)
