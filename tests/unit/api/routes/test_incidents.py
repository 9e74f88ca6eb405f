"""api.routes.incidents over the in-memory store: filters, both ways of paging, one incident
with its evidence, and bad parameters as problems naming the field."""

from __future__ import annotations

import msgspec
import pytest
from fastapi.testclient import TestClient

from schemas.wire import StackGroup
from storage.testing import SAMPLE_JOB as JOB
from storage.testing import MemoryStore, make_incident, step_ts

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def culprits(client: TestClient, **params: object) -> list[str]:
    return [i["culprit"] for i in client.get("/v1/incidents", params=params).json()["items"]]


def test_incident_filters(client: TestClient) -> None:
    assert len(culprits(client)) == 9
    assert culprits(client, job=JOB) == ["rank:1", "node:node-1"]  # newest opening first
    assert culprits(client, job=JOB, status="open") == ["rank:1"]
    assert culprits(client, kind="link") == ["node:node-1"]
    assert culprits(client, job="many", since=step_ts(100)) == ["rank:6", "rank:5"]
    assert culprits(client, job="many", until=str(step_ts(5))) == [
        "rank:4", "rank:3", "rank:2", "rank:1", "rank:0"]
    assert culprits(client, job="many", since="2026-09-21T14:16:40Z") == ["rank:6", "rank:5"]
    assert culprits(client, job="many", since="2026-09-21T16:16:40+02:00") == ["rank:6",
                                                                              "rank:5"]
    assert culprits(client, job="nobody") == []


def test_an_incident_shows_every_field_of_incident_v1(client: TestClient) -> None:
    item = client.get("/v1/incidents", params={"kind": "link"}).json()["items"][0]
    expected = make_incident(JOB, culprit="node:node-1", kind="link", onset_step=5,
                             opened_step=6, last_step=12, status="resolved", resolved_step=20)
    assert list(item) == list(type(expected).__struct_fields__)  # the wire's order
    assert item["suspects"] == [{"entity": "node:node-1", "confidence": 0.9},
                                {"entity": "node:node-0", "confidence": 0.1}]
    assert item["resolved_step"] == 20 and item["v"] == 1


def test_an_incident_serves_what_its_newest_state_costs(
    store: MemoryStore, client: TestClient
) -> None:
    newer = msgspec.structs.replace(
        make_incident("costly", last_step=30, lost_gpu_seconds=5400.0,
                      lost_gpu_seconds_per_step=38.0), slowdown=1.31)
    older = make_incident("costly", last_step=20, lost_gpu_seconds=600.0,
                          lost_gpu_seconds_per_step=30.0)
    store.add_incident(newer)
    store.add_incident(older)  # a replayed older state, written last, must not win
    store.flush()
    cost = ("slowdown", "lost_gpu_seconds", "lost_gpu_seconds_per_step")
    (item,) = client.get("/v1/incidents", params={"job": "costly"}).json()["items"]
    assert {k: item[k] for k in cost} == {
        "slowdown": 1.31, "lost_gpu_seconds": 5400.0, "lost_gpu_seconds_per_step": 38.0}
    detail = client.get(f"/v1/incidents/{newer.id}").json()
    assert {k: detail[k] for k in cost} == {k: item[k] for k in cost}
    described = client.get("/openapi.json").json()["components"]["schemas"]["Incident"]
    assert "latest step" in described["properties"]["lost_gpu_seconds_per_step"]["description"]


def test_a_hang_serves_its_merged_stacks_and_other_incidents_none(
    store: MemoryStore, client: TestClient
) -> None:
    view = [StackGroup("training", ["train.py:9 in main", "data.py:40 in load"], "5", 1, "0-4,6-7"),
            StackGroup("", [], "2", 1, "0-1,3-7", "process stopped (SIGSTOP): it cannot answer"),
            StackGroup("training", ["train.py:9 in main", "c10d.py:3 in all_reduce"], "0-1,3-4,6-7",
                       6, "2,5")]
    hang = msgspec.structs.replace(make_incident("hung", kind="hang", culprit="rank:5"),
                                   stacks=view)
    store.add_incident(hang)
    store.flush()
    detail = client.get(f"/v1/incidents/{hang.id}").json()
    assert detail["stacks"] == msgspec.to_builtins(view)
    (item,) = client.get("/v1/incidents", params={"job": "hung"}).json()["items"]
    assert item["stacks"][0]["ranks"] == "5" and item["stacks"][1]["note"].startswith("process")
    gpu = client.get("/v1/incidents", params={"job": JOB}).json()["items"][0]
    assert gpu["stacks"] is None
    described = client.get("/openapi.json").json()["components"]["schemas"]
    assert "odd one out" in described["Incident"]["properties"]["stacks"]["description"]
    assert "ranges" in described["StackGroup"]["properties"]["ranks"]["description"]


