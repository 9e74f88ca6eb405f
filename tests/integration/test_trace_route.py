"""An incident's trace over the real chDB engine: the ops the Sink wrote come back through
`Queries.op_steps` / `Queries.ops` as the same trace the in-memory store gives, served by the
route and written by `flare trace` from a live API server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import orjson
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from api.app import create_app
from flare.cli import app
from storage.client import ClickHouse
from storage.reader import Queries
from storage.testing import SAMPLE_JOB, MemoryStore, load_sample, step_ts
from tests.integration.conftest import sample_store
from tests.live_api import served
from tests.unit.schemas.test_trace_builder import well_formed

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
GPU = f"{SAMPLE_JOB}/gpu/rank:1/30"


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouse]:
    with sample_store(f"chdb://{tmp_path_factory.mktemp('chdb')}?database=test_trace") as client:
        yield client


@pytest.fixture(scope="module")
def client(db: ClickHouse) -> TestClient:
    return TestClient(create_app(Queries(db)))


def test_the_stored_ops_come_back_as_written(db: ClickHouse) -> None:
    q = Queries(db)
    assert q.op_steps(SAMPLE_JOB, 0, 59, limit=3) == [
        {"step": 0, "ops": 8}, {"step": 30, "ops": 8}, {"step": 31, "ops": 8}]
    assert q.op_steps(SAMPLE_JOB, 5, 20) == []
    slow = [r for r in q.ops(SAMPLE_JOB, [31]) if r["rank"] == 1]
    assert slow == [
        {"step": 31, "rank": 1, "ord": 0, "ts_ns": step_ts(31), "node": "node-0",
         "t_start_ns": step_ts(31), "kind": "compute", "name": "fwd", "group_name": "",
         "seq": 3100, "start_ns": 0, "dur_ns": 1350, "bytes": 0},
        {"step": 31, "rank": 1, "ord": 1, "ts_ns": step_ts(31), "node": "node-0",
         "t_start_ns": step_ts(31), "kind": "coll", "name": "all_reduce", "group_name": "dp.0",
         "seq": 3101, "start_ns": 1450, "dur_ns": 900, "bytes": 1 << 20}]
    assert len(q.ops(SAMPLE_JOB, [30, 45, 59], limit=20)) == 20


def test_the_route_gives_the_trace_the_memory_store_gives(client: TestClient) -> None:
    memory = MemoryStore()
    load_sample(memory)
    for steps in (1, 5, 50):
        r = client.get(f"/v1/incidents/{GPU}/trace", params={"steps": steps})
        assert r.status_code == 200 and r.headers["content-type"] == "application/json"
        trace = r.json()
        well_formed(trace)
        expected = TestClient(create_app(memory)).get(f"/v1/incidents/{GPU}/trace",
                                                      params={"steps": steps}).json()
        assert trace == expected
    assert trace["otherData"]["steps"] == list(range(30, 60))
    comm = [e["args"] for e in trace["traceEvents"] if e.get("cat") == "communicator"]
    assert len(comm) == 30 and {c["last_rank"] for c in comm} == {1}  # the culprit


def test_no_ops_and_unknown_incidents(client: TestClient) -> None:
    r = client.get(f"/v1/incidents/{SAMPLE_JOB}/link/node:node-1/5/trace")
    assert r.status_code == 200 and r.json()["traceEvents"] == []
    r = client.get("/v1/incidents/nope/trace")
    assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(incident=st.one_of(st.text(max_size=40), st.sampled_from([GPU, SAMPLE_JOB, "", "%2F"])),
       steps=st.one_of(st.text(max_size=8), st.integers(-(2**70), 2**70).map(str)))
def test_any_id_and_steps_get_a_trace_or_a_problem(
    client: TestClient, incident: str, steps: str
) -> None:
    r = client.get(f"/v1/incidents/{quote(incident, safe='/')}/trace", params={"steps": steps})
    assert r.status_code in (200, 404, 422), r.text
    if r.status_code == 200:
        well_formed(r.json())
    else:
        assert r.headers["content-type"] == "application/problem+json"


@pytest.fixture(scope="module")
def api_url(db: ClickHouse) -> Iterator[str]:
    with served(create_app(Queries(db))) as url:
        yield url


def test_flare_trace_writes_the_file_from_a_live_api(api_url: str, tmp_path: Path) -> None:
    out = tmp_path / "x.json"
    r = CliRunner().invoke(app, ["trace", GPU, "--out", str(out), "--api", api_url,
                                 "--steps", "3"])
    assert r.exit_code == 0, r.output
    trace = orjson.loads(out.read_bytes())
    well_formed(trace)
    assert trace["otherData"]["steps"] == [30, 31, 32] and trace["otherData"]["ops"] == 24
    threads = {e["args"]["name"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {"rank 0 (node-0)", "rank 1 (node-0)", "rank 2 (node-1)",
                       "rank 3 (node-1)", "dp.0"}
