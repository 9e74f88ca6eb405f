"""The worker's consumer: its fetch wait (faust hard-codes 1,500 ms) and its batches.

These tests fail if faust or aiokafka rename what `streams/kafka/faust_consumer.py` relies on,
which would silently bring back the idle worker or the per-event cost measured in
BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import aiokafka
import faust
import pytest
from faust.types import TP
from faust.types.tuples import ConsumerMessage

from flare.settings import Settings
from streams.kafka.faust_consumer import batch_transport


async def test_the_worker_consumer_gets_the_configured_fetch_wait(
        worker_app: Callable[..., Any]) -> None:
    app = worker_app(fetch_max_wait_ms=37)
    thread = app.consumer._thread
    consumer = thread._create_worker_consumer(app.transport)
    try:
        assert isinstance(consumer, aiokafka.AIOKafkaConsumer)
        assert consumer._fetch_max_wait_ms == 37  # not faust's 1500
    finally:
        await consumer.stop()


async def test_aiokafka_hands_the_attribute_to_its_fetcher_at_start() -> None:
    """We set the attribute after construction; it only matters if `start()` reads it."""
    consumer = aiokafka.AIOKafkaConsumer(fetch_max_wait_ms=123)
    try:
        assert consumer._fetch_max_wait_ms == 123
    finally:
        await consumer.stop()
    start = inspect.getsource(aiokafka.AIOKafkaConsumer.start)
    assert "fetch_max_wait_ms=self._fetch_max_wait_ms" in start
    fetcher_args = inspect.signature(aiokafka.consumer.fetcher.Fetcher.__init__).parameters
    assert "fetch_max_wait_ms" in fetcher_args


def test_a_negative_fetch_wait_is_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        batch_transport(-1, _ignore)
    with pytest.raises(ValueError):
        Settings(kafka_fetch_max_wait_ms=-5)


async def _ignore(messages: list[Any]) -> None:
    return None


def _message(topic: str, offset: int, value: bytes = b"{}") -> ConsumerMessage:
    return ConsumerMessage(topic, 0, offset, 0.0, 0, [], b"j", value, None, 1, len(value),
                           TP(topic, 0))


class _Fetcher:
    """What the drain loop asks of faust's Fetcher service: whether it stopped."""

    def __init__(self) -> None:
        self._stopped = asyncio.Event()


def _feed(consumer: Any, fetcher: _Fetcher, batches: list[list[ConsumerMessage]]) -> None:
    """Make `getmany` return these batches, one per call, then stop the fetcher."""
    pending = list(batches)

    async def getmany(timeout: float) -> Any:
        if not pending:
            fetcher._stopped.set()
            return
        for m in pending.pop(0):
            yield m.tp, m

    consumer.getmany = getmany


async def test_each_fetched_batch_reaches_the_handler_whole_and_once(tmp_path: Any) -> None:
    got: list[list[int]] = []

    async def on_batch(messages: list[Any]) -> None:
        got.append([m.offset for m in messages])

    app = faust.App("t", broker="kafka://127.0.0.1:1", datadir=str(tmp_path))
    app.transport = batch_transport(5, on_batch)(app.conf.broker_consumer, app)
    consumer = app.consumer
    fetcher = _Fetcher()
    t = "flare.steps.v1"
    _feed(consumer, fetcher, [
        [_message(t, 0), _message(t, 1), _message(t, 2)],
        [],  # a fetch that found nothing
        [_message(t, 6), _message(t, 4)],  # 3..5 compacted away; 4 read before a seek: dropped
    ])
    await asyncio.wait_for(consumer._drain_messages(fetcher), 10)
    assert got == [[0, 1, 2], [6]]
    assert consumer._read_offset[TP(t, 0)] == 6


async def test_the_worker_acks_a_batch_once_its_rows_are_stored(
        worker_app: Callable[..., Any], null_pipeline: Any) -> None:
    """Through the worker's handler: records processed by the pipeline, then acked; a job
    event first (it starts the job), then a message that is not JSON (dead-lettered, still
    acked: it is handled)."""
    app = worker_app()
    consumer = app.consumer
    consumer.assignment = set  # not started: no partitions to sample high watermarks of
    fetcher = _Fetcher()
    start = (b'{"v":1,"job":"j","event":"start","ts_ns":1000,"world_size":2}')
    batch = [_message("flare.jobs.v1", 0, start), _message("flare.heartbeats.v1", 0, b"{")]
    _feed(consumer, fetcher, [batch])
    await asyncio.wait_for(consumer._drain_messages(fetcher), 10)
    assert null_pipeline.stats.records == 2
    assert null_pipeline.router.dead_letters.as_dict()["total"] == 1
    assert all(m.acked for m in batch)