def test_pages_by_cursor_and_by_offset_agree(client: TestClient, incident_pages) -> None:
    everything, by_cursor, by_offset = incident_pages(client)
    assert everything["limit"] == 1000
    assert by_cursor == [i["id"] for i in everything["items"]]
    assert by_offset == by_cursor

def test_one_incident_with_its_evidence(client: TestClient) -> None:
    inc_id = f"{JOB}/gpu/rank:1/30"
    body = client.get(f"/v1/incidents/{inc_id}").json()
    assert body["culprit"] == "rank:1" and body["status"] == "open"
    ev = body["evidence"]
    assert (ev["from_step"], ev["to_step"], ev["stride"]) == (30, 59, 1)
    assert [p["step"] for p in ev["steps"]] == list(range(30, 60))
    spike = next(p for p in ev["steps"] if p["step"] == 45)
    assert spike["irregular"] == "spike" and spike["delta"] == 1.5
    assert len(ev["culprit_detections"]) == 30
    assert ev["culprit_detections"][0] == {"step": 30, "kind": "gpu", "score": 6.0,
                                           "excess_s": 0.2}
    assert ev["suspects"][0]["entity"] == "rank:1"
    thin = client.get(f"/v1/incidents/{inc_id}", params={"max_points": 10}).json()["evidence"]
    assert thin["stride"] == 3 and [p["step"] for p in thin["steps"]] == list(range(30, 60, 3))
    ev = client.get(f"/v1/incidents/{JOB}/link/node:node-1/5").json()["evidence"]
    assert (ev["from_step"], ev["to_step"]) == (5, 20)  # through the resolving step


def test_a_nan_figure_is_null_not_a_500(store: MemoryStore, client: TestClient) -> None:
    inc = make_incident("nan", opened_step=1, last_step=1, onset_step=1)
    store.add_incident(msgspec.structs.replace(inc, slowdown=float("nan")))
    store.flush()
    assert client.get("/v1/incidents/nan/gpu/rank:1/1").json()["slowdown"] is None


@pytest.mark.parametrize(("url", "field"), [
    ("/v1/incidents?limit=0", "limit"),
    ("/v1/incidents?limit=1001", "limit"),
    ("/v1/incidents?offset=-1", "offset"),
    ("/v1/incidents?status=closed", "status"),
    ("/v1/incidents?kind=cpu", "kind"),
    ("/v1/incidents?since=yesterday", "since"),
    ("/v1/incidents?until=99999999999999999999", "until"),
    ("/v1/incidents?since=9999-12-31", "since"),
    ("/v1/incidents?since=20&until=10", "until"),
    ("/v1/incidents?cursor=%21%21", "cursor"),
    ("/v1/incidents?cursor=WzEsImEiXQ&offset=3", "offset"),
    ("/v1/incidents?job=", "job"),
    ("/v1/incidents/x?max_points=1", "max_points"),
])
def test_bad_parameters_are_422_problems_naming_the_field(
    client: TestClient, problem, url: str, field: str
) -> None:
    body = problem(client.get(url), 422)
    assert field in [e["field"] for e in body["errors"]] and body["detail"]


def test_unknown_incident_is_a_404_and_storage_trouble_a_503(
    store: MemoryStore, client: TestClient, problem
) -> None:
    body = problem(client.get("/v1/incidents/no-such-id"), 404)
    assert "no-such-id" in body["detail"] and body["instance"] == "/v1/incidents/no-such-id"
    store.fail = True
    assert problem(client.get("/v1/incidents"), 503)["detail"] == "storage unavailable; retry later"
