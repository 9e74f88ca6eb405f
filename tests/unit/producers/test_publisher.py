"""The Kafka publisher without a broker: configuration, keys and encoding, delivery errors."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from producers.publisher import KafkaPublisher, PublishError, producer_config
from schemas.kafka import KafkaConnection


class FakeProducer:
    """Stands in for confluent_kafka.Producer: same three methods, records what it got."""

    def __init__(self, conf: dict[str, Any], *, full_times: int = 0,
                 fail: set[int] | None = None) -> None:
        self.conf = conf
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.partitions: list[int | None] = []
        self.pending: list[Any] = []
        self.polls = 0
        self.closed = False
        self._full = full_times
        self._fail = fail or set()

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None,
                on_delivery: Any = None, partition: int | None = None) -> None:
        if self._full:
            self._full -= 1
            raise BufferError("queue full")
        assert value is not None and key is not None
        self.sent.append((topic, key, value))
        self.partitions.append(partition)
        self.pending.append((len(self.sent) - 1, on_delivery))

    def _deliver(self) -> None:
        for i, cb in self.pending:
            cb("broker said no" if i in self._fail else None, None)
        self.pending.clear()

    def poll(self, timeout: float = 0.0) -> int:
        self.polls += 1
        self._deliver()
        return 0

    def flush(self, timeout: float = 0.0) -> int:
        self._deliver()
        return 0

    def close(self) -> bool:
        self.closed = True
        return True


def make_with(conn: KafkaConnection, **kw: Any) -> tuple[KafkaPublisher, FakeProducer]:
    holder: list[FakeProducer] = []

    def factory(conf: dict[str, Any]) -> FakeProducer:
        holder.append(FakeProducer(conf, **kw))
        return holder[0]

    return KafkaPublisher(conn, producer_factory=factory), holder[0]


def make(**kw: Any) -> tuple[KafkaPublisher, FakeProducer]:
    return make_with(KafkaConnection(bootstrap="127.0.0.1:1"), **kw)


def test_config_is_idempotent_murmur2_batched_and_compressed() -> None:
    conf = producer_config(KafkaConnection(bootstrap="k:9092"))
    assert conf["bootstrap.servers"] == "k:9092"
    assert conf["compression.type"] == "lz4"  # the worker's aiokafka reads it via cramjam
    assert conf["enable.idempotence"] is True
    assert conf["partitioner"] == "murmur2_random"
    assert conf["linger.ms"] > 0 and conf["batch.size"] >= 64 * 1024
    extra = producer_config(KafkaConnection(bootstrap="k:9092"), extra={"linger.ms": 0})
    assert extra["linger.ms"] == 0


def test_config_carries_the_connection_secrets_to_the_client_only() -> None:
    conn = KafkaConnection(bootstrap="k:9093", security_protocol="SASL_SSL",
                           sasl_mechanism="SCRAM-SHA-512", sasl_username="flare",
                           sasl_password="s3cret", ssl_ca_location="ca.pem")
    pub, fake = make_with(conn)
    assert fake.conf["sasl.password"] == "s3cret" and fake.conf["ssl.ca.location"] == "ca.pem"
    assert fake.conf["security.protocol"] == "SASL_SSL"
    assert fake.conf["enable.idempotence"] is True
    assert pub.config is fake.conf


def test_publish_keys_by_job_and_encodes_dicts() -> None:
    pub, fake = make()
    pub.publish("flare.steps.v1", "job-1", {"v": 1, "job": "job-1"})
    pub.publish("flare.steps.v1", b"job-2", b'{"raw":true}')
    stats = pub.flush()
    assert [(t, k) for t, k, _ in fake.sent] == [("flare.steps.v1", b"job-1"),
                                                ("flare.steps.v1", b"job-2")]
    assert orjson.loads(fake.sent[0][2]) == {"v": 1, "job": "job-1"}
    assert fake.sent[1][2] == b'{"raw":true}'
    assert stats.delivered == 2 and stats.failed == 0
    assert fake.partitions == [None, None], "the key's partition: the client's partitioner"


def test_a_partition_given_reaches_the_client() -> None:
    pub, fake = make()
    pub.publish("flare.shardsteps.v1", "job-1/3", {"v": 1}, partition=5)
    pub.publish("flare.shardsteps.v1", "job-1/0", {"v": 1}, partition=0)
    pub.flush()
    assert fake.partitions == [5, 0]


def test_leaving_the_context_flushes_then_closes() -> None:
    pub, fake = make()
    with pub:
        pub.publish("t", "j", b"x")
    assert pub.stats.delivered == 1 and fake.closed


def test_a_full_queue_blocks_instead_of_dropping() -> None:
    pub, fake = make(full_times=3)
    pub.publish("t", "j", b"x")
    assert len(fake.sent) == 1
    assert fake.polls >= 3


def test_failed_deliveries_surface_at_flush() -> None:
    pub, _fake = make(fail={1})
    for i in range(3):
        pub.publish("t", "j", {"i": i})
    with pytest.raises(PublishError, match="1 of 3 messages were not delivered.*broker said no"):
        pub.flush()
