"""api.auth: with FLARE_API_KEY set, every /v1 route (whatever routes exist when the test runs)
refuses a request without the key as a 401 problem; probes, metrics and the OpenAPI stay open;
without a key nothing is guarded."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from api import auth
from api.app import create_app
from storage.testing import MemoryStore, load_sample

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
KEY = "k3y-Zx9-very-secret"
OPEN_PATHS = ("/livez", "/healthz", "/readyz", "/metrics", "/openapi.json", "/docs")


def guarded_client(key: str | SecretStr | None = KEY) -> TestClient:
    store = MemoryStore()
    load_sample(store)
    return TestClient(create_app(store, api_key=key))


def v1_requests(client: TestClient) -> list[tuple[str, str]]:
    """(method, URL) of every route under /v1 the app documents, path parameters filled in,
    so a route added later is checked without touching this test."""
    paths = client.get("/openapi.json").json()["paths"]
    return [(method.upper(), re.sub(r"\{[^}]+\}", "x", path))
            for path, methods in paths.items() if path.startswith("/v1")
            for method in methods]


def test_every_v1_route_refuses_a_request_without_the_key(problem) -> None:
    client = guarded_client()
    routes = v1_requests(client)
    assert len(routes) >= 8  # incidents, jobs and their children, dead letters
    for method, url in routes:
        r = client.request(method, url)
        body = problem(r, 401)
        assert r.headers["www-authenticate"] == 'Bearer realm="flare"', url
        assert "X-API-Key" in body["detail"] and body["instance"] == url


def test_a_wrong_key_is_refused_and_the_key_never_appears_in_an_answer(problem) -> None:
    client = guarded_client()
    for headers in ({"X-API-Key": "k3y-Zx9-very-secreT"}, {"X-API-Key": "k3y"},
                    {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {KEY}"},
                    {"X-API-Key": ""}, {"X-API-Key": "ключ".encode()}):
        r = client.get("/v1/jobs", headers=headers)
        assert problem(r, 401)["detail"] in ("wrong API key", auth.MISSING), headers
        assert KEY not in r.text
    assert KEY not in repr(client.app.state.api_key)  # type: ignore[attr-defined]


def test_the_right_key_in_either_header_is_let_in() -> None:
    client = guarded_client()
    for headers in ({"X-API-Key": KEY}, {"Authorization": f"Bearer {KEY}"},
                    {"authorization": f"bearer {KEY}"}):
        r = client.get("/v1/jobs", headers=headers)
        assert r.status_code == 200 and r.json()["items"], headers
    # X-API-Key wins when both are sent
    r = client.get("/v1/jobs", headers={"X-API-Key": "wrong", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 401
    # a guarded route still answers its own errors once the key is right
    assert client.get("/v1/jobs/nope", headers={"X-API-Key": KEY}).status_code == 404
    assert client.get("/v1/jobs?limit=-1", headers={"X-API-Key": KEY}).status_code == 422


def test_probes_metrics_and_the_schema_stay_open_with_a_key() -> None:
    client = guarded_client()
    for path in OPEN_PATHS:
        assert client.get(path).status_code == 200, path
    assert client.head("/readyz").status_code == 200


@pytest.mark.parametrize("key", [None, "", SecretStr("")])
def test_without_a_key_nothing_is_guarded(key: Any) -> None:
    client = guarded_client(key)
    for method, url in v1_requests(client):
        assert client.request(method, url).status_code != 401, url
    assert client.get("/v1/jobs").status_code == 200


def test_a_secret_str_key_works_like_a_plain_one() -> None:
    client = guarded_client(SecretStr(KEY))
    assert client.get("/v1/jobs").status_code == 401
    assert client.get("/v1/jobs", headers={"X-API-Key": KEY}).status_code == 200


def test_keys_are_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bytes, bytes]] = []

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return a == b

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    client = guarded_client()
    assert client.get("/v1/jobs", headers={"X-API-Key": "guess"}).status_code == 401
    assert client.get("/v1/jobs", headers={"X-API-Key": KEY}).status_code == 200
    assert seen == [(b"guess", KEY.encode()), (KEY.encode(), KEY.encode())]



def test_the_openapi_documents_both_ways_to_send_the_key_on_v1_only() -> None:
    spec = guarded_client().get("/openapi.json").json()
    schemes = spec["components"]["securitySchemes"]
    assert schemes["ApiKey"] == {"type": "apiKey", "in": "header", "name": "X-API-Key",
                                 "description": schemes["ApiKey"]["description"]}
    assert schemes["Bearer"]["scheme"] == "bearer"
    assert {"ApiKey": []} in spec["paths"]["/v1/jobs"]["get"]["security"]
    assert "security" not in spec["paths"]["/healthz"]["get"]


def test_the_incident_page_takes_the_same_key(problem) -> None:
    client = guarded_client()
    problem(client.get("/incidents/x"), 401)
    assert client.get("/incidents/x", headers={"X-API-Key": KEY}).status_code == 404


def test_a_non_ascii_key_works_when_sent_as_utf8() -> None:
    key = "ключ-7"
    client = guarded_client(key)
    assert client.get("/v1/jobs", headers={"X-API-Key": key.encode()}).status_code == 200
    assert client.get("/v1/jobs", headers={"X-API-Key": key.encode("utf-16")}).status_code == 401
