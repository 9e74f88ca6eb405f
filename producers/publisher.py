"""A thin, typed confluent-kafka producer for wire-contract messages, and what a publisher is.

Where the cluster is and how to authenticate is the caller's `KafkaConnection` (built once by
the CLI from `FLARE_KAFKA_*`); this module adds only the producer settings. Four of them
matter and are not librdkafka's defaults:
- `partitioner=murmur2_random`: the Java clients, aiokafka and faust hash keys with murmur2;
  librdkafka defaults to CRC32. With murmur2 a job lands on the same partition whoever
  publishes it, so one worker sees all of a job.
- `enable.idempotence=true`: retries after a timeout must not duplicate rank-steps (the
  worker would count a rank twice) nor reorder them within a partition.
- batching (`linger.ms`, `batch.size`): agents emit one message per rank-step; batching in
  the client keeps the broker's request rate low.
- `compression.type=lz4`: a batch of 830-op step messages shrinks about 2.9x (names, groups
  and digits repeat), at ~60 µs per message to compress and ~10 µs to decompress in the
  worker (zstd: 5.7x, but ~260 µs to compress). An 8,192-GPU job sends ~33 MB/s of JSON;
  lz4 cuts the network and the broker's storage by the same factor. aiokafka (the worker)
  decompresses it with cramjam.
Delivery failures are counted and surfaced by `flush()`, never dropped silently.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar

import msgspec
import orjson

from schemas import topics
from schemas.decode import decode_steps
from schemas.errors import InvalidMessage
from schemas.kafka import KafkaConnection
from schemas.shard_key import shard_key, shard_partition
from schemas.steps_v2 import encode_rank_step, encode_steps_value

Message = tuple[str, bytes, bytes]
"""(topic, key, value) of one encoded message, as the node agent queues it."""

DEFAULT_LINGER_MS = 20
DEFAULT_BATCH_BYTES = 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 16 * 1024 * 1024
DEFAULT_COMPRESSION = "lz4"


class PublishError(RuntimeError):
    """Some messages could not be delivered to the broker."""


class Publisher(Protocol):
    """What a source of messages needs of a publisher: `KafkaPublisher`, or a fake in tests
    (`producers.testing.MemoryPublisher`) and dry runs."""

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any]) -> None: ...

    def flush(self, timeout_s: float = ...) -> Any: ...


class PlacingPublisher(Publisher, Protocol):
    """A publisher that can be told the partition of a message (`KafkaPublisher`, and the
    fake), which `ShardingPublisher` needs to spread a job's shards evenly."""

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any],
                partition: int | None = None) -> None: ...


class TeePublisher:
    """Publishes every message to each of `publishers` in turn, and flushes them all.

    The agent's `--record`: Kafka, and a local recording of what was handed to it.
    """

    def __init__(self, *publishers: Publisher) -> None:
        self.publishers = publishers

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any]) -> None:
        for p in self.publishers:
            p.publish(topic, key, value)

    def flush(self, timeout_s: float = 30.0) -> Any:
        return [p.flush(timeout_s) for p in self.publishers]


class _RankOf(msgspec.Struct):
    rank: int


_rank_of = msgspec.json.Decoder(_RankOf).decode


class _Wrapping:
    """A publisher that changes some messages and hands every one to `inner`: flushing and
    delivery reports are the inner publisher's."""

    inner: Publisher

    def flush(self, timeout_s: float = 30.0) -> Any:
        return self.inner.flush(timeout_s)

    def poll(self, timeout_s: float = 0.0) -> None:
        """Serve delivery reports, when the inner publisher has them."""
        poll = getattr(self.inner, "poll", None)
        if poll is not None:
            poll(timeout_s)


