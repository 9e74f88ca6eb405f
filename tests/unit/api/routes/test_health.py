"""api.routes.health: liveness always, readiness from the embedding process and the store."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from storage.testing import MemoryStore

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_health_and_readiness(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "detail": None}
    assert client.get("/readyz").json() == {"status": "ready", "detail": None}


def test_readyz_asks_the_embedding_process(store: MemoryStore, problem) -> None:
    verdict = [(False, "no offset processed for 31 s")]
    client = TestClient(create_app(store, ready=lambda: verdict[0]))
    assert problem(client.get("/readyz"), 503)["detail"] == "no offset processed for 31 s"
    verdict[0] = (True, "lag 3 steps")
    assert client.get("/readyz").json() == {"status": "ready", "detail": "lag 3 steps"}

    def broken() -> tuple[bool, str]:
        raise RuntimeError("watchdog crashed")

    body = problem(TestClient(create_app(store, ready=broken)).get("/readyz"), 503)
    assert "watchdog crashed" in body["detail"]


def test_readyz_fails_when_the_store_does_not_answer(store: MemoryStore, client: TestClient,
                                                      problem) -> None:
    store.fail = True
    assert problem(client.get("/readyz"), 503)["detail"] == "ClickHouse does not answer"
    assert client.get("/healthz").status_code == 200  # alive all the same
