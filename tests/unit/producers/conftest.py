"""Fixtures of the producer tests: a real node agent serving a Unix socket on a thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from producers.agent.core import AgentCore
from producers.agent.outbox import Outbox
from producers.agent.server import AgentDaemon
from producers.testing import MemoryPublisher


@dataclass
class RunningAgent:
    """An `AgentDaemon` of node `node-x` on its own loop and thread, publishing to memory."""

    sock: Path
    pub: MemoryPublisher = field(default_factory=MemoryPublisher)

    def __post_init__(self) -> None:
        self.daemon = AgentDaemon(AgentCore("node-x"), Outbox(self.pub, flush_every_s=0.05),
                                  self.sock, interval_s=0.05)
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(
            target=lambda: self._loop.run_until_complete(self.daemon.serve(self._stop)))
        self._thread.start()

    def stop(self) -> None:
        """Stop serving (idempotent): the daemon ends its jobs and removes its socket."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(10)


@pytest.fixture
def agent(sock_path: Path) -> Iterator[RunningAgent]:
    running = RunningAgent(sock_path)
    yield running
    running.stop()
