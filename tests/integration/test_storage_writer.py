"""storage.writer.Sink against the real chDB engine: reports, incidents and dead letters
round-trip through one INSERT per table, re-deliveries replace rows, failures keep them."""

from __future__ import annotations

import datetime

import msgspec
import pytest

from schemas.report import Detection
from schemas.wire import StackGroup
from storage.client import ClickHouse, StorageError
from storage.migrations import statements
from storage.reader import Queries
from storage.testing import make_dead_letter, make_frame, make_incident, make_report, step_ts
from storage.writer import Sink

pytestmark = pytest.mark.integration
DB = "test_storage"


def count(db: ClickHouse, table: str, final: bool = True) -> int:
    return db.rows(f"SELECT count() AS n FROM {db.table(table)} {'FINAL' if final else ''}")[0]["n"]


def recreate(db: ClickHouse) -> None:
    """Bring back a table a test dropped: migrations apply once, so run the (idempotent)
    statements themselves."""
    for stmt in statements(db.database):
        db.command(stmt)


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


def test_sink_flushes_by_itself_past_max_rows(clean: ClickHouse) -> None:
    sink = Sink(clean, max_rows=50)
    for step in range(12):  # 1 + 4 + 2 rows per step
        sink.add_report(make_report("j", step))
    assert sink.stats.flushes == 1 and 0 < sink.pending_rows < 50
    assert count(clean, "job_steps") == 8


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
        recreate(clean)
    assert sink.flush() == {"rank_steps": 4, "group_steps": 2, "incidents": 1}
    assert count(clean, "job_steps") == 1 and count(clean, "rank_steps") == 4


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
        recreate(clean)
    sink.flush()
    assert count(clean, "job_steps") == 5 and count(clean, "rank_steps") == 20


def test_an_incident_reads_back_as_the_incident_v1_it_was(clean: ClickHouse) -> None:
    hang = msgspec.structs.replace(
        make_incident("j", kind="hang", culprit="rank:3"),
        stacks=[StackGroup("training", ["t.py:9 in main", "d.py:4 in load"], "3", 1, "0-2"),
                StackGroup("", [], "1", 1, "0,2-3", "process stopped: it cannot answer")])
    incs = [make_incident("j"), make_incident("j", culprit="rank:2", status="resolved",
                                              resolved_step=25), hang]
    sink = Sink(clean)
    for inc in incs:
        sink.add_incident(inc)
    sink.flush()
    q = Queries(clean)
    for inc in incs:  # every field of Incident v1 survives the row (a new one cannot be lost)
        assert q.incident(inc.id) == msgspec.to_builtins(inc)


def test_lost_gpu_hours_per_day_count_each_incident_once_in_its_newest_state(
    clean: ClickHouse,
) -> None:
    sink = Sink(clean)
    hour = 3600.0
    # one incident in three states, one insert each: the newest (last step 25) is written
    # second, and a replayed older state after it must not count
    for last, lost in ((20, 0.5 * hour), (25, 2 * hour), (22, 1.5 * hour)):
        sink.add_incident(make_incident("j", last_step=last, lost_gpu_seconds=lost))
        sink.flush()
    sink.add_incident(make_incident("j", culprit="rank:7", lost_gpu_seconds=hour,
                                    lost_gpu_seconds_per_step=38.0))
    sink.add_incident(make_incident("k", culprit="node:n3", kind="node", lost_gpu_seconds=hour,
                                    status="resolved", resolved_step=30))
    sink.add_incident(make_incident("k", culprit="node:n3", kind="node", onset_step=9000,
                                    opened_step=45_000, last_step=45_010,
                                    lost_gpu_seconds=0.25 * hour))  # a day later
    sink.flush()
    rows = clean.rows(
        f"SELECT day, kind, culprit, incidents, still_open, lost_gpu_hours "
        f"FROM {clean.table('v_incident_cost_daily')} ORDER BY day, kind, culprit")
    day1, day2 = datetime.date(2026, 9, 21), datetime.date(2026, 9, 22)
    assert [(r["day"], r["kind"], r["culprit"], r["incidents"], r["still_open"],
             round(r["lost_gpu_hours"], 6)) for r in rows] == [
        (day1, "gpu", "rank:1", 1, 1, 2.0), (day1, "gpu", "rank:7", 1, 1, 1.0),
        (day1, "node", "node:n3", 1, 0, 1.0), (day2, "node", "node:n3", 1, 1, 0.25)]
    (row,) = clean.rows(f"SELECT lost_gpu_seconds_per_step FROM "
                        f"{clean.table('v_open_incidents')} WHERE culprit = 'rank:7'")
    assert row["lost_gpu_seconds_per_step"] == 38.0


def test_lost_gpu_hours_are_spread_over_the_days_an_incident_lasted(clean: ClickHouse) -> None:
    # midnight after the sample clock's start falls at step 17,600 (2 s steps): an incident
    # opened 4 h before it whose latest step came 2 h after it lost 2/3 of its cost on the
    # first day and 1/3 on the second; an open hang (no step since) stays on its first day
    sink = Sink(clean)
    sink.add_report(make_report("j", 21_200))
    sink.add_incident(make_incident("j", culprit="node:n1", kind="node", onset_step=10_400,
                                    opened_step=10_400, last_step=21_200,
                                    lost_gpu_seconds=6 * 3600, status="resolved",
                                    resolved_step=21_200))
    sink.add_incident(make_incident("j", culprit="rank:5", kind="hang", onset_step=10_400,
                                    opened_step=10_400, last_step=10_400,
                                    lost_gpu_seconds=3600))
    sink.flush()
    rows = clean.rows(
        f"SELECT day, kind, incidents, opened, still_open, lost_gpu_hours "
        f"FROM {clean.table('v_incident_cost_daily')} ORDER BY day, kind")
    day1, day2 = datetime.date(2026, 9, 21), datetime.date(2026, 9, 22)
    assert [(r["day"], r["kind"], r["incidents"], r["opened"], r["still_open"],
             round(r["lost_gpu_hours"], 6)) for r in rows] == [
        (day1, "hang", 1, 1, 1, 1.0), (day1, "node", 1, 1, 0, 4.0), (day2, "node", 1, 0, 0, 2.0)]
