"""Storage: URL parsing, DDL, the batched sink and the reader, against the real chDB engine."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import msgspec
import numpy as np
import pytest
from pydantic import SecretStr

from schemas.report import Detection
from storage.client import (
    ClickHouse,
    StorageError,
    connect,
    connect_when_ready,
    parse_url,
)
from storage.migrations import TABLES, VIEWS, apply_schema, split_statements, statements
from storage.reader import Queries
from storage.testing import (
    make_dead_letter,
    make_frame,
    make_incident,
    make_report,
    step_ts,
)
from storage.writer import SCHEMAS, Sink, incident_version

DB = "test_storage"

# -- pure: URLs, DDL text, versions -----------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "path", "database"),
    [
        ("chdb:///var/lib/flare", "/var/lib/flare", "flare"),
        ("chdb:///./data/chdb", "./data/chdb", "flare"),
        ("chdb:///../x?database=other", "../x", "other"),
        ("chdb://:memory:", ":memory:", "flare"),
        ("chdb://memory", ":memory:", "flare"),
    ],
)
def test_parse_chdb_urls(url: str, path: str, database: str) -> None:
    parsed = parse_url(url)
    assert (parsed.scheme, parsed.path, parsed.database) == ("chdb", path, database)
    assert parsed.embedded


def test_parse_server_url_takes_password_from_settings_and_hides_it() -> None:
    parsed = parse_url("https://alice@ch.example:8443/prod", SecretStr("s3cret"))
    assert (parsed.host, parsed.port, parsed.username, parsed.database) == (
        "ch.example", 8443, "alice", "prod")
    assert parsed.password == "s3cret"
    assert "s3cret" not in repr(parsed) and "s3cret" not in parsed.redacted()
    assert parse_url("http://bob:pw@h/").password == "pw"  # the URL's own password wins
    assert parse_url("http://h").database == "flare"


@pytest.mark.parametrize(
    "url",
    ["ftp://h/db", "chdb://relative/path", "http:///db", "http://h/bad-name", "http://h:99999/",
     "clickhouse.example:8123", ""],
)
def test_bad_urls_say_why(url: str) -> None:
    with pytest.raises(ValueError, match="ClickHouse URL"):
        parse_url(url)


def test_ddl_is_idempotent_text_and_renames_the_database() -> None:
    stmts = statements()
    assert all("IF NOT EXISTS" in s for s in stmts)
    assert stmts[0] == "CREATE DATABASE IF NOT EXISTS flare"
    created = {s.split()[5] for s in stmts[1:]}
    assert created == {f"flare.{t}" for t in TABLES + VIEWS}
    other = statements("other")
    assert other[0] == "CREATE DATABASE IF NOT EXISTS other"
    assert not any("flare." in s for s in other)
    for s in stmts:
        if " TABLE " in s:
            assert "ReplacingMergeTree" in s and "TTL inserted_at" in s and "PARTITION BY" in s


def test_split_statements_drops_comments() -> None:
    text = "-- a; comment\nCREATE A;\n  -- b\nCREATE B\n(x);\n\n"
    assert split_statements(text) == ["CREATE A", "CREATE B\n(x)"]


def test_incident_versions_order_states() -> None:
    opened = make_incident("j", last_step=20)
    later = make_incident("j", last_step=21)
    resolved = make_incident("j", last_step=21, status="resolved", resolved_step=21)
    resolved_later = make_incident("j", last_step=21, status="resolved", resolved_step=31)
    versions = [incident_version(i) for i in (opened, later, resolved, resolved_later)]
    assert versions == sorted(versions) and len(set(versions)) == 4


def test_connect_when_ready_retries_on_a_fake_clock_then_gives_up() -> None:
    clock = [0.0]
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        sleeps.append(s)
        clock[0] += s

    with pytest.raises(StorageError, match="gave up after 3 s"):
        connect_when_ready("http://127.0.0.1:1/", timeout_s=3, interval_s=1,
                           now=lambda: clock[0], sleep=sleep)
    assert sleeps == [1, 1, 1]
    with pytest.raises(ValueError):  # a malformed URL fails at once
        connect_when_ready("nope://", now=lambda: 0.0, sleep=sleep)
    assert len(sleeps) == 3


def test_a_bad_report_is_refused_whole_with_table_and_column() -> None:
    sink = Sink(None)  # type: ignore[arg-type]  # rows are checked when added, no database
    report = make_report("j", 1)
    report.ranks.rank = np.array([0, 1, -2, 3])
    with pytest.raises(ValueError, match=r"rank_steps\.rank"):
        sink.add_report(report)
    short = make_report("j", 2)
    short.ranks.gap_s = short.ranks.gap_s[:2]
    with pytest.raises(ValueError, match=r"rank_steps\.gap_s"):
        sink.add_report(short)
    nameless = make_report("j", 3)
    nameless.ranks.node[2] = None  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=r"rank_steps\.node: 1 missing"):
        sink.add_report(nameless)
    with pytest.raises(ValueError, match=r"dead_letters\.partition"):
        sink.add_dead_letter(msgspec.structs.replace(make_dead_letter(1), partition=2**40))
    assert sink.pending_rows == 0  # not even the job_steps row of those reports


# -- integration: the real chDB engine ------------------------------------------------------


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory):
    client = connect(f"chdb://{tmp_path_factory.mktemp('chdb')}?database={DB}")
    apply_schema(client)
    yield client
    client.close()


@pytest.fixture
def clean(db: ClickHouse) -> ClickHouse:
    for table in TABLES:
        db.command(f"TRUNCATE TABLE {db.table(table)}")
    return db


def count(db: ClickHouse, table: str, final: bool = True) -> int:
    return db.rows(f"SELECT count() AS n FROM {db.table(table)} {'FINAL' if final else ''}")[0]["n"]


@pytest.mark.integration
def test_schema_applies_twice_and_matches_the_sink(db: ClickHouse) -> None:
    assert apply_schema(db) == len(statements(DB))
    found = db.rows("SELECT name, engine FROM system.tables WHERE database = {d:String}",
                    {"d": DB})
    engines = {r["name"]: r["engine"] for r in found}
    assert {t: "ReplacingMergeTree" for t in TABLES}.items() <= engines.items()
    assert all(engines[v] == "View" for v in VIEWS)
    for table, schema in SCHEMAS.items():
        cols = {r["name"] for r in db.rows(
            "SELECT name FROM system.columns WHERE database = {d:String} AND table = {t:String}",
            {"d": DB, "t": table})}
        assert set(schema.names) | {"inserted_at"} == cols, table


@pytest.mark.integration
def test_reports_round_trip_in_one_insert_per_table(clean: ClickHouse) -> None:
    sink = Sink(clean)
    for step in range(20):
        dets = [Detection("rank:1", "gpu", 4.0, 0.3)] if step >= 10 else []
        sink.add_report(make_report("j", step, slow_rank=1 if step >= 10 else None,
                                    detections=dets, with_frame=step == 15))
    assert sink.pending_rows == 20 + 80 + 40 + 10 + 8
    written = sink.flush()
    assert written == {"job_steps": 20, "rank_steps": 80, "group_steps": 40, "detections": 10,
                       "ops": 8}
    assert sink.pending_rows == 0 and sink.stats.flushes == 1
    q = Queries(clean)
    steps = q.steps("j", from_step=0, limit=100)
    assert [s["step"] for s in steps] == list(range(20))
    assert steps[3]["ts_ns"] == step_ts(3)  # ns survive DateTime64(9)
    scores = q.rank_scores("j", 10, 19, sort="caused_wait")
    assert scores[0]["rank"] == 1 and scores[0]["compute_ratio"] == pytest.approx(1.5)
    assert scores[0]["caused_wait_s"] == pytest.approx(0.9)
    assert [r["rank"] for r in q.rank_scores("j", 10, 19, sort="gap")] == [3, 2, 1, 0]
    det = q.detections("j", "rank:1", 0, 100)
    assert [d["step"] for d in det] == list(range(10, 20)) and det[0]["excess_s"] == 0.3
    ops = clean.rows(f"SELECT rank, ord, node, kind, name, group_name, seq, bytes "
                     f"FROM {clean.table('ops')} FINAL WHERE step = 15 ORDER BY rank, ord")
    assert len(ops) == 8
    assert ops[2] == {"rank": 1, "ord": 0, "node": "node-0", "kind": "compute", "name": "fwd",
                      "group_name": "", "seq": 1500, "bytes": 0}
    assert ops[7]["node"] == "node-1" and ops[7]["group_name"] == "dp.0"


@pytest.mark.integration
def test_redelivery_rewrites_rows_instead_of_duplicating(clean: ClickHouse) -> None:
    sink = Sink(clean)
    for _ in range(2):  # a crash before the offset commit: everything is delivered twice
        for step in range(5):
            sink.add_report(make_report("j", step, with_frame=True))
        sink.add_dead_letter(make_dead_letter(7))
        sink.flush()
    assert count(clean, "job_steps", final=False) == 10  # physically twice, until a merge
    assert {t: count(clean, t) for t in ("job_steps", "rank_steps", "group_steps", "ops",
                                         "dead_letters")} == {
        "job_steps": 5, "rank_steps": 20, "group_steps": 10, "ops": 40, "dead_letters": 1}
    assert Queries(clean).jobs()[0]["steps"] == 5


@pytest.mark.integration
def test_the_newest_incident_state_wins_even_when_an_old_one_is_replayed(
    clean: ClickHouse,
) -> None:
    sink = Sink(clean)
    sink.add_incident(make_incident("j", last_step=20))
    sink.add_incident(make_incident("j", last_step=25))  # same batch: only the newest is kept
    assert sink.pending_rows == 1
    sink.flush()
    sink.add_incident(make_incident("j", last_step=30, status="resolved", resolved_step=30))
    sink.flush()
    sink.add_incident(make_incident("j", last_step=25))  # replayed older state
    sink.flush()
    q = Queries(clean)
    (inc,) = q.incidents(job="j")
    assert (inc["status"], inc["last_step"], inc["resolved_step"]) == ("resolved", 30, 30)
    assert inc["suspects"][0] == {"entity": "rank:1", "confidence": 0.9}
    assert q.incidents(status="open") == []
    assert count(clean, "incidents") == 1
    assert clean.rows(f"SELECT count() AS n FROM {clean.table('v_open_incidents')}")[0]["n"] == 0


@pytest.mark.integration
def test_sink_flushes_by_itself_past_max_rows(clean: ClickHouse) -> None:
    sink = Sink(clean, max_rows=50)
    for step in range(12):  # 1 + 4 + 2 rows per step
        sink.add_report(make_report("j", step))
    assert sink.stats.flushes == 1 and 0 < sink.pending_rows < 50
    assert count(clean, "job_steps") == 8


@pytest.mark.integration
def test_failed_flush_keeps_unwritten_rows_for_the_next_try(clean: ClickHouse) -> None:
    sink = Sink(clean)
    sink.add_report(make_report("j", 1))
    sink.add_incident(make_incident("j"))
    clean.command(f"DROP TABLE {clean.table('v_rank_scores')}")
    clean.command(f"DROP TABLE {clean.table('rank_steps')}")
    try:
        with pytest.raises(StorageError, match="rank_steps"):
            sink.flush()
        assert sink.pending_rows == 4 + 2 + 1  # rank_steps, group_steps, incidents wait
    finally:
        apply_schema(clean)
    assert sink.flush() == {"rank_steps": 4, "group_steps": 2, "incidents": 1}
    assert count(clean, "job_steps") == 1 and count(clean, "rank_steps") == 4


@pytest.mark.integration
def test_dashboard_views_answer(clean: ClickHouse) -> None:
    sink = Sink(clean)
    for step in range(150):
        sink.add_report(make_report("j", step, step_time_s=1.5 if step == 149 else 1.0,
                                    slow_rank=2 if step >= 100 else None))
    sink.flush()
    last = clean.rows(f"SELECT step, delta FROM {clean.table('v_job_steps')} "
                      "ORDER BY step DESC LIMIT 1")
    assert last == [{"step": 149, "delta": 1.5}]
    scores = clean.rows(f"SELECT rank, steps, compute_ratio FROM {clean.table('v_rank_scores')}"
                        " WHERE job = 'j' ORDER BY rank")
    assert [s["steps"] for s in scores] == [100] * 4  # the newest 100 steps only
    assert scores[2]["compute_ratio"] == pytest.approx(1.25)  # slow in 50 of them


@pytest.mark.integration
def test_queries_bind_parameters_safely(clean: ClickHouse) -> None:
    sink = Sink(clean)
    for job in ("a'b", "x\\y", "é🙂/ns", "{job:String}"):
        sink.add_report(make_report(job, 3))
    sink.flush()
    q = Queries(clean)
    assert sorted(j["job"] for j in q.jobs()) == sorted(["a'b", "x\\y", "é🙂/ns", "{job:String}"])
    assert q.last_step("a'b") == 3 and q.last_step("a") is None
    assert q.job("{job:String}")["n_ranks"] == 4


@pytest.mark.integration
def test_frame_with_duplicate_names_still_inserts(clean: ClickHouse) -> None:
    frame = make_frame("j", 1)
    frame.nodes = ["n", "n", "n"]  # an interning bug upstream must not break the flush
    report = make_report("j", 1)
    report.frame = frame
    sink = Sink(clean)
    sink.add_report(report)
    sink.flush()
    nodes = clean.rows(f"SELECT DISTINCT node FROM {clean.table('ops')}")
    assert nodes == [{"node": "n"}]


@pytest.mark.integration
def test_reads_and_flushes_from_several_threads(clean: ClickHouse) -> None:
    sink, q = Sink(clean), Queries(clean)
    with ThreadPoolExecutor(3) as pool:  # FastAPI runs sync endpoints in threads like these
        reads = [pool.submit(q.jobs) for _ in range(30)]
        for step in range(10):
            sink.add_report(make_report("j", step))
            sink.flush()
        assert all(isinstance(f.result(), list) for f in reads)
    assert q.last_step("j") == 9 and count(clean, "rank_steps") == 40


@pytest.mark.integration
def test_automatic_flush_failure_keeps_rows_and_leaves_the_error_to_flush(
    clean: ClickHouse,
) -> None:
    sink = Sink(clean, max_rows=20)
    clean.command(f"DROP TABLE {clean.table('v_job_steps')}")
    clean.command(f"DROP TABLE {clean.table('job_steps')}")
    try:
        for step in range(5):  # 7 rows each: the automatic flush at 21 rows fails quietly
            sink.add_report(make_report("j", step))
        assert sink.stats.failed_flushes == 1 and sink.pending_rows == 35
        with pytest.raises(StorageError):
            sink.flush()
    finally:
        apply_schema(clean)
    sink.flush()
    assert count(clean, "job_steps") == 5 and count(clean, "rank_steps") == 20
