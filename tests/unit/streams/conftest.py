"""A worker's faust app built without a broker: nothing connects until the app starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from detectors.diagnoser import JobDiagnoser
from schemas.kafka import KafkaConnection
from storage.testing import MemoryStore
from streams.pipeline import Pipeline, build_pipeline
from streams.worker import WorkerConfig, build_app


def worker_config(**overrides: Any) -> WorkerConfig:
    values: dict[str, Any] = {
        "group_id": "flare-test", "partitions": 4, "max_message_bytes": 1 << 20,
        "session_timeout_s": 6.0, "fetch_max_wait_ms": 20, "rebuild_messages": 100,
    }
    return WorkerConfig(**{**values, **overrides})


@pytest.fixture
def null_pipeline() -> Pipeline:
    """A pipeline with real diagnosers, storing into memory."""
    return build_pipeline(MemoryStore(), JobDiagnoser, max_message_bytes=1 << 20,
                          stall_after_s=30.0, job_idle_s=600.0, now_s=lambda: 0.0)


@pytest.fixture
def worker_app(tmp_path: Path, null_pipeline: Pipeline) -> Callable[..., Any]:
    """`worker_app(conn, **config)`: the faust App of a worker (not started)."""

    def build(conn: KafkaConnection | None = None, **config: Any) -> Any:
        conn = conn or KafkaConnection(bootstrap="127.0.0.1:1")
        return build_app(worker_config(**config), conn, null_pipeline, datadir=tmp_path)

    return build
