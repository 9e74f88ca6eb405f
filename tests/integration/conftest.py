"""Integration tier: the real broker (tansu, one per session) and real worker processes.

Every test uses its own job ids and consumer group, so tests share the session's broker
without seeing each other's results (a worker reads the whole topic, but only the test's
own jobs are asserted on).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from flare.local.broker import TansuBroker, free_port, start_tansu
from streams.kafka.topics import ensure_topics

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 4
CLI = "from flare.cli import main; main()"


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    log = tmp_path_factory.mktemp("tansu") / "tansu.log"
    with start_tansu(free_port(), log_path=log) as b:
        ensure_topics(b.bootstrap, PARTITIONS)
        yield b


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@dataclass
class WorkerProcess:
    """A `flare worker` child with its own consumer-group member, chDB directory and API."""

    process: subprocess.Popen[bytes]
    api: str
    chdb_dir: Path
    log_path: Path

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(f"{self.api}{path}", params=params, timeout=10.0)

    def stats(self) -> dict[str, Any]:
        return self.get("/worker/stats").json()

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
             interval_s: float = 0.25) -> None:
    """Poll a condition of a real process (a broker or worker we do not control)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _ready(w: WorkerProcess) -> bool:
    assert w.alive(), f"worker exited:\n{w.log()[-3000:]}"
    try:
        return w.get("/readyz").status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def start_workers(broker: TansuBroker, tmp_path: Path
                  ) -> Iterator[Callable[..., list[WorkerProcess]]]:
    """Start `flare worker` processes in parallel (one consumer group member each, its own
    chDB directory and API port) and return once all are ready."""
    started: list[WorkerProcess] = []

    def spawn(group: str, name: str, env_extra: dict[str, str]) -> WorkerProcess:
        port = free_port()
        chdb_dir = tmp_path / f"{name}-chdb"
        log_path = tmp_path / f"{name}.log"
        env = {
            **os.environ,
            "FLARE_KAFKA_BOOTSTRAP": broker.bootstrap,
            "FLARE_CLICKHOUSE_URL": f"chdb:///{chdb_dir.as_posix().lstrip('/')}",
            "FLARE_GROUP_ID": group,
            "FLARE_PARTITIONS": str(PARTITIONS),
            "FLARE_API_PORT": str(port),
            "FLARE_LOG_LEVEL": "info",
            **env_extra,
        }
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-c", CLI, "worker", "--quiet"],
                                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        w = WorkerProcess(proc, f"http://127.0.0.1:{port}", chdb_dir, log_path)
        started.append(w)
        return w

    def start(group: str, *names: str, **env_extra: str) -> list[WorkerProcess]:
        workers = [spawn(group, n, env_extra) for n in (names or ("w",))]
        wait_for(lambda: all(_ready(w) for w in workers), 90, "the workers to be ready")
        return workers

    yield start
    for w in started:  # signal all first: they stop in parallel
        if w.alive():
            w.process.send_signal(signal.SIGTERM)
    for w in started:
        w.stop()


@pytest.fixture
def start_worker(start_workers: Callable[..., list[WorkerProcess]]
                 ) -> Callable[..., WorkerProcess]:
    """Start one worker (see `start_workers`)."""

    def start(group: str, name: str = "w", **env_extra: str) -> WorkerProcess:
        return start_workers(group, name, **env_extra)[0]

    return start
