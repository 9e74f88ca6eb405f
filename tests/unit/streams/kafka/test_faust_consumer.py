"""The worker's consumer fetch wait: faust hard-codes 1,500 ms, our transport overrides it.

These tests fail if faust or aiokafka rename what `streams/kafka/faust_consumer.py` relies on,
which would silently bring back the idle worker measured in BENCHMARKS.md.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import aiokafka
import pytest

from flare.settings import Settings
from streams.kafka.faust_consumer import transport_with_fetch_wait


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
        transport_with_fetch_wait(-1)
    with pytest.raises(ValueError):
        Settings(kafka_fetch_max_wait_ms=-5)
