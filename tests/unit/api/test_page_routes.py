"""GET /incidents/{id} and /docs as the app serves them (over the in-memory sample store)."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.page import docs
from storage.client import StorageError
from storage.testing import SAMPLE_JOB, MemoryStore

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
GPU = f"{SAMPLE_JOB}/gpu/rank:1/30"


def test_the_page_is_html_that_may_load_nothing(client: TestClient) -> None:
    r = client.get(f"/incidents/{GPU}")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    # the browser may fetch nothing for it: everything it shows is inline
    assert r.headers["content-security-policy"].startswith("default-src 'none';")
    assert "<svg" in r.text and "rank:1 computes 50% slower" in r.text


def test_the_metric_parameter_picks_the_heatmaps_figure(client: TestClient, problem) -> None:
    assert "Per-rank gap_s" in client.get(f"/incidents/{GPU}", params={"metric": "gap_s"}).text
    body = problem(client.get(f"/incidents/{GPU}", params={"metric": "bogus"}), 422)
    assert body["errors"][0]["field"] == "metric" and "compute_ratio" in body["detail"]


def test_an_unknown_incident_is_a_404_page(client: TestClient) -> None:
    r = client.get("/incidents/no/such<id>")
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "no incident with id &#x27;no/such&lt;id&gt;&#x27;" in r.text


def test_a_storage_failure_is_a_503_problem(store: MemoryStore, problem,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def down(*_args: object, **_kwargs: object) -> None:
        raise StorageError("ClickHouse went away")

    monkeypatch.setattr(store, "rank_scores", down)
    client = TestClient(create_app(store), raise_server_exceptions=False)
    problem(client.get(f"/incidents/{GPU}"), 503)


def test_the_page_is_not_part_of_the_api_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert not [p for p in paths if p.startswith(("/incidents", "/docs", "/static"))]


def test_the_page_needs_the_key_when_the_api_does(store: MemoryStore) -> None:
    client = TestClient(create_app(store, api_key="k3y"))
    assert client.get(f"/incidents/{GPU}").status_code == 401
    assert client.get(f"/incidents/{GPU}", headers={"X-API-Key": "k3y"}).status_code == 200
    assert client.get("/docs").status_code == 200  # the shape of the API is not a secret


def test_docs_load_swagger_ui_from_the_app_itself(client: TestClient) -> None:
    r = client.get("/docs")
    assert r.status_code == 200 and "SwaggerUIBundle" in r.text
    assert "http://" not in r.text and "https://" not in r.text
    assets = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert sorted(assets) == sorted(f"{docs.STATIC_URL}/{name}" for name in
                                    ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"))
    for url in assets:
        asset = client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 1000, url
    assert "url: '/openapi.json'" in r.text and '"validatorUrl": null' in r.text
