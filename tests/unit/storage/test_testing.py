"""storage.testing.MemoryStore as a sink: buffered until flushed, counted as the Sink counts,
failing on request; and the ReplacingMergeTree semantics of its reads. (That its answers are
the real engine's is checked in tests/integration/test_storage_testing.py.)"""

from __future__ import annotations

import pytest

from schemas.report import Detection, DiagnoserOutput
from storage.client import StorageError
from storage.testing import MemoryStore, make_dead_letter, make_incident, make_report


def test_rows_wait_in_the_buffer_until_a_flush() -> None:
    store = MemoryStore()
    report = make_report("j", 1, detections=[Detection("rank:1", "gpu", 4.0, 0.3)],
                         with_frame=True)
    store.add_output(DiagnoserOutput(reports=[report], incidents=[make_incident("j")]))
    store.add_dead_letter(make_dead_letter(3))
    store.add_dead_letter(make_dead_letter(3))
    assert store.jobs() == [] and len(store.buffered) == 4
    assert store.flush() == {"job_steps": 1, "rank_steps": 4, "group_steps": 2,
                             "detections": 1, "ops": 8, "incidents": 1, "dead_letters": 1}
    assert store.buffered == [] and len(store.stored) == 4
    assert store.last_step("j") == 1 and len(store.dead_letters()) == 1
    assert store.flush() == {}


def test_a_failing_store_keeps_its_buffer_and_refuses_reads() -> None:
    store = MemoryStore()
    store.add_report(make_report("j", 1))
    store.fail = True
    with pytest.raises(StorageError, match="insert failed"):
        store.flush()
    with pytest.raises(StorageError, match="query failed"):
        store.jobs()
    assert not store.ping() and len(store.buffered) == 1
    store.fail = False
    store.flush()
    assert store.ping() and store.last_step("j") == 1


def test_one_row_per_natural_key_and_the_newest_incident_state() -> None:
    store = MemoryStore()
    store.add_reports([make_report("j", 1), make_report("j", 1, step_time_s=2.0)])
    store.add_incident(make_incident("j", last_step=30, status="resolved", resolved_step=30))
    store.add_incident(make_incident("j", last_step=25))  # a replayed older state
    store.flush()
    (step,) = store.steps("j")
    assert step["step_time_s"] == 2.0  # the later write of (job, step) wins
    (inc,) = store.incidents()
    assert (inc["status"], inc["last_step"]) == ("resolved", 30)