class ShardingPublisher(_Wrapping):
    """Publishes ranks' step messages for a job split across workers (issue #17): each goes
    to `flare.shardsteps.v1` keyed `<job>/<shard>` (`schemas.shard_key`) instead of
    `flare.steps.v1` keyed by job, on the shard's own partition of the topic's `partitions`
    (`shard_partition`: a job's shards spread evenly, so stage-1 workers share them
    evenly); heartbeats and job events pass unchanged, since stage 2 (the job's worker) reads
    them. A value handed over as bytes is read for its rank."""

    inner: PlacingPublisher

    def __init__(self, inner: PlacingPublisher, shard_ranks: int, *, partitions: int) -> None:
        if shard_ranks < 1:
            raise ValueError(f"shard_ranks must be >= 1, got {shard_ranks}")
        if partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {partitions}")
        self.inner = inner
        self.shard_ranks = shard_ranks
        self.partitions = partitions

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any]) -> None:
        if topic != topics.STEPS:
            self.inner.publish(topic, key, value)
            return
        job = key.decode("utf-8") if isinstance(key, bytes) else key
        rank = _rank_of(value).rank if isinstance(value, bytes) else int(value["rank"])
        shard = rank // self.shard_ranks
        self.inner.publish(topics.SHARD_STEPS,
                           shard_key(job, rank=rank, shard_ranks=self.shard_ranks), value,
                           partition=shard_partition(job, shard, partitions=self.partitions))



P = TypeVar("P", bound=PlacingPublisher)


def sharded(publisher: P, shard_ranks: int, *, partitions: int) -> P | ShardingPublisher:
    """`publisher` for jobs split into shards of `shard_ranks` over the shard topic's
    `partitions` (shard_ranks 0: not split, the publisher as it is)."""
    if not shard_ranks:
        return publisher
    return ShardingPublisher(publisher, shard_ranks, partitions=partitions)


_NOT_ENCODABLE = (InvalidMessage, KeyError, ValueError, TypeError, OverflowError, struct.error)


class BinaryStepsPublisher(_Wrapping):
    """Publishes ranks' step messages as `flare.steps.v2` (`schemas.steps_v2`: binary
    columns, about a third of the bytes of lz4'd JSON) instead of `flare.steps.v1`; every
    other message passes unchanged. A step handed over as v1 bytes (the hook's, through the
    agent) is decoded and re-encoded here, on the node.

    A step it cannot encode (a v1 message the worker would refuse) goes to `flare.steps.v1`
    as it was given, and is counted in `fallbacks`: the worker dead-letters it with its
    reason, so nothing is lost and nothing is judged twice."""

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.fallbacks = 0

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any]) -> None:
        if topic == topics.STEPS:
            try:
                value = (encode_rank_step(decode_steps(value)) if isinstance(value, bytes)
                         else encode_steps_value(value))
                topic = topics.STEPS_V2
            except _NOT_ENCODABLE:
                self.fallbacks += 1
        self.inner.publish(topic, key, value)



StepsEncoding = Literal["v1", "v2"]


def for_steps(publisher: P, *, shard_ranks: int, partitions: int,
              encoding: StepsEncoding) -> P | ShardingPublisher | BinaryStepsPublisher:
    """`publisher` as the settings say ranks' steps go: split into shards
    (`FLARE_SHARD_RANKS`), or as v2 (`FLARE_STEPS_ENCODING`), or as they are.

    ValueError for both: a split job's shards carry v1 values (`flare.shardsteps.v1`)."""
    if shard_ranks and encoding == "v2":
        raise ValueError("FLARE_STEPS_ENCODING=v2 does not apply to a job split into shards "
                         "(FLARE_SHARD_RANKS): flare.shardsteps.v1 carries v1 steps")
    if encoding == "v2":
        return BinaryStepsPublisher(publisher)
    return sharded(publisher, shard_ranks, partitions=partitions)


class KafkaProducerLike(Protocol):
    """The part of `confluent_kafka.Producer` we use (so tests can pass a spec'd fake)."""

    def produce(self, topic: str, value: bytes | None = ..., key: bytes | None = ...,
                on_delivery: Callable[[Any, Any], None] | None = ...,
                partition: int = ...) -> None: ...

    def poll(self, timeout: float = ...) -> int: ...

    def flush(self, timeout: float = ...) -> int: ...

    def close(self) -> Any: ...


