"""GET /v1/incidents/{id}/trace over the in-memory sample: the evidence steps with stored ops
as a Chrome trace, an empty trace where none are stored, problems for bad input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from storage.testing import SAMPLE_JOB as JOB
from storage.testing import MemoryStore, step_ts
from tests.unit.schemas.test_trace_builder import well_formed

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
GPU = f"{JOB}/gpu/rank:1/30"  # rank 1 slow from step 30: its ops are stored for 30..59
LINK = f"{JOB}/link/node:node-1/5"  # steps 5..20: no ops stored


def test_the_first_steps_from_the_onset_with_the_culprit_arriving_last(
    client: TestClient,
) -> None:
    r = client.get(f"/v1/incidents/{GPU}/trace")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    trace = r.json()
    well_formed(trace)
    other = trace["otherData"]
    assert other == {
        "incident": GPU, "job": JOB, "kind": "gpu", "culprit": "rank:1", "status": "open",
        "from_step": 30, "to_step": 59, "steps": [30, 31, 32, 33, 34], "more_steps": True,
        "truncated": False, "origin_ns": step_ts(30), "ranks": 4, "ops": 40}
    events = trace["traceEvents"]
    ops = [e for e in events if e["ph"] == "X" and e["cat"] != "communicator"]
    assert sorted({e["args"]["step"] for e in ops}) == other["steps"] and len(ops) == 40
    comm = [e["args"] for e in events if e.get("cat") == "communicator"]
    assert [c["step"] for c in comm] == other["steps"]
    assert {(c["group_name"], c["members"], c["last_rank"]) for c in comm} == {("dp.0", 4, 1)}


def test_steps_bounds_what_is_included(client: TestClient) -> None:
    other = client.get(f"/v1/incidents/{GPU}/trace", params={"steps": 50}).json()["otherData"]
    assert other["steps"] == list(range(30, 60)) and other["more_steps"] is False
    assert other["ops"] == 30 * 8
    other = client.get(f"/v1/incidents/{GPU}/trace", params={"steps": 1}).json()["otherData"]
    assert other["steps"] == [30] and other["more_steps"] is True


def test_no_stored_ops_is_an_empty_trace_not_an_error(client: TestClient) -> None:
    r = client.get(f"/v1/incidents/{LINK}/trace")
    assert r.status_code == 200
    assert r.json()["traceEvents"] == [] and r.json()["otherData"]["steps"] == []


def test_the_incident_itself_is_still_served_beside_its_trace(client: TestClient) -> None:
    assert client.get(f"/v1/incidents/{GPU}").json()["id"] == GPU


@pytest.mark.parametrize(("path", "params", "status", "field"), [
    ("nope/trace", {}, 404, None),
    (f"{GPU}x/trace", {}, 404, None),
    ("/trace", {}, 404, None),
    (f"{GPU}/trace", {"steps": 0}, 422, "steps"),
    (f"{GPU}/trace", {"steps": 51}, 422, "steps"),
    (f"{GPU}/trace", {"steps": "x"}, 422, "steps"),
])
def test_bad_input_is_a_problem(
    client: TestClient, problem: Callable[[Response, int], dict[str, Any]], path: str,
    params: dict[str, Any], status: int, field: str | None,
) -> None:
    body = problem(client.get(f"/v1/incidents/{path}", params=params), status)
    if field:
        assert [e["field"] for e in body["errors"]] == [field]


def test_storage_down_is_a_503(
    store: MemoryStore, client: TestClient, problem: Callable[[Response, int], dict[str, Any]]
) -> None:
    store.fail = True
    problem(client.get(f"/v1/incidents/{GPU}/trace"), 503)
