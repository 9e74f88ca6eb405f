"""Integration tier: the real broker (tansu, one per session), real worker processes, and
the real ClickHouse engine (chDB, one migrated database per test module).

Every test uses its own job ids and consumer group, so tests share the session's broker
without seeing each other's results (a worker reads the whole topic, but only the test's
own jobs are asserted on). Workers are started and stopped by the local stack's own
supervision (`flare/local/processes.py`), as `flare up` and the benchmark do.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from flare.local import processes
from flare.local.broker import TansuBroker, free_port, start_tansu
from flare.local.processes import WorkerProcess
from storage.client import ClickHouse, connect
from storage.migrations import apply_schema
from storage.tables import TABLES
from storage.testing import load_sample
from storage.writer import Sink
from streams.kafka.topics import ensure_topics

ROOT = Path(__file__).resolve().parents[2]
PARTITIONS = 4

__all__ = ["PARTITIONS", "ROOT", "WorkerProcess", "sample_store", "unique", "wait_for"]


@pytest.fixture(scope="module")
def db(request: pytest.FixtureRequest,
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClickHouse]:
    """A migrated chDB database for the module, named by the module's `DB`."""
    client = connect(f"chdb://{tmp_path_factory.mktemp('chdb')}?database={request.module.DB}")
    apply_schema(client)
    yield client
    client.close()


@pytest.fixture
def clean(db: ClickHouse) -> ClickHouse:
    """The module's database with every table emptied."""
    for table in TABLES:
        db.command(f"TRUNCATE TABLE {db.table(table.name)}")
    return db


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TansuBroker]:
    log = tmp_path_factory.mktemp("tansu") / "tansu.log"
    with start_tansu(free_port(), log_path=log) as b:
        ensure_topics(b.connection, PARTITIONS)
        yield b


@contextmanager
def sample_store(url: str) -> Iterator[ClickHouse]:
    """A migrated ClickHouse at `url` holding `storage.testing`'s sample job and incidents."""
    client = connect(url)
    try:
        apply_schema(client)
        load_sample(Sink(client))
        yield client
    finally:
        client.close()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str,
             interval_s: float = 0.25) -> None:
    """Poll a condition of a real process (a broker or worker we do not control)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture
def start_workers(broker: TansuBroker, tmp_path: Path
                  ) -> Iterator[Callable[..., list[WorkerProcess]]]:
    """Start `flare worker` processes in parallel (one consumer group member each, its own
    chDB directory and API port) and return once all are ready."""
    started: list[WorkerProcess] = []

    def start(group: str, *names: str, **env_extra: str) -> list[WorkerProcess]:
        workers = [
            processes.start_worker(broker.connection, tmp_path, name=n, group=group,
                                   partitions=PARTITIONS, api_port=free_port(),
                                   extra_env=env_extra, cwd=ROOT)
            for n in (names or ("w",))
        ]
        started.extend(workers)
        wait_for(lambda: all(w.ready() for w in workers), 90, "the workers to be ready")
        return workers

    yield start
    for w in started:  # signal all first: they stop in parallel
        if w.alive():
            w.process.terminate()
    for w in started:
        w.stop()


@pytest.fixture
def start_worker(start_workers: Callable[..., list[WorkerProcess]]
                 ) -> Callable[..., WorkerProcess]:
    """Start one worker (see `start_workers`)."""

    def start(group: str, name: str = "w", **env_extra: str) -> WorkerProcess:
        return start_workers(group, name, **env_extra)[0]

    return start
