"""An app served for real on a free loopback port, for tests that talk to it as a client
does (the CLI over HTTP, a browser): uvicorn in a thread of the test process, so the app's
store can be an in-memory one and the test still goes through sockets and headers."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from flare.local.broker import free_port


@contextmanager
def served(app: Any, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve `app` until the block ends; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started, "uvicorn did not start"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
