"""The API over the in-memory store (storage.testing.MemoryStore) holding the sample data set:
route tests run in milliseconds, with no engine. tests/integration/test_storage_testing.py
holds the store to what ClickHouse answers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient
from httpx import Response

from api.app import create_app
from storage.testing import MemoryStore, load_sample


@pytest.fixture
def store() -> MemoryStore:
    store = MemoryStore()
    load_sample(store)
    return store


@pytest.fixture
def client(store: MemoryStore) -> TestClient:
    return TestClient(create_app(store))


def _problem(resp: Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = resp.json()
    assert body["status"] == status and body["title"] and body["type"] == "about:blank"
    return body


@pytest.fixture
def problem() -> Callable[[Response, int], dict[str, Any]]:
    """Checks an answer is an RFC 9457 problem with this status; returns its body."""
    return _problem
