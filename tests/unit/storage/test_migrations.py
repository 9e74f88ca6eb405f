"""storage.migrations without a database: the shipped files as numbered migrations, their
statements for another database, checksums (the runner itself is tested against chDB in
tests/integration/test_storage_migrations.py)."""

from __future__ import annotations

import pytest

from storage.migrations import (
    Migration,
    ddl_files,
    load_migrations,
    split_statements,
    statements,
)
from storage.tables import TABLES, VIEWS


def test_shipped_files_are_numbered_migrations_in_order() -> None:
    migrations = load_migrations()
    assert [m.name for m in migrations] == [name for name, _text in ddl_files()]
    versions = [m.version for m in migrations]
    assert versions == sorted(set(versions)) and versions[0] == 0
    assert migrations[0].name == "000_database.sql"


def test_ddl_is_idempotent_text_and_renames_the_database() -> None:
    stmts = statements()
    # every statement can run twice: a failed migration is retried whole
    assert all(("IF NOT EXISTS" in s or "OR REPLACE" in s) for s in stmts)
    assert stmts[0] == "CREATE DATABASE IF NOT EXISTS flare"
    creates = [s.split() for s in stmts[1:] if s.startswith("CREATE")]
    created = {w[5] if "IF" in w[:3] else w[4] for w in creates}
    assert created == {f"flare.{t.name}" for t in TABLES} | {f"flare.{v}" for v in VIEWS}
    other = statements("other")
    assert other[0] == "CREATE DATABASE IF NOT EXISTS other"
    assert not any("flare." in s for s in other)
    for s in stmts:
        if s.startswith("CREATE TABLE"):
            assert "ReplacingMergeTree" in s and "TTL inserted_at" in s and "PARTITION BY" in s


def test_an_alter_is_renamed_too() -> None:
    m = Migration(900, "900_mem.sql", "-- a later column\n"
                  "ALTER TABLE flare.rank_steps ADD COLUMN IF NOT EXISTS mem_s Float32;\n")
    assert m.statements("t") == ["ALTER TABLE t.rank_steps ADD COLUMN IF NOT EXISTS mem_s Float32"]


def test_split_statements_drops_comments() -> None:
    text = "-- a; comment\nCREATE A;\n  -- b\nCREATE B\n(x);\n\n"
    assert split_statements(text) == ["CREATE A", "CREATE B\n(x)"]


def test_checksum_is_of_the_text_and_changes_with_it() -> None:
    a = Migration(1, "001_a.sql", "CREATE A;\n")
    assert a.checksum == Migration(7, "007_b.sql", "CREATE A;\n").checksum
    assert a.checksum != Migration(1, "001_a.sql", "CREATE A; -- edited\n").checksum
    assert len(a.checksum) == 64


@pytest.mark.parametrize(
    ("files", "error"),
    [([("views.sql", "")], "expected NNN_name.sql"),
     ([("010_a.sql", ""), ("10_b.sql", "")], "share version 10")],
)
def test_badly_named_files_are_refused(files: list[tuple[str, str]], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        load_migrations(files)


def test_migrations_sort_by_number_not_by_name() -> None:
    names = [m.name for m in load_migrations([("100_c.sql", ""), ("20_b.sql", ""),
                                              ("003_a.sql", "")])]
    assert names == ["003_a.sql", "20_b.sql", "100_c.sql"]
