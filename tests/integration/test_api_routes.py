"""The HTTP API over the real chDB engine: resources, pagination, evidence, problem+json.

The same routes run on the in-memory store in tests/unit/api/routes/ (fast, no engine);
these hold them to what ClickHouse really answers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from storage.client import ClickHouse
from storage.reader import Queries
from storage.testing import SAMPLE_JOB as JOB
from storage.testing import step_ts
from tests.integration.conftest import sample_store

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouse]:
    with sample_store(f"chdb://{tmp_path_factory.mktemp('chdb')}?database=test_api") as client:
        yield client


@pytest.fixture(scope="module")
def client(db: ClickHouse) -> TestClient:
    return TestClient(create_app(Queries(db)))


def problem(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == PROBLEM
    body = resp.json()
    assert body["status"] == status and body["title"] and body["type"] == "about:blank"
    return body


# -- health and docs --------------------------------------------------------------------------


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    assert client.get("/readyz").json()["status"] == "ready"


def test_readyz_asks_the_embedding_process(db: ClickHouse) -> None:
    verdict = [(False, "no offset processed for 31 s")]
    client = TestClient(create_app(db, ready=lambda: verdict[0]))  # a ClickHouse is accepted
    assert problem(client.get("/readyz"), 503)["detail"] == "no offset processed for 31 s"
    verdict[0] = (True, "lag 3 steps")
    assert client.get("/readyz").json() == {"status": "ready", "detail": "lag 3 steps"}

    def broken() -> tuple[bool, str]:
        raise RuntimeError("watchdog crashed")

    body = problem(TestClient(create_app(db, ready=broken)).get("/readyz"), 503)
    assert "watchdog crashed" in body["detail"]


def test_openapi_documents_every_route_and_the_problem_shape(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert {"/healthz", "/readyz", "/v1/incidents", "/v1/incidents/{incident_id}", "/v1/jobs",
            "/v1/jobs/{job}", "/v1/jobs/{job}/steps", "/v1/jobs/{job}/ranks"} <= set(spec["paths"])
    assert "Problem" in spec["components"]["schemas"]
    assert PROBLEM in spec["paths"]["/v1/jobs/{job}"]["get"]["responses"]["404"]["content"]


# -- incidents --------------------------------------------------------------------------------


def test_incident_filters(client: TestClient) -> None:
    def ids(**params: object) -> list[str]:
        return [i["culprit"] for i in client.get("/v1/incidents", params=params).json()["items"]]

    assert len(ids()) == 9
    assert ids(job=JOB) == ["rank:1", "node:node-1"]  # newest opening first
    assert ids(job=JOB, status="open") == ["rank:1"]
    assert ids(kind="link") == ["node:node-1"]
    assert ids(job="many", since=step_ts(100)) == ["rank:6", "rank:5"]
    assert ids(job="many", until=str(step_ts(5))) == ["rank:4", "rank:3", "rank:2", "rank:1",
                                                      "rank:0"]
    iso = "2026-09-21T14:16:40Z"  # == step_ts(100)
    assert ids(job="many", since=iso) == ["rank:6", "rank:5"]
    assert ids(job="many", since="2026-09-21T16:16:40+02:00") == ["rank:6", "rank:5"]
    assert ids(job="nobody") == []


def test_incident_pages_by_cursor_and_by_offset(client: TestClient, incident_pages) -> None:
    everything, by_cursor, by_offset = incident_pages(client)
    assert by_cursor == [i["id"] for i in everything["items"]]
    assert by_offset == by_cursor

def test_one_incident_with_its_evidence(client: TestClient) -> None:
    inc_id = client.get("/v1/incidents", params={"job": JOB, "status": "open"}).json()[
        "items"][0]["id"]
    assert "/" in inc_id
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

    resolved = client.get("/v1/incidents", params={"kind": "link"}).json()["items"][0]["id"]
    ev = client.get(f"/v1/incidents/{resolved}").json()["evidence"]
    assert (ev["from_step"], ev["to_step"]) == (5, 20)  # through the resolving step


def test_unknown_incident_is_a_404_problem(client: TestClient) -> None:
    body = problem(client.get("/v1/incidents/no-such-id"), 404)
    assert "no-such-id" in body["detail"] and body["instance"] == "/v1/incidents/no-such-id"


# -- jobs, steps, ranks -----------------------------------------------------------------------


def test_jobs_with_their_health(client: TestClient) -> None:
    page = client.get("/v1/jobs").json()
    jobs = {j["job"]: j for j in page["items"]}
    assert list(jobs) == sorted(jobs) == ["many", "quiet", JOB]
    assert jobs[JOB]["health"] == "incident" and jobs[JOB]["open_incidents"] == 1
    assert jobs[JOB]["incidents"] == 2 and jobs[JOB]["last_step"] == 59
    assert jobs[JOB]["step_time_s"] == 1.2 and jobs[JOB]["delta"] == 1.2
    assert jobs["quiet"]["health"] == "irregular" and jobs["quiet"]["irregular"] == "spike"
    assert jobs["many"]["health"] == "ok" and jobs["many"]["incidents"] == 7
    assert client.get(f"/v1/jobs/{JOB}").json() == jobs[JOB]
    assert [j["job"] for j in client.get("/v1/jobs", params={"limit": 1, "offset": 1})
            .json()["items"]] == ["quiet"]
    problem(client.get("/v1/jobs/nope"), 404)


def test_step_series(client: TestClient) -> None:
    url = f"/v1/jobs/{JOB}/steps"
    newest = client.get(url, params={"limit": 5}).json()
    assert [s["step"] for s in newest["steps"]] == [55, 56, 57, 58, 59]
    assert newest["next_from_step"] is None
    page = client.get(url, params={"from_step": 40, "to_step": 49, "limit": 4}).json()
    assert [s["step"] for s in page["steps"]] == [40, 41, 42, 43] and page["next_from_step"] == 44
    last = client.get(url, params={"from_step": 48, "to_step": 49, "limit": 4}).json()
    assert [s["step"] for s in last["steps"]] == [48, 49] and last["next_from_step"] is None
    spikes = client.get(url, params={"irregular": ["spike", "fluctuation"]}).json()["steps"]
    assert [(s["step"], s["irregular"]) for s in spikes] == [(45, "spike")]
    problem(client.get("/v1/jobs/nope/steps"), 404)


def test_rank_scores(client: TestClient) -> None:
    url = f"/v1/jobs/{JOB}/ranks"
    recent = client.get(url, params={"last": 10}).json()
    assert (recent["from_step"], recent["to_step"]) == (50, 59)
    assert [r["rank"] for r in recent["ranks"]] == [0, 1, 2, 3]
    slow = recent["ranks"][1]
    assert slow["steps"] == 10 and slow["compute_ratio"] == 1.5 and slow["node"] == "node-0"
    assert slow["caused_wait_s"] == 0.9 and slow["caused_wait_total_s"] == 9.0
    top = client.get(url, params={"sort": "caused_wait", "limit": 1}).json()["ranks"]
    assert [r["rank"] for r in top] == [1]
    at = client.get(url, params={"step": 5}).json()
    assert (at["from_step"], at["to_step"]) == (5, 5)
    assert all(r["compute_ratio"] == 1.0 for r in at["ranks"])
    assert client.get(url).json()["from_step"] == 0  # default: newest 100 steps, from 0 here
    problem(client.get(url, params={"step": 999}), 404)
    problem(client.get("/v1/jobs/nope/ranks"), 404)


# -- bad input: always a 4xx problem naming the field ------------------------------------------


BAD = [
    ("/v1/incidents?limit=0", "limit"),
    ("/v1/incidents?limit=1001", "limit"),
    ("/v1/incidents?limit=ten", "limit"),
    ("/v1/incidents?offset=-1", "offset"),
    ("/v1/incidents?status=closed", "status"),
    ("/v1/incidents?kind=cpu", "kind"),
    ("/v1/incidents?since=yesterday", "since"),
    ("/v1/incidents?since=-5", "since"),
    ("/v1/incidents?until=99999999999999999999", "until"),
    ("/v1/incidents?since=0001-01-01T00:00:00%2B01:00", "since"),
    ("/v1/incidents?since=9999-12-31", "since"),
    ("/v1/incidents?since=20&until=10", "until"),
    ("/v1/incidents?cursor=%21%21", "cursor"),
    ("/v1/incidents?cursor=WzEsMiwzXQ", "cursor"),  # base64 of [1,2,3]
    ("/v1/incidents?cursor=WzEsImEiXQ&offset=3", "offset"),
    ("/v1/incidents?job=", "job"),
    (f"/v1/incidents?job={'j' * 300}", "job"),
    ("/v1/incidents/x?max_points=1", "max_points"),
    ("/v1/jobs?limit=100000", "limit"),
    (f"/v1/jobs/{JOB}/steps?from_step=-1", "from_step"),
    (f"/v1/jobs/{JOB}/steps?to_step=9223372036854775808", "to_step"),
    (f"/v1/jobs/{JOB}/steps?from_step=9&to_step=3", "to_step"),
    (f"/v1/jobs/{JOB}/steps?limit=0", "limit"),
    (f"/v1/jobs/{JOB}/ranks?last=0", "last"),
    (f"/v1/jobs/{JOB}/ranks?last=5&step=3", "step"),
    (f"/v1/jobs/{JOB}/ranks?sort=speed", "sort"),
    (f"/v1/jobs/{JOB}/ranks?step=1.5", "step"),
]


@pytest.mark.parametrize(("url", "field"), BAD)
def test_bad_parameters_are_422_problems_naming_the_field(
    client: TestClient, url: str, field: str
) -> None:
    body = problem(client.get(url), 422)
    assert field in [e["field"] for e in body["errors"]], body
    assert body["detail"]


def test_wrong_method_and_unknown_route_are_problems(client: TestClient) -> None:
    assert problem(client.post("/v1/jobs"), 405)
    problem(client.get("/v2/jobs"), 404)


def test_storage_trouble_is_a_503_problem_not_a_500(db: ClickHouse) -> None:
    missing = ClickHouse(db._client, "no_such_database", db.location)  # tables not there
    client = TestClient(create_app(Queries(missing)))
    assert problem(client.get("/v1/jobs"), 503)["detail"] == "storage unavailable; retry later"
    problem(client.get("/v1/incidents/x"), 503)
