"""storage.testing.MemoryStore answers every read exactly as Queries over chDB does, given the
same writes: the fake that the API's unit tests run on is held to the real engine here."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from schemas.report import Detection
from storage.client import ClickHouse, connect
from storage.migrations import apply_schema
from storage.reader import Queries, Reader
from storage.testing import (
    SAMPLE_JOB,
    MemoryStore,
    load_sample,
    make_dead_letter,
    make_incident,
    make_report,
    step_ts,
)
from storage.writer import Sink

pytestmark = pytest.mark.integration


def write_more(sink: Sink | MemoryStore) -> None:
    """Beyond the sample: a re-delivered step with other numbers, a replayed older incident
    state, detections of two kinds at one step, a warm-up δ that is NaN, dead letters."""
    sink.add_report(make_report("quiet", 4, step_time_s=1.1, irregular="spike"))  # rewrite
    sink.add_incident(make_incident(SAMPLE_JOB, culprit="node:node-1", kind="link",
                                    onset_step=5, opened_step=6, last_step=9))  # older state
    sink.add_report(make_report("warm", 0, baseline_s=float("nan"), detections=[
        Detection("rank:1", "gpu", 3.25, 0.125), Detection("rank:1", "host", 2.5, 0.0625)]))
    for offset in (4, 2, 4):
        sink.add_dead_letter(make_dead_letter(offset))
    sink.flush()


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Reader, Reader]]:
    db: ClickHouse = connect(f"chdb://{tmp_path_factory.mktemp('chdb')}?database=test_fake")
    apply_schema(db)
    memory = MemoryStore()
    for sink in (Sink(db), memory):
        load_sample(sink)
        write_more(sink)
    yield Queries(db), memory
    db.close()


def same(value: Any) -> Any:
    """NaN equal to NaN, for comparing answers."""
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, dict):
        return {k: same(v) for k, v in value.items()}
    if isinstance(value, list):
        return [same(v) for v in value]
    return value


MANY_TS = step_ts(100)
READS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("ping", (), {}),
    ("incidents", (), {}),
    ("incidents", (), {"job": SAMPLE_JOB}),
    ("incidents", (), {"status": "open"}),
    ("incidents", (), {"kind": "link", "job": SAMPLE_JOB}),
    ("incidents", (), {"since_ns": MANY_TS}),
    ("incidents", (), {"until_ns": step_ts(5), "limit": 3, "offset": 1}),
    ("incidents", (), {"before": (MANY_TS, "many/gpu/rank:6/6"), "limit": 4}),
    ("incident", (f"{SAMPLE_JOB}/gpu/rank:1/30",), {}),
    ("incident", (f"{SAMPLE_JOB}/link/node:node-1/5",), {}),
    ("incident", ("nope",), {}),
    ("detections", (SAMPLE_JOB, "rank:1", 28, 40), {}),
    ("detections", ("warm", "rank:1", 0, 0), {}),
    ("detections", (SAMPLE_JOB, "rank:1", 0, 100), {"limit": 5}),
    ("jobs", (), {}),
    ("jobs", (), {"limit": 2, "offset": 1}),
    ("job", (SAMPLE_JOB,), {}),
    ("job", ("warm",), {}),
    ("job", ("nope",), {}),
    ("last_step", (SAMPLE_JOB,), {}),
    ("last_step", ("nope",), {}),
    ("steps", ("quiet",), {}),
    ("steps", (SAMPLE_JOB,), {"limit": 5}),
    ("steps", (SAMPLE_JOB,), {"to_step": 20, "limit": 3}),
    ("steps", (SAMPLE_JOB,), {"from_step": 30, "to_step": 59, "stride": 3}),
    ("steps", (SAMPLE_JOB,), {"stride": 7, "limit": 4}),
    ("steps", (SAMPLE_JOB,), {"irregular": ["spike", "pause"]}),
    ("steps", ("warm",), {}),
    ("rank_scores", (SAMPLE_JOB, 50, 59), {}),
    ("rank_scores", (SAMPLE_JOB, 0, 59), {"sort": "caused_wait"}),
    ("rank_scores", (SAMPLE_JOB, 25, 34), {"sort": "compute_ratio", "limit": 2}),
    ("rank_scores", (SAMPLE_JOB, 0, 59), {"sort": "gap"}),
    ("rank_scores", (SAMPLE_JOB, 999, 1000), {}),
    ("op_steps", (SAMPLE_JOB, 0, 59), {}),
    ("op_steps", (SAMPLE_JOB, 29, 59), {"limit": 3}),
    ("op_steps", (SAMPLE_JOB, 5, 20), {}),
    ("ops", (SAMPLE_JOB, [0, 45, 59]), {}),
    ("ops", (SAMPLE_JOB, [31, 30]), {"limit": 5}),
    ("ops", ("quiet", [9]), {}),
    ("dead_letters", (), {}),
    ("dead_letters", (), {"topic": "flare.steps.v1", "limit": 1}),
]


@pytest.mark.parametrize(("method", "args", "kwargs"), READS,
                         ids=[f"{m}{i}" for i, (m, _a, _k) in enumerate(READS)])
def test_memory_store_answers_as_clickhouse_does(
    stores: tuple[Reader, Reader], method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    real, fake = stores
    expected = getattr(real, method)(*args, **kwargs)
    assert expected not in ([], None) or method in ("incident", "job", "last_step",
                                                    "rank_scores", "op_steps", "ops")
    assert same(getattr(fake, method)(*args, **kwargs)) == same(expected)
