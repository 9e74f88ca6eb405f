"""api.app and api.problems: the documented routes, and every error as problem+json (a bug is
a 500 that tells nothing internal)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from storage.testing import MemoryStore

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_openapi_documents_every_route_and_the_problem_shape(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert {"/healthz", "/readyz", "/v1/incidents", "/v1/incidents/{incident_id}", "/v1/jobs",
            "/v1/jobs/{job}", "/v1/jobs/{job}/steps", "/v1/jobs/{job}/ranks"} <= set(spec["paths"])
    assert "Problem" in spec["components"]["schemas"]
    media = "application/problem+json"
    assert media in spec["paths"]["/v1/jobs/{job}"]["get"]["responses"]["404"]["content"]
    incident = spec["components"]["schemas"]["Incident"]
    assert incident["description"] == "Incident v1 (DESIGN §3), the newest state stored."


def test_wrong_method_and_unknown_route_are_problems(client: TestClient, problem) -> None:
    problem(client.post("/v1/jobs"), 405)
    problem(client.get("/v2/jobs"), 404)


def test_a_bug_is_a_500_problem_without_internals(store: MemoryStore, problem,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**_kwargs: object) -> list[dict]:
        raise KeyError("secret internal detail")

    monkeypatch.setattr(store, "jobs", broken)
    client = TestClient(create_app(store), raise_server_exceptions=False)
    body = problem(client.get("/v1/jobs"), 500)
    assert body["detail"] == "internal error; this is a bug in Flare"
    assert "secret" not in str(body)


def test_metrics_count_requests_by_route_template_and_carry_the_embedders_page() -> None:
    import re

    from tests.unit.streams.test_metrics import promtool_check

    extra = "# HELP flare_worker_jobs Jobs.\n# TYPE flare_worker_jobs gauge\nflare_worker_jobs 3\n"
    client = TestClient(create_app(MemoryStore(), more_metrics=lambda: extra))
    for incident_id in ("a", "b", "c"):
        client.get(f"/v1/incidents/{incident_id}")  # unknown: 404 problems
    client.get("/v1/incidents")
    client.get("/v2/nothing")
    text = client.get("/metrics").text
    assert client.get("/metrics").headers["content-type"].startswith("text/plain; version=0.0.4")
    sample = re.compile(
        r'^flare_api_requests_total\{code="(\d+)",method="GET",route="([^"]+)"\} (\d+)$', re.M)
    counts = {(route, code): int(n) for code, route, n in sample.findall(text)}
    # one series per route template, whatever the ids in the URLs
    assert counts[("/v1/incidents/{incident_id}", "404")] == 3
    assert counts[("/v1/incidents", "200")] == 1
    assert counts[("unmatched", "404")] == 1
    assert 'flare_api_request_seconds_count{route="/v1/incidents/{incident_id}"} 3' in text
    assert text.endswith(extra)
    promtool_check(text)
