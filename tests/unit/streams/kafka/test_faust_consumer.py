"""The worker's consumer fetch wait: faust hard-codes 1,500 ms, our transport overrides it.

These tests fail if faust or aiokafka rename what `streams/faust_consumer.py` relies on, which
would silently bring back the idle worker measured in BENCHMARKS.md.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import aiokafka
import pytest

from detectors.diagnoser import JobDiagnoser
from flare.settings import Settings
from streams.kafka.faust_consumer import transport_with_fetch_wait
from streams.pipeline import build_pipeline
from streams.worker import build_app


class NullSink:
    def add_output(self, out: object) -> None: ...

    def add_dead_letter(self, dl: object) -> None: ...

    def flush(self) -> dict[str, int]:
        return {}


def _worker_app(tmp_path: Path, fetch_wait_ms: int) -> object:
    pipeline = build_pipeline(NullSink(), JobDiagnoser, max_message_bytes=1 << 20,
                              stall_after_s=30.0, job_idle_s=600.0, now_s=lambda: 0.0)
    settings = Settings(kafka_bootstrap="127.0.0.1:1", kafka_fetch_max_wait_ms=fetch_wait_ms)
    return build_app(settings, pipeline, bootstrap="127.0.0.1:1", datadir=tmp_path)


async def test_the_worker_consumer_gets_the_configured_fetch_wait(tmp_path: Path) -> None:
    app = _worker_app(tmp_path, 37)
    thread = app.consumer._thread  # type: ignore[attr-defined]
    consumer = thread._create_worker_consumer(app.transport)  # type: ignore[attr-defined]
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
