"""storage.reader without a database: whole-row SELECT lists derived from the table specs,
and the shapes a reader returns."""

from __future__ import annotations

import pytest

from storage.reader import (
    DEAD_LETTER_COLUMNS,
    INCIDENT_COLUMNS,
    RANK_SCORE_FIELDS,
    STEP_FIELDS,
    Queries,
    Reader,
    _int,
    incident_from_row,
    select_list,
)
from storage.tables import INCIDENTS, RANK_STEPS
from storage.testing import MemoryStore


def test_an_incident_row_is_every_written_column_but_its_version() -> None:
    assert select_list(INCIDENT_COLUMNS) == (
        "id, job, status, kind, culprit, suspect_entities, suspect_confidences, onset_step, "
        "opened_step, toUnixTimestamp64Nano(opened_ts) AS opened_ts_ns, last_step, "
        "resolved_step, slowdown, lost_gpu_seconds, lost_gpu_seconds_per_step, evidence_steps, "
        "summary, stacks")
    assert {c.name for c in INCIDENTS.written} - {c.name for c in INCIDENT_COLUMNS} == {"version"}
    assert select_list(DEAD_LETTER_COLUMNS) == "topic, partition, offset, reason, payload_b64"


def test_a_step_point_is_a_job_steps_row_without_its_job() -> None:
    assert STEP_FIELDS == (
        ("step", int), ("ts_ns", int), ("n_ranks", int), ("n_missing", int),
        ("step_time_s", float), ("baseline_s", float), ("delta", float), ("irregular", str),
        ("level_shift", bool), ("n_detections", int))


def test_rank_scores_average_every_per_rank_figure() -> None:
    figures = [c.name for c in RANK_STEPS.written if c.type == "Float32"]
    names = [name for name, _type in RANK_SCORE_FIELDS]
    assert names == ["rank", "node", "steps", *figures, "caused_wait_total_s",
                     "min_compute_ratio"]
    assert "compute_ratio" in figures and "gap_s" in figures


def test_incident_rows_get_their_suspects_back_as_objects() -> None:
    row = {"id": "x", "suspect_entities": ["rank:1", "job"], "suspect_confidences": [0.75, 0.25]}
    assert incident_from_row(row) == {"v": 1, "id": "x", "suspects": [
        {"entity": "rank:1", "confidence": 0.75}, {"entity": "job", "confidence": 0.25}],
        "stacks": None}


def test_a_hangs_stacks_come_back_as_objects_and_other_incidents_have_none() -> None:
    def row(stacks: str) -> dict[str, object]:
        return {"id": "x", "suspect_entities": [], "suspect_confidences": [], "stacks": stacks}

    stored = ('[{"thread":"training","frames":["t.py:3 in f"],"ranks":"1","n_ranks":1,'
              '"not_ranks":"0,2-3","note":""}]')
    assert incident_from_row(row(stored))["stacks"] == [
        {"thread": "training", "frames": ["t.py:3 in f"], "ranks": "1", "n_ranks": 1,
         "not_ranks": "0,2-3", "note": ""}]
    assert incident_from_row(row(""))["stacks"] is None


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3"])
def test_only_plain_non_negative_integers_are_formatted_into_sql(bad: object) -> None:
    with pytest.raises(ValueError, match="non-negative integer"):
        _int(bad)  # type: ignore[arg-type]


def test_both_stores_are_readers() -> None:
    assert Reader in Queries.__mro__ and Reader in MemoryStore.__mro__  # checked by mypy too
    with pytest.raises(TypeError, match="abstract"):
        type("Half", (Reader,), {"ping": lambda self: True})()
