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
from storage.tables import TABLES, VIEWS
from storage.testing import make_report
from storage.writer import Sink

pytestmark = pytest.mark.integration
DB = "test_migrations"
ADD_MEM = Migration(110, "110_rank_steps_mem.sql",
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
    assert applied_migrations(db)[110]["name"] == "110_rank_steps_mem.sql"
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
    assert 110 not in applied_migrations(db)  # the new one did not run either
    assert "mem_gb" not in {r["name"] for r in db.rows(
        "SELECT name FROM system.columns WHERE database = {d:String} AND table = 'rank_steps'",
        {"d": DB})}


def test_a_recorded_migration_this_version_does_not_ship_is_only_logged(
    db: ClickHouse, caplog: pytest.LogCaptureFixture
) -> None:
    apply_schema(db, [*load_migrations(), ADD_MEM])
    assert apply_schema(db) == []  # an older Flare on a newer schema still starts
    assert "110 (110_rank_steps_mem.sql)" in caplog.text


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
