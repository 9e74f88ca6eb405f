"""storage.writer.Sink without a database: rows checked when added, one INSERT per table in
order, and what a failed flush keeps (the chDB round trips are in
tests/integration/test_storage_writer.py)."""

from __future__ import annotations

from unittest.mock import create_autospec

import msgspec
import numpy as np
import pytest

from schemas.report import Detection
from storage.client import ClickHouse, StorageError
from storage.testing import make_dead_letter, make_incident, make_report
from storage.writer import FLUSH_ORDER, Sink


def fake_db() -> ClickHouse:
    db = create_autospec(ClickHouse, spec_set=True, instance=True)
    db.table.side_effect = lambda name: f"flare.{name}"
    return db


def test_a_bad_report_is_refused_whole_with_table_and_column() -> None:
    sink = Sink(fake_db())
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
    bad = msgspec.structs.replace(make_incident("j"), suspects=None)
    with pytest.raises(ValueError, match=r"incidents\.suspect_entities"):
        sink.add_incident(bad)
    assert sink.pending_rows == 0  # not even the job_steps row of those reports


def test_one_insert_per_table_in_flush_order_with_the_spec_columns() -> None:
    db = fake_db()
    sink = Sink(db)
    sink.add_incident(make_incident("j"))
    sink.add_report(make_report("j", 1, detections=[Detection("rank:1", "gpu", 4.0, 0.3)],
                                with_frame=True))
    sink.add_dead_letter(make_dead_letter(3))
    sink.add_dead_letter(make_dead_letter(3))  # re-delivered: kept once
    assert sink.flush() == {"job_steps": 1, "rank_steps": 4, "group_steps": 2, "ops": 8,
                            "detections": 1, "incidents": 1, "dead_letters": 1}
    tables = [call.args[0] for call in db.insert_arrow.call_args_list]
    assert tables == [f"flare.{t}" for t in FLUSH_ORDER]  # steps before incidents
    incidents = db.insert_arrow.call_args_list[5].args[1].to_pylist()[0]
    assert incidents["suspect_entities"] == ["rank:1", "node:node-0"]
    assert incidents["version"] == 40 and incidents["resolved_step"] is None


def test_a_failed_flush_keeps_the_tables_not_yet_written() -> None:
    db = fake_db()
    db.insert_arrow.side_effect = [None, StorageError("rank_steps: down")]
    sink = Sink(db)
    sink.add_report(make_report("j", 1))
    with pytest.raises(StorageError):
        sink.flush()
    assert sink.pending_rows == 4 + 2  # rank_steps and group_steps wait; job_steps went
    db.insert_arrow.side_effect = None
    assert sink.flush() == {"rank_steps": 4, "group_steps": 2}
    assert sink.stats.rows["job_steps"] == 1 and sink.stats.flushes == 1


def test_an_automatic_flush_failure_is_counted_not_raised() -> None:
    db = fake_db()
    db.insert_arrow.side_effect = StorageError("down")
    sink = Sink(db, max_rows=10)
    for step in range(3):  # 7 rows each: the automatic flush at 14 rows fails quietly
        sink.add_report(make_report("j", step))
    assert sink.stats.failed_flushes == 1 and sink.pending_rows == 21
    with pytest.raises(ValueError, match="max_rows"):
        Sink(db, max_rows=0)


def test_rows_added_while_taken_rows_are_written_wait_for_the_next_write() -> None:
    """The worker writes taken rows on a thread while its loop adds more: the write sends
    only what it took, and what came meanwhile waits in the sink."""
    db = fake_db()
    sink = Sink(db)
    sink.add_report(make_report("j", 1))
    taken = sink.take()
    sink.add_report(make_report("j", 2))
    assert taken.write() == {"job_steps": 1, "rank_steps": 4, "group_steps": 2}
    taken.settle(stored=True)
    assert sink.pending_rows == 7 and sink.stats.flushes == 1
    assert sink.flush() == {"job_steps": 1, "rank_steps": 4, "group_steps": 2}
    steps = [call.args[1].column("step").to_pylist() for call in db.insert_arrow.call_args_list]
    assert steps == [[1], [1] * 4, [1] * 2, [2], [2] * 4, [2] * 2]


def test_a_failed_write_hands_back_its_rows_in_front_of_the_newer_ones() -> None:
    db = fake_db()
    db.insert_arrow.side_effect = [None, StorageError("rank_steps: down")]
    sink = Sink(db)
    sink.add_report(make_report("j", 1))
    taken = sink.take()
    sink.add_report(make_report("j", 2))
    with pytest.raises(StorageError):
        taken.write()
    taken.settle(stored=False)
    assert sink.stats.rows["job_steps"] == 1 and sink.stats.flushes == 0
    db.insert_arrow.side_effect = None
    assert sink.flush() == {"job_steps": 1, "rank_steps": 8, "group_steps": 4}
    rank_steps = db.insert_arrow.call_args_list[3].args[1]
    assert rank_steps.column("step").to_pylist() == [1] * 4 + [2] * 4  # the older rows first


def test_a_sink_told_not_to_write_by_itself_only_says_it_is_full() -> None:
    db = fake_db()
    sink = Sink(db, max_rows=10, flush_when_full=False)
    sink.add_report(make_report("j", 1))
    assert not sink.full
    sink.add_report(make_report("j", 2))  # 14 rows: an owner writes them, the sink does not
    assert sink.full and db.insert_arrow.call_count == 0
