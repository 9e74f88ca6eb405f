"""Ad-hoc SQL (`storage.adhoc`, POST /v1/sql, `flare sql`) on the real engine: reads answer,
anything else is refused with a 4xx that says why, and the store is the same afterwards.

The store is chDB with the sample data, opened as the worker opens it (a client that
writes), and the read-only session is a second handle on the same engine, as in the worker.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from api.app import create_app
from flare.cli import app as cli
from flare.local.broker import free_port
from flare.local.processes import flare_argv
from storage.adhoc import Limits, ReadOnlySQL, SQLRefused, open_readonly
from storage.client import ClickHouse, connect
from storage.migrations import apply_schema
from storage.testing import load_sample
from storage.writer import Sink
from tests.integration.conftest import ROOT, WorkerProcess, unique
from tests.live_api import served

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

DB = "test_sql"
ROWS = 50
runner = CliRunner()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"chdb://{tmp_path_factory.mktemp('chdb')}?database={DB}"


@pytest.fixture(scope="module")
def store(url: str) -> Iterator[ClickHouse]:
    db = connect(url)
    apply_schema(db)
    load_sample(Sink(db))
    yield db
    db.close()


@pytest.fixture(scope="module")
def sql(url: str, store: ClickHouse) -> Iterator[ReadOnlySQL]:
    with open_readonly(url, limits=Limits(rows=ROWS)) as session:
        yield session


@pytest.fixture(scope="module")
def client(store: ClickHouse, sql: ReadOnlySQL) -> TestClient:
    return TestClient(create_app(store, sql=sql), raise_server_exceptions=False)


def post(client: TestClient, query: str) -> Any:
    return client.post("/v1/sql", json={"query": query})


def problem(resp: Any, status: int) -> str:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/problem+json"
    detail: str = resp.json()["detail"]
    return detail


def fingerprint(db: ClickHouse) -> list[tuple[str, int]]:
    """Every table of the store with its row count: what a write would change."""
    rows = db.rows("SELECT name, total_rows FROM system.tables WHERE database = {d:String} "
                   "ORDER BY name", {"d": DB})
    return [(r["name"], r["total_rows"]) for r in rows]


def test_a_select_answers_with_the_columns_and_rows_the_store_has(
        client: TestClient, store: ClickHouse) -> None:
    query = "SELECT kind, status, count() AS n FROM incidents GROUP BY kind, status ORDER BY ALL"
    resp = post(client, query)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [c["name"] for c in body["columns"]] == ["kind", "status", "n"]
    assert body["columns"][2]["type"] == "UInt64"
    expected = store.rows(query.replace("FROM incidents", f"FROM {store.table('incidents')}"))
    assert body["rows"] == [[r["kind"], r["status"], r["n"]] for r in expected]
    assert body["rows"] and body["truncated"] is False and body["max_rows"] == ROWS


def test_reads_other_than_select_answer_too(client: TestClient) -> None:
    tables = post(client, "SHOW TABLES").json()["rows"]
    assert ["incidents"] in tables and ["job_steps"] in tables
    described = post(client, "DESCRIBE TABLE incidents").json()
    assert ["id", "String"] == described["rows"][0][:2]
    assert post(client, "EXISTS TABLE incidents").json()["rows"] == [[1]]
    assert post(client, "WITH 2 AS x SELECT x * 21 AS y").json()["rows"] == [[42]]


def test_values_come_back_as_json_can_carry_them(client: TestClient) -> None:
    body = post(client, "SELECT nan AS a, toDecimal64(1.25, 2) AS b, "
                        "toDateTime64('2026-01-31 12:00:00.5', 3, 'UTC') AS c, [1, 2] AS d, "
                        "map('k', 1.5) AS e, NULL AS f, toUUID('00000000-0000-0000-0000-0000"
                        "00000001') AS g").json()
    assert body["rows"] == [[None, "1.25", "2026-01-31T12:00:00.500000+00:00", [1, 2],
                             {"k": 1.5}, None, "00000000-0000-0000-0000-000000000001"]]


WRITES = [
    "INSERT INTO incidents SELECT * FROM incidents",
    "CREATE TABLE scratch (a UInt8) ENGINE = Memory",
    "DROP TABLE incidents",
    "ALTER TABLE incidents DELETE WHERE 1",
    "TRUNCATE TABLE incidents",
    "RENAME TABLE incidents TO gone",
    "OPTIMIZE TABLE incidents FINAL",
    "SET readonly = 0",
    "KILL QUERY WHERE 1",  # read-only mode allows it: it would kill the worker's inserts
    "USE system",
    "SYSTEM DROP MARK CACHE",
]


@pytest.mark.parametrize("statement", WRITES)
def test_a_statement_that_is_not_a_read_is_refused_and_changes_nothing(
        client: TestClient, store: ClickHouse, statement: str) -> None:
    before = fingerprint(store)
    detail = problem(post(client, statement), 403)
    assert detail.startswith("read-only: ") and statement.split()[0] in detail
    assert fingerprint(store) == before


@pytest.mark.parametrize("statement", [
    "SELECT 1 SETTINGS readonly = 0",
    "SELECT number FROM system.numbers LIMIT 1000 SETTINGS max_result_rows = 0",
    "SELECT * FROM url('http://127.0.0.1:9/x.csv', 'CSV', 'a String')",
    "SELECT * FROM filesystem('/etc')",
    "SELECT * FROM remote('127.0.0.1:9', system.one)",
    "SELECT * FROM s3('http://127.0.0.1:9/x.csv', 'CSV', 'a String')",
])
def test_reads_that_change_a_setting_or_reach_outside_meet_clickhouses_read_only_mode(
        client: TestClient, statement: str) -> None:
    assert "(READONLY)" in problem(post(client, statement), 403)


def test_the_holes_read_only_mode_leaves_in_the_embedded_engine_are_closed(
        client: TestClient, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    resp = post(client, f"SELECT file('{secret}') AS leak")
    assert "file()" in problem(resp, 403) and "hunter2" not in resp.text
    out = tmp_path / "out.csv"
    assert "INTO OUTFILE" in problem(post(client, f"SELECT 1 INTO OUTFILE '{out}'"), 403)
    assert not out.exists()
    assert "python()" in problem(post(client, "SELECT * FROM Python('store')"), 403)
    # a literal that only looks like the clause is no clause
    assert post(client, "SELECT 'INTO OUTFILE' AS s").json()["rows"] == [["INTO OUTFILE"]]


@pytest.mark.parametrize(("statement", "says"), [
    ("SELEC 1", "Syntax error"),
    ("SELECT * FROM no_such_table", "UNKNOWN_TABLE"),
    ("SELECT 1; SELECT 2", "Multi-statements are not allowed"),
    ("SELECT 1; DROP TABLE incidents", "Multi-statements are not allowed"),
    ("SELECT 1 FORMAT JSON", "leave out FORMAT"),
    ("SELECT {x:String}", "UNKNOWN_QUERY_PARAMETER"),
    ("   ", "Empty query"),
])
def test_clickhouses_refusals_are_a_400_with_its_message(
        client: TestClient, statement: str, says: str) -> None:
    assert says in problem(post(client, statement), 400)


def test_a_malformed_request_is_a_422(client: TestClient) -> None:
    problem(client.post("/v1/sql", json={}), 422)
    problem(client.post("/v1/sql", json={"query": ""}), 422)
    problem(client.post("/v1/sql", json={"query": "SELECT 1", "extra": 1}), 422)
    problem(client.post("/v1/sql", content=b"not json",
                        headers={"content-type": "application/json"}), 422)


def test_a_huge_result_is_cut_to_the_row_limit_and_says_so(client: TestClient) -> None:
    body = post(client, "SELECT number FROM system.numbers").json()  # endless
    assert body["truncated"] is True and len(body["rows"]) == ROWS
    exact = post(client, f"SELECT number FROM system.numbers LIMIT {ROWS}").json()
    assert exact["truncated"] is False and len(exact["rows"]) == ROWS


def test_the_byte_budget_and_the_time_limit_hold(url: str, store: ClickHouse) -> None:
    with open_readonly(url, limits=Limits(json_bytes=10_000, seconds=1)) as small:
        answer = small.run("SELECT repeat('x', 1000) AS s FROM system.numbers LIMIT 100")
        assert answer.truncated and 0 < len(answer.rows) < 10
        started = time.monotonic()
        with pytest.raises(SQLRefused, match="TIMEOUT_EXCEEDED"):
            small.run("SELECT count() FROM system.numbers")
        assert time.monotonic() - started < 10


def test_the_writer_is_not_read_only_after_the_sql_session_refused_things(
        client: TestClient, store: ClickHouse) -> None:
    for statement in ("INSERT INTO incidents SELECT * FROM incidents", "SELECT 1 SETTINGS "
                      "readonly = 0", "SET max_result_rows = 0"):
        post(client, statement)
    assert store.rows("SELECT getSetting('readonly') AS r") == [{"r": 0}]
    store.command(f"CREATE TABLE {store.table('after_sql')} (a UInt8) ENGINE = Memory")
    store.command(f"DROP TABLE {store.table('after_sql')}")


def test_without_a_session_the_route_says_so(store: ClickHouse) -> None:
    assert "no SQL" in problem(TestClient(create_app(store)).post(
        "/v1/sql", json={"query": "SELECT 1"}), 404)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(query=st.one_of(
    st.text(min_size=1, max_size=60),
    st.builds(lambda a, b: f"SELECT {a} FROM {b}", st.text(max_size=15),
              st.sampled_from(["incidents", "job_steps", "system.one", "(SELECT 1)", "x"])),
))
def test_any_text_gets_rows_or_a_4xx_problem(client: TestClient, store: ClickHouse,
                                             query: str) -> None:
    resp = post(client, query)
    assert resp.status_code in (200, 400, 403), (query, resp.text)
    if resp.status_code != 200:
        problem(resp, resp.status_code)


# -- flare sql ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api_url(store: ClickHouse, sql: ReadOnlySQL) -> Iterator[str]:
    with served(create_app(store, sql=sql)) as url:
        yield url


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("FLARE_"):
            monkeypatch.delenv(name)


QUERY = "SELECT culprit, kind, lost_gpu_seconds FROM incidents ORDER BY id"


def test_flare_sql_prints_json_csv_and_a_table_from_the_api(
        clean_env: None, api_url: str, store: ClickHouse) -> None:
    expected = store.rows(QUERY.replace("incidents", store.table("incidents")))
    r = runner.invoke(cli, ["sql", "--api", api_url, "--json", QUERY])
    assert r.exit_code == 0, r.output
    assert orjson.loads(r.stdout) == expected
    r = runner.invoke(cli, ["sql", "--api", api_url, "--format", "csv", QUERY])
    lines = r.stdout.splitlines()
    assert lines[0] == "culprit,kind,lost_gpu_seconds" and len(lines) == len(expected) + 1
    assert lines[1].split(",")[:2] == [expected[0]["culprit"], expected[0]["kind"]]
    r = runner.invoke(cli, ["sql", "--api", api_url, QUERY])
    table = r.stdout.splitlines()
    assert "culprit" in table[0] and len(table) == len(expected) + 2  # header, rule, rows
    assert all(e["culprit"] in row for e, row in zip(expected, table[2:], strict=True))
    assert f"{len(expected)} rows" in r.stderr


def test_flare_sql_says_in_one_line_why_a_statement_was_refused_and_exits_2(
        clean_env: None, api_url: str) -> None:
    for statement, says in (("DROP TABLE incidents", "403: read-only"),
                            ("SELEC 1", "400: ClickHouse: Syntax error")):
        r = runner.invoke(cli, ["sql", "--api", api_url, statement])
        assert r.exit_code == 2, r.output
        (line,) = r.output.splitlines()
        assert line.startswith(f"flare sql: {api_url} answered {says}")
    r = runner.invoke(cli, ["sql", "--api", f"http://127.0.0.1:{free_port()}", "SELECT 1"])
    assert r.exit_code == 2
    (line,) = r.output.splitlines()
    assert line.startswith("flare sql: no API at http://127.0.0.1:")


def test_flare_sql_says_when_rows_were_left_out(clean_env: None, api_url: str) -> None:
    r = runner.invoke(cli, ["sql", "--api", api_url, "--json",
                            "SELECT number FROM system.numbers"])
    assert r.exit_code == 0 and len(orjson.loads(r.stdout)) == ROWS
    assert f"the first {ROWS} rows: the result has more" in r.stderr


def test_flare_sql_runs_directly_on_a_clickhouse_url_the_same_way(
        clean_env: None, url: str, api_url: str) -> None:
    via_api = runner.invoke(cli, ["sql", "--api", api_url, "--json", QUERY])
    direct = runner.invoke(cli, ["sql", "--clickhouse", url, "--json", QUERY])
    assert direct.exit_code == 0, direct.output
    assert orjson.loads(direct.stdout) == orjson.loads(via_api.stdout)
    r = runner.invoke(cli, ["sql", "--clickhouse", url, "ALTER TABLE incidents DELETE WHERE 1"])
    assert r.exit_code == 2 and r.output.startswith("flare sql: read-only: ALTER")


def test_flare_sql_on_a_chdb_directory_another_process_owns_says_so_in_one_line(
        tmp_path: Path) -> None:
    url = f"chdb://{tmp_path / 'chdb'}"
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom storage.client import connect\n"
         "db = connect(sys.argv[1])\nprint('ready', flush=True)\ntime.sleep(120)", url],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "ready"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FLARE_")}
        r = subprocess.run(flare_argv("sql", "--clickhouse", url, "SELECT 1"), cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stdout == ""
        (line,) = r.stderr.splitlines()
        assert line.startswith("flare sql: ") and "leave out --clickhouse" in line
    finally:
        owner.kill()
        owner.wait()


def test_a_worker_serves_sql_on_the_store_it_owns(
        start_worker: Callable[..., WorkerProcess]) -> None:
    import httpx

    worker = start_worker(unique("g-sql"))
    url = f"{worker.api}/v1/sql"
    tables = httpx.post(url, json={"query": "SHOW TABLES"}, timeout=30)
    assert tables.status_code == 200, tables.text
    assert ["incidents"] in tables.json()["rows"]
    refused = httpx.post(url, json={"query": "DROP TABLE incidents"}, timeout=30)
    assert refused.status_code == 403
    assert httpx.post(url, json={"query": "EXISTS TABLE incidents"},
                      timeout=30).json()["rows"] == [[1]]
