"""The stage-1 worker's Kafka loop: read shards' step messages, send shards' frames, commit.

A plain confluent-kafka consumer in a group of its own (`flare-shards` by default), so stage
1 scales with the partitions of `flare.shardsteps.v1`, apart from the job workers' group. The
order of one batch's work is what keeps it at-least-once:

1. the batch's records go through `ShardStage` (the shards' frames that completed, dead
   letters);
2. the producer is flushed: every frame and dead letter is on the broker;
3. only then each partition's `committable` offset is committed (the oldest offset a pending
   step still holds).

A crash anywhere before 3 re-reads the batch; one after it re-reads only pending steps.
On a revocation the same flush and commit run before the shards are dropped, so the new
owner starts where this one stopped. With nothing to read the stage ticks, so a shard's step
whose rank went silent leaves after its grace.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from schemas.kafka import KafkaConnection
from schemas.topics import SHARD_STEPS
from streams.shard_stage import ShardStage, StageOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShardWorkerConfig:
    """The stage-1 loop's knobs (from the settings, `flare shard-worker`)."""

    group_id: str = "flare-shards"
    batch: int = 500  # records per consume call at most
    poll_s: float = 0.05  # longest a consume waits when nothing is there
    session_timeout_s: float = 6.0
    flush_timeout_s: float = 30.0
    max_message_bytes: int = 8 * 1024 * 1024


def consumer_config(conn: KafkaConnection, cfg: ShardWorkerConfig) -> dict[str, Any]:
    return {
        **conn.librdkafka(),
        "group.id": cfg.group_id,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "session.timeout.ms": int(cfg.session_timeout_s * 1000),
        "fetch.wait.max.ms": 20,
        "log_level": 3,
    }


def producer_config(conn: KafkaConnection, cfg: ShardWorkerConfig) -> dict[str, Any]:
    return {
        **conn.librdkafka(),
        # a job's shards' frames must land on the partition of its other topics, which the
        # Java clients, faust and every Flare producer choose by murmur2 (librdkafka's own
        # default hashes otherwise: the job's worker would never see them with its start)
        "partitioner": "murmur2_random",
        "linger.ms": 5,
        "compression.type": "lz4",
        "message.max.bytes": cfg.max_message_bytes + 64 * 1024,
        "log_level": 3,
    }


class ShardWorker:
    """One stage-1 process: `run` until `stop()` says so."""

    def __init__(self, conn: KafkaConnection, cfg: ShardWorkerConfig, stage: ShardStage, *,
                 consumer_factory: Callable[[dict[str, Any]], Any] = Consumer,
                 producer_factory: Callable[[dict[str, Any]], Any] = Producer) -> None:
        self.cfg = cfg
        self.stage = stage
        self.consumer = consumer_factory(consumer_config(conn, cfg))
        self.producer = producer_factory(producer_config(conn, cfg))
        self.assigned: set[int] = set()
        self.records = 0

    # ---- the loop -------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool], beat: Callable[[], None] | None = None) -> None:
        """Batches until `stop()`; `beat()` after each one (the loop is alive)."""
        self.consumer.subscribe([SHARD_STEPS], on_assign=self._on_assign,
                                on_revoke=self._on_revoke, on_lost=self._on_revoke)
        try:
            while not stop():
                self.step()
                if beat is not None:
                    beat()
        finally:
            self.consumer.close()  # leaves the group: its partitions move at once
            self.producer.flush(self.cfg.flush_timeout_s)

    def step(self) -> int:
        """One batch: read, send, flush, commit; returns the records read."""
        msgs = self.consumer.consume(self.cfg.batch, self.cfg.poll_s)
        out = StageOutput()
        read: set[int] = set()
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("stage 1 consume error: %s", err)
                continue
            p = int(m.partition())
            read.add(p)
            self.records += 1
            out.extend(self.stage.on_record(p, int(m.offset()), m.key(), m.value()))
        if not read:
            out.extend(self.stage.tick(self.assigned))
        self._send(out)
        self._commit(read or self.assigned)
        return len(msgs)

    def _send(self, out: StageOutput) -> None:
        for topic, key, value in out.sent:
            while True:
                try:
                    self.producer.produce(topic, value=value, key=key)
                    break
                except BufferError:  # the local queue is full: let deliveries drain it
                    self.producer.poll(0.1)
            self.producer.poll(0)
        left = self.producer.flush(self.cfg.flush_timeout_s)
        if left:
            raise KafkaException(f"{left} stage-1 messages were not delivered in "
                                 f"{self.cfg.flush_timeout_s} s; nothing is committed")

    def _commit(self, partitions: Iterable[int]) -> None:
        offsets = []
        for p in sorted(partitions):
            at = self.stage.committable(p)
            if at is not None:
                offsets.append(TopicPartition(SHARD_STEPS, p, at))
        if offsets:
            self.consumer.commit(offsets=offsets, asynchronous=False)

    # ---- ownership ------------------------------------------------------------------------
    def _on_assign(self, consumer: Any, tps: list[Any]) -> None:
        self.assigned |= {int(tp.partition) for tp in tps}
        log.info("assigned partitions %s", sorted(self.assigned))

    def _on_revoke(self, consumer: Any, tps: list[Any]) -> None:
        gone = {int(tp.partition) for tp in tps}
        try:
            self._send(StageOutput())
            self._commit(gone & self.assigned)
        except KafkaException as exc:  # the new owner re-reads from the last commit
            log.warning("stage 1 could not commit revoked partitions: %s", exc)
        self.stage.revoke(gone)
        self.assigned -= gone
        log.info("revoked partitions %s, keeping %s", sorted(gone), sorted(self.assigned))
