"""storage.tables: every column's source reads a real object of its table's root, and the
specs account for every field of the shapes they store."""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest

from schemas.report import Detection, GroupRows, RankRows
from schemas.wire import DeadLetterV1, IncidentV1
from storage.tables import (
    BY_NAME,
    DEAD_LETTERS,
    INCIDENTS,
    RANK_STEPS,
    TABLES,
    Column,
    OpRows,
    incident_version,
    take,
)
from storage.testing import make_dead_letter, make_incident, make_report


def roots() -> dict[str, tuple[int, object]]:
    """(rows, root object) per table, from the sample builders."""
    report = make_report("j", 3, detections=[Detection("rank:1", "gpu", 4.0, 0.3)],
                         with_frame=True)
    assert report.frame is not None
    return {
        "job_steps": (1, report),
        "rank_steps": (4, report),
        "group_steps": (2, report),
        "detections": (1, report),
        "ops": (report.frame.n_ops, OpRows.of(report)),
        "incidents": (2, [make_incident("j"), make_incident("k", resolved_step=30)]),
        "dead_letters": (1, [make_dead_letter(7)]),
    }


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_every_written_column_takes_one_value_per_row(table) -> None:
    n, root = roots()[table.name]
    assert [c.name for c in table.columns][-1] == "inserted_at"  # the server's, never written
    for column in table.written:
        value = column.take(root)
        if isinstance(value, str) or np.ndim(value) == 0:
            continue  # a per-step scalar, broadcast to the step's rows
        size = len(value.codes) if hasattr(value, "codes") else len(value)
        assert size == n, column.name
    assert set(table.key) <= {c.name for c in table.columns}
    assert BY_NAME[table.name] is table


def test_rank_and_group_sources_are_fields_of_the_row_containers() -> None:
    containers = {"ranks": RankRows, "groups": GroupRows}
    for table in (RANK_STEPS, BY_NAME["group_steps"]):
        for column in table.written:
            if isinstance(column.source, str) and "." in column.source:
                head, attr = column.source.split(".")
                assert attr in {f.name for f in dataclasses.fields(containers[head])}
    # every per-rank figure the detectors report is stored
    stored = {c.source for c in RANK_STEPS.written}
    assert {f"ranks.{f.name}" for f in dataclasses.fields(RankRows)} <= stored


@pytest.mark.parametrize(("table", "struct"), [(INCIDENTS, IncidentV1),
                                               (DEAD_LETTERS, DeadLetterV1)])
def test_every_wire_field_is_stored(table, struct) -> None:
    read_from = {c.source.split(".")[0] if isinstance(c.source, str) and c.source else c.name
                 for c in table.written}
    assert {f.name for f in msgspec.structs.fields(struct)} - {"v"} <= read_from


def test_incident_columns_hold_the_suspects_as_parallel_arrays() -> None:
    inc = make_incident("j", last_step=21, status="resolved", resolved_step=21)
    assert take([inc], "suspects.entity") == [["rank:1", "node:node-0"]]
    assert INCIDENTS.column("suspect_confidences").take([inc]) == [[0.9, 0.1]]
    assert INCIDENTS.column("opened_ts").read_name == "opened_ts_ns"
    assert INCIDENTS.column("version").take([inc]) == [incident_version(inc)]


def test_incident_versions_order_states() -> None:
    opened = make_incident("j", last_step=20)
    later = make_incident("j", last_step=21)
    resolved = make_incident("j", last_step=21, status="resolved", resolved_step=21)
    resolved_later = make_incident("j", last_step=21, status="resolved", resolved_step=31)
    versions = [incident_version(i) for i in (opened, later, resolved, resolved_later)]
    assert versions == sorted(versions) and len(set(versions)) == 4


def test_read_types_follow_the_clickhouse_types() -> None:
    types = {c.type: c.read_type for t in TABLES for c in t.written}
    assert types["DateTime64(9, 'UTC')"] is int and types["Float32"] is float
    assert types["Nullable(Int64)"] == int | None and types["Array(Float64)"] == list[float]
    assert types["LowCardinality(String)"] is str and types["Bool"] is bool
    with pytest.raises(ValueError, match="no Python type"):
        _ = Column("x", "Decimal(9, 2)").read_type
    with pytest.raises(ValueError, match="filled by the server"):
        INCIDENTS.column("inserted_at").take([make_incident("j")])
    with pytest.raises(KeyError, match="no column 'nope'"):
        INCIDENTS.column("nope")


def test_op_rows_refuse_a_frame_whose_offsets_do_not_cover_its_ops() -> None:
    report = make_report("j", 1, with_frame=True)
    assert report.frame is not None
    report.frame.off = report.frame.off[:-1]
    with pytest.raises(ValueError, match="frame offsets"):
        OpRows.of(report)
