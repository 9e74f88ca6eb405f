"""storage.tables against the DDL as ClickHouse holds it after the migrations: every spec has
the table's columns, in order, with the types `system.columns` reports, and its sort key."""

from __future__ import annotations

import pytest

from storage.client import ClickHouse
from storage.tables import TABLES, Table

pytestmark = pytest.mark.integration
DB = "test_tables"


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_spec_matches_the_ddl(db: ClickHouse, table: Table) -> None:
    found = db.rows(
        "SELECT name, type, default_kind FROM system.columns"
        " WHERE database = {d:String} AND table = {t:String} ORDER BY position",
        {"d": DB, "t": table.name},
    )
    assert [(r["name"], r["type"]) for r in found] == [(c.name, c.type) for c in table.columns]
    defaults = {r["name"] for r in found if r["default_kind"]}
    assert {c.name for c in table.columns if not c.written} <= defaults  # inserts omit them
    (key,) = db.rows("SELECT sorting_key FROM system.tables"
                     " WHERE database = {d:String} AND name = {t:String}",
                     {"d": DB, "t": table.name})
    assert tuple(k.strip() for k in key["sorting_key"].split(",")) == table.key
