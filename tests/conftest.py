"""Shared pytest fixtures."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

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
