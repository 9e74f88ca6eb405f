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
