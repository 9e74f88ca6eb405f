"""Every Grafana panel's SQL (and every dashboard variable's) runs on the real ClickHouse
engine (chDB) with its macros filled in as the ClickHouse datasource plugin fills them, over
a stored data set with an open incident, and answers rows."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest

from storage.client import ClickHouse
from storage.testing import SAMPLE_JOB, load_sample, step_ts
from storage.writer import Sink

pytestmark = pytest.mark.integration
DB = "grafana_test"
DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "infra/grafana/dashboards").glob(
    "*.json"))


def fill_macros(sql: str, variables: dict[str, str], t0: int, t1: int) -> str:
    """The plugin's macros over [t0, t1] (ns) and the dashboard's variables, as Grafana
    would send them."""
    def at(ns: int) -> str:
        return datetime.fromtimestamp(ns / 1e9, UTC).strftime("%Y-%m-%d %H:%M:%S")

    sql = re.sub(r"\$__timeFilter\(([^)]+)\)",
                 lambda m: f"{m[1]} >= toDateTime('{at(t0)}', 'UTC') AND "
                           f"{m[1]} <= toDateTime('{at(t1)}', 'UTC')", sql)
    sql = sql.replace("$__fromTime", f"toDateTime('{at(t0)}', 'UTC')")
    sql = sql.replace("$__toTime", f"toDateTime('{at(t1)}', 'UTC')")
    for name, value in variables.items():
        sql = sql.replace(f"${{{name}}}", value)
    assert "$" not in sql, sql
    return sql


def _fill(sql: str, db: ClickHouse, variables: dict[str, str], t0: int, t1: int) -> str:
    """`fill_macros`, on the test's own database rather than `flare`."""
    sql = fill_macros(sql, variables, t0, t1)
    database = db.table("incidents").split(".")[0]
    return re.sub(r"\bflare\.(?=[a-z_])", f"{database}.", sql)


def test_the_dashboards_have_fixed_uids_and_use_the_provisioned_datasource() -> None:
    assert [p.name for p in DASHBOARDS] == ["fleet.json", "incident.json", "job.json"]
    uids = {json.loads(p.read_text())["uid"] for p in DASHBOARDS}
    assert uids == {"flare-fleet", "flare-job", "flare-incident"}
    for p in DASHBOARDS:
        for panel in json.loads(p.read_text())["panels"]:
            assert panel["datasource"]["uid"] == "flare-clickhouse", (p.name, panel["title"])


def test_every_panel_and_variable_query_runs_and_answers_rows(clean: ClickHouse) -> None:
    load_sample(Sink(clean))
    (incident_id,) = [r["id"] for r in clean.rows(
        f"SELECT id FROM {clean.table('incidents')} FINAL "
        "WHERE job = {job:String} AND status = 'open'", {"job": SAMPLE_JOB})]
    variables = {"job": SAMPLE_JOB, "incident": incident_id}
    t0, t1 = step_ts(0) - 86_400 * 10**9, step_ts(200) + 86_400 * 10**9
    checked = 0
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        queries = [(f"variable {v['name']}", v["query"]) for v in board["templating"]["list"]]
        queries += [(p["title"], t["rawSql"]) for p in board["panels"] for t in p["targets"]]
        for title, sql in queries:
            rows = clean.rows(_fill(sql, clean, variables, t0, t1))
            assert rows, f"{path.name}: {title} answered no rows"
            checked += 1
    assert checked >= 14
