"""storage.migrations against the real chDB engine: numbered files applied once and recorded,
a later ALTER reaching a table that holds rows, changed files refused, old directories kept."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from storage.client import ClickHouse, connect
from storage.migrations import (
    LEDGER,
    Migration,
    MigrationError,
    applied_migrations,
    apply_schema,
    load_migrations,
    statements,
)
from storage.reader import Queries
from storage.tables import TABLES, VIEWS
from storage.testing import make_report
from storage.writer import Sink

pytestmark = pytest.mark.integration
DB = "test_migrations"
ADD_MEM = Migration(900, "900_rank_steps_mem.sql",
                    "-- a later column reaches the existing table\n"
                    "ALTER TABLE flare.rank_steps ADD COLUMN IF NOT EXISTS mem_gb Float32 "
                    "DEFAULT 0 CODEC(ZSTD(1));\n")


@pytest.fixture
def db(tmp_path: Path) -> Iterator[ClickHouse]:
    client = connect(f"chdb://{tmp_path / 'chdb'}?database={DB}")  # one engine per test
    yield client
    client.close()


def count(db: ClickHouse, table: str) -> int:
    return db.rows(f"SELECT count() AS n FROM {db.table(table)} FINAL")[0]["n"]


def test_a_fresh_database_gets_every_migration_once_and_records_it(db: ClickHouse) -> None:
    shipped = load_migrations()
    assert apply_schema(db) == shipped
    engines = {r["name"]: r["engine"] for r in db.rows(
        "SELECT name, engine FROM system.tables WHERE database = {d:String}", {"d": DB})}
    assert {t.name: "ReplacingMergeTree" for t in TABLES}.items() <= engines.items()
    assert all(engines[v] == "View" for v in VIEWS) and engines[LEDGER] == "ReplacingMergeTree"
    recorded = applied_migrations(db)
    assert [(v, r["name"], r["checksum"]) for v, r in recorded.items()] == [
        (m.version, m.name, m.checksum) for m in shipped]
    assert all(r["applied_at"] is not None for r in recorded.values())

    assert apply_schema(db) == []  # up to date: a no-op
    assert applied_migrations(db) == recorded  # not even re-recorded


def test_a_later_migration_adds_a_column_to_a_table_that_holds_rows(db: ClickHouse) -> None:
    apply_schema(db)
    sink = Sink(db)
    for step in range(3):
        sink.add_report(make_report("j", step))
    sink.flush()
    assert apply_schema(db, [*load_migrations(), ADD_MEM]) == [ADD_MEM]
    assert count(db, "rank_steps") == 12
    rows = db.rows(f"SELECT DISTINCT mem_gb FROM {db.table('rank_steps')}")
    assert rows == [{"mem_gb": 0.0}]
    assert applied_migrations(db)[900]["name"] == "900_rank_steps_mem.sql"
    sink.add_report(make_report("j", 3))  # the writer still inserts (mem_gb takes DEFAULT)
    sink.flush()
    assert count(db, "rank_steps") == 16
    assert apply_schema(db, [*load_migrations(), ADD_MEM]) == []


def test_a_changed_migration_is_refused_before_anything_runs(db: ClickHouse) -> None:
    apply_schema(db)
    shipped = load_migrations()
    edited = [Migration(m.version, m.name, m.text + "-- edited\n") if m.version == 20 else m
              for m in shipped]
    with pytest.raises(MigrationError, match=r"020_rank_steps\.sql .* must not change"):
        apply_schema(db, [*edited, ADD_MEM])
    assert 900 not in applied_migrations(db)  # the new one did not run either
    assert "mem_gb" not in {r["name"] for r in db.rows(
        "SELECT name FROM system.columns WHERE database = {d:String} AND table = 'rank_steps'",
        {"d": DB})}


def test_a_recorded_migration_this_version_does_not_ship_is_only_logged(
    db: ClickHouse, caplog: pytest.LogCaptureFixture
) -> None:
    apply_schema(db, [*load_migrations(), ADD_MEM])
    assert apply_schema(db) == []  # an older Flare on a newer schema still starts
    assert "900 (900_rank_steps_mem.sql)" in caplog.text


def test_a_directory_made_before_the_ledger_starts_and_keeps_its_rows(db: ClickHouse) -> None:
    for stmt in statements(DB):  # what the old runner did: every statement, nothing recorded
        db.command(stmt)
    sink = Sink(db)
    sink.add_report(make_report("j", 1))
    sink.flush()
    assert apply_schema(db) == load_migrations()  # CREATE … IF NOT EXISTS: nothing changes
    assert count(db, "job_steps") == 1 and count(db, "rank_steps") == 4
    assert sorted(applied_migrations(db)) == [m.version for m in load_migrations()]


def test_dashboard_views_answer(db: ClickHouse) -> None:
    apply_schema(db)
    sink = Sink(db)
    for step in range(150):
        sink.add_report(make_report("j", step, step_time_s=1.5 if step == 149 else 1.0,
                                    slow_rank=2 if step >= 100 else None))
    sink.flush()
    last = db.rows(f"SELECT step, delta FROM {db.table('v_job_steps')} "
                   "ORDER BY step DESC LIMIT 1")
    assert last == [{"step": 149, "delta": 1.5}]
    scores = db.rows(f"SELECT rank, steps, compute_ratio FROM {db.table('v_rank_scores')}"
                     " WHERE job = 'j' ORDER BY rank")
    assert [s["steps"] for s in scores] == [100] * 4  # the newest 100 steps only
    assert scores[2]["compute_ratio"] == pytest.approx(1.25)  # slow in 50 of them


def test_incidents_stored_before_the_cost_migration_read_a_zero_cost_per_step(
    db: ClickHouse,
) -> None:
    before = [m for m in load_migrations() if m.name != "110_incident_cost.sql"]
    apply_schema(db, before)  # a database as the previous Flare left it, holding an incident
    db.command(
        f"INSERT INTO {db.table('incidents')} (id, job, status, kind, culprit, suspect_entities,"
        " suspect_confidences, onset_step, opened_step, opened_ts, last_step, resolved_step,"
        " slowdown, lost_gpu_seconds, evidence_steps, summary, version)"
        " SELECT 'j/gpu/rank:1/10', 'j', 'open', 'gpu', 'rank:1', ['rank:1'], [0.9], 10, 12,"
        " fromUnixTimestamp64Nano(toInt64(1790000000000000000), 'UTC'), 20, NULL, 1.3, 7200,"
        " 11, 'old', 40")
    assert [m.name for m in apply_schema(db)] == ["110_incident_cost.sql"]
    inc = Queries(db).incident("j/gpu/rank:1/10")
    assert inc is not None
    assert (inc["lost_gpu_seconds"], inc["lost_gpu_seconds_per_step"]) == (7200.0, 0.0)
    (row,) = db.rows(f"SELECT incidents, lost_gpu_hours FROM {db.table('v_incident_cost_daily')}")
    assert row == {"incidents": 1, "lost_gpu_hours": 2.0}
