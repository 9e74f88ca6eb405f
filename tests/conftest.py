"""Shared pytest fixtures."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def sock_path() -> Iterator[Path]:
    """A path for a Unix socket: short, since such paths are limited to ~100 bytes."""
    d = Path(tempfile.mkdtemp(prefix="flare-", dir="/tmp"))
    yield d / "a.sock"
    shutil.rmtree(d, ignore_errors=True)


def _eventually(cond: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def eventually() -> Callable[..., None]:
    """`eventually(cond, timeout=10.0)`: poll `cond` until it holds (for real threads and
    sockets, where no fake clock reaches)."""
    return _eventually


def _incident_pages(client: Any) -> tuple[dict[str, Any], list[str], list[str]]:
    """Walk `/v1/incidents` of an API test client: (one big page, ids page by page with the
    cursor, ids page by page with offsets)."""
    everything = client.get("/v1/incidents", params={"limit": 1000}).json()
    assert everything["next_cursor"] is None
    by_cursor: list[str] = []
    params: dict[str, object] = {"limit": 2}
    while True:
        page = client.get("/v1/incidents", params=params).json()
        by_cursor += [i["id"] for i in page["items"]]
        if page["next_cursor"] is None:
            break
        params["cursor"] = page["next_cursor"]
    by_offset = [i["id"] for off in range(0, 10, 4)
                 for i in client.get("/v1/incidents", params={"limit": 4, "offset": off})
                 .json()["items"]]  # fmt: skip
    return everything, by_cursor, by_offset


@pytest.fixture
def incident_pages() -> Callable[[Any], tuple[dict[str, Any], list[str], list[str]]]:
    """`incident_pages(client)`: the incident list read whole, by cursor and by offset (the
    API's unit tests over the in-memory store and its integration tests over chDB)."""
    return _incident_pages