def producer_config(
    conn: KafkaConnection,
    *,
    linger_ms: int = DEFAULT_LINGER_MS,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    compression: str = DEFAULT_COMPRESSION,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The librdkafka configuration of every Flare producer: the connection's, plus the
    producer settings above; `extra` overrides both."""
    conf: dict[str, Any] = {
        **conn.librdkafka(),
        "enable.idempotence": True,
        "acks": "all",
        "partitioner": "murmur2_random",
        "linger.ms": linger_ms,
        "batch.size": batch_bytes,
        "compression.type": compression,
        "message.max.bytes": max_message_bytes,
        "queue.buffering.max.kbytes": 512 * 1024,
        "queue.buffering.max.messages": 1_000_000,
    }
    if extra:
        conf.update(extra)
    return conf


@dataclass(slots=True)
class PublishStats:
    """What a publisher has done so far."""

    queued: int = 0
    delivered: int = 0
    failed: int = 0
    first_error: str = ""


def encode_value(value: bytes | Mapping[str, Any]) -> bytes:
    """Message bytes: already-encoded bytes pass through, dicts become compact JSON."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    return orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY)


def encode_key(key: str | bytes) -> bytes:
    return key if isinstance(key, bytes) else key.encode("utf-8")


class KafkaPublisher:
    """Publish wire messages keyed by job; call `flush()` (or use `with`) before exiting."""

    def __init__(
        self,
        conn: KafkaConnection,
        *,
        linger_ms: int = DEFAULT_LINGER_MS,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        extra: Mapping[str, Any] | None = None,
        producer_factory: Callable[[dict[str, Any]], KafkaProducerLike] | None = None,
    ) -> None:
        self.config = producer_config(
            conn, linger_ms=linger_ms, batch_bytes=batch_bytes,
            max_message_bytes=max_message_bytes, extra=extra,
        )
        if producer_factory is None:
            from confluent_kafka import Producer

            self._producer: KafkaProducerLike = Producer(self.config)  # type: ignore[assignment]
        else:
            self._producer = producer_factory(self.config)
        self.stats = PublishStats()

    def _on_delivery(self, err: Any, _msg: Any) -> None:
        if err is None:
            self.stats.delivered += 1
        else:
            self.stats.failed += 1
            if not self.stats.first_error:
                self.stats.first_error = str(err)

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any],
                partition: int | None = None) -> None:
        """Queue one message, on `partition` or where its key hashes (None); blocks (serving
        delivery reports) while the local queue is full. A partition the topic does not have
        fails its delivery (counted, and raised by `flush()`)."""
        k = encode_key(key)
        v = encode_value(value)
        while True:
            try:
                if partition is None:
                    self._producer.produce(topic, value=v, key=k, on_delivery=self._on_delivery)
                else:
                    self._producer.produce(topic, value=v, key=k, on_delivery=self._on_delivery,
                                           partition=partition)
                break
            except BufferError:
                self._producer.poll(0.05)
        self.stats.queued += 1

    def poll(self, timeout_s: float = 0.0) -> None:
        """Serve delivery reports (call now and then while publishing for a long time)."""
        self._producer.poll(timeout_s)

    def flush(self, timeout_s: float = 30.0) -> PublishStats:
        """Wait until every queued message is delivered; PublishError if any was not."""
        remaining = self._producer.flush(timeout_s)
        if remaining:
            raise PublishError(f"{remaining} messages still undelivered after {timeout_s:.0f} s")
        if self.stats.failed:
            raise PublishError(
                f"{self.stats.failed} of {self.stats.queued} messages were not delivered; "
                f"first error: {self.stats.first_error}"
            )
        return self.stats

    def close(self) -> None:
        """Release the client's threads and connections (call `flush()` first: that is where
        delivery failures are reported)."""
        self._producer.close()

    def __enter__(self) -> KafkaPublisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if exc_type is None:
                self.flush()
            else:
                # Still try to deliver what was queued, but let the original error win.
                try:
                    self._producer.flush(5.0)
                except Exception:
                    pass
        finally:
            self.close()
