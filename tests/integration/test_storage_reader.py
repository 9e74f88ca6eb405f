"""storage.reader.Queries against the real chDB engine: parameters bound, never spliced;
reads alongside writes from several threads (what FastAPI's thread pool does). The answers
themselves are checked against the in-memory store in test_storage_testing.py and through the
API in test_api_routes.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from storage.client import ClickHouse
from storage.reader import Queries
from storage.testing import make_dead_letter, make_report
from storage.writer import Sink

pytestmark = pytest.mark.integration
DB = "test_reader"


def test_queries_bind_parameters_safely(clean: ClickHouse) -> None:
    sink = Sink(clean)
    for job in ("a'b", "x\\y", "é🙂/ns", "{job:String}"):
        sink.add_report(make_report(job, 3))
    sink.flush()
    q = Queries(clean)
    assert sorted(j["job"] for j in q.jobs()) == sorted(["a'b", "x\\y", "é🙂/ns", "{job:String}"])
    assert q.last_step("a'b") == 3 and q.last_step("a") is None
    job = q.job("{job:String}")
    assert job is not None and job["n_ranks"] == 4
    with pytest.raises(ValueError, match="non-negative integer"):
        q.jobs(limit=-1)


def test_reads_and_flushes_from_several_threads(clean: ClickHouse) -> None:
    sink, q = Sink(clean), Queries(clean)
    with ThreadPoolExecutor(3) as pool:  # FastAPI runs sync endpoints in threads like these
        reads = [pool.submit(q.jobs) for _ in range(30)]
        for step in range(10):
            sink.add_report(make_report("j", step))
            sink.flush()
        assert all(isinstance(f.result(), list) for f in reads)
    assert q.last_step("j") == 9


def test_dead_letters_newest_offsets_first(clean: ClickHouse) -> None:
    sink = Sink(clean)
    for offset in (3, 9, 5, 9):
        sink.add_dead_letter(make_dead_letter(offset))
    sink.flush()
    rows = Queries(clean).dead_letters(topic="flare.steps.v1")
    assert [r["offset"] for r in rows] == [9, 5, 3]
    assert rows[0] == {"topic": "flare.steps.v1", "partition": 0, "offset": 9,
                       "reason": "$.v: unsupported version", "payload_b64": "e30="}
    assert Queries(clean).dead_letters(topic="other") == []
