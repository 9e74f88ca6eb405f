"""Child processes of the local stack: started so they cannot outlive us, stopped in order.

`flare up`, the integration tests and the pipeline benchmark all run Flare as child
processes (workers, a simulator; the broker is `broker.py`), and they want the same things:
- each child runs in its own session, so Ctrl-C in a terminal reaches only the parent, which
  then stops its children in reverse order (a worker flushes and commits before the broker
  it talks to goes away);
- on Linux the kernel SIGTERMs a child whose parent died (PR_SET_PDEATHSIG), so a crashed or
  killed parent never leaves an orphan holding a port or a chDB directory;
- stopping is SIGTERM, a bounded wait, then SIGKILL; a child's output goes to a log file
  whose tail explains a failure.

A worker child gets the parent's `KafkaConnection` through its `FLARE_KAFKA_*` environment,
the only way settings reach a process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from schemas.kafka import KafkaConnection

if TYPE_CHECKING:
    import httpx

CLI = "from flare.cli import main; main()"


def flare_argv(*args: str) -> list[str]:
    """A `flare` subcommand run by this very interpreter (no console script on the PATH
    needed, and the child imports what the parent imports)."""
    return [sys.executable, "-c", CLI, *args]


def die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGTERM this process when the process that started it dies."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except Exception:
        pass


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 5.0) -> int | None:
    """Terminate a child, then kill it if it does not exit in time. Idempotent; returns its
    exit code."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5.0)
    return process.returncode


@dataclass
class Child:
    """A running child process and the file its output goes to."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 15.0) -> int | None:
        return stop_process(self.process, timeout_s)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 25) -> str:
        return "\n".join(self.log().splitlines()[-n:])


def spawn(name: str, argv: list[str], log_path: Path, env: Mapping[str, str], *,
          cwd: Path | None = None) -> Child:
    """Start a child in its own session, dying with us, its output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,  # Ctrl-C goes to the parent only; it stops us in order
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )
    return Child(name, process, log_path)


def with_kafka(env: Mapping[str, str], conn: KafkaConnection) -> dict[str, str]:
    """`env` with the `FLARE_KAFKA_*` variables that make a child's settings rebuild `conn`
    (its secrets included: the child needs them as much as we do)."""
    out = dict(env)
    for name in KafkaConnection.model_fields:
        var = f"FLARE_KAFKA_{name.upper()}"
        value = getattr(conn, name)
        if value is None:
            out.pop(var, None)
        else:
            out[var] = value.get_secret_value() if isinstance(value, SecretStr) else str(value)
    return out


def chdb_url(directory: Path) -> str:
    """FLARE_CLICKHOUSE_URL of an embedded chDB in `directory` (an absolute path)."""
    return f"chdb:///{directory.as_posix().lstrip('/')}"


def wait_http(url: str, child: Child, timeout_s: float, interval_s: float = 0.25) -> bool:
    """True once `url` answers 200; False if the child exits first or time runs out."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not child.alive():
            return False
        try:
            if httpx.get(url, timeout=max(1.0, interval_s)).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    return False


@dataclass
class WorkerProcess:
    """A `flare worker` child serving its API: readiness, counters and reads over HTTP."""

    child: Child
    api: str  # base URL of its API
    chdb_dir: Path

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.child.process

    @property
    def log_path(self) -> Path:
        return self.child.log_path

    def alive(self) -> bool:
        return self.child.alive()

    def log(self) -> str:
        return self.child.log()

    def log_tail(self, n: int = 30) -> str:
        return self.child.log_tail(n)

    def get(self, path: str, timeout_s: float = 10.0, **params: Any) -> httpx.Response:
        """GET a path of its API."""
        import httpx

        return httpx.get(f"{self.api}{path}", params=params, timeout=timeout_s)

    def stats(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """Its counters (`/worker/stats`); a loaded worker may take long to answer."""
        return dict(self.get("/worker/stats", timeout_s).json())

    def ready(self) -> bool:
        """Whether `/readyz` says so; RuntimeError if the worker exited."""
        import httpx

        if not self.alive():
            raise RuntimeError(f"the worker exited ({self.process.returncode}):\n"
                               f"{self.log_tail()}")
        try:
            return bool(self.get("/readyz").status_code == 200)
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float = 120.0, interval_s: float = 0.25) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the worker is not ready after {timeout_s:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(interval_s)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (it flushes, commits and leaves its group), then SIGKILL after the wait."""
        return self.child.stop(timeout_s)


def start_worker(
    conn: KafkaConnection,
    workdir: Path,
    *,
    name: str = "worker",
    group: str,
    partitions: int,
    api_port: int,
    extra_env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> WorkerProcess:
    """Start a `flare worker` on its own chDB under `workdir` (log: `workdir/<name>.log`),
    serving its API on loopback at `api_port`. Returns at once: `wait_ready()` before use.

    It inherits our environment with its broker, storage, group, API port and an info-level
    log set; `extra_env` (settings a test or a benchmark tries) is applied last.
    """
    chdb_dir = workdir / f"{name}-chdb"
    child_env = {
        **with_kafka(os.environ, conn),
        "FLARE_CLICKHOUSE_URL": chdb_url(chdb_dir),
        "FLARE_GROUP_ID": group,
        "FLARE_PARTITIONS": str(partitions),
        "FLARE_API_HOST": "127.0.0.1",
        "FLARE_API_PORT": str(api_port),
        "FLARE_LOG_LEVEL": "info",
        **(extra_env or {}),
    }
    child = spawn(name, flare_argv("worker", "--quiet"), workdir / f"{name}.log", child_env,
                  cwd=cwd)
    return WorkerProcess(child, f"http://127.0.0.1:{api_port}", chdb_dir)


def start_shard_worker(
    conn: KafkaConnection,
    workdir: Path,
    *,
    name: str,
    group: str,
    shard_ranks: int,
    partitions: int,
    shard_partitions: int,
    extra_env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Child:
    """Start a `flare shard-worker` (stage 1 of split jobs, log: `workdir/<name>.log`) in
    consumer group `group`; it logs its counts when stopped."""
    child_env = {
        **with_kafka(os.environ, conn),
        "FLARE_SHARD_GROUP_ID": group,
        "FLARE_SHARD_RANKS": str(shard_ranks),
        "FLARE_PARTITIONS": str(partitions),
        "FLARE_SHARD_PARTITIONS": str(shard_partitions),
        **(extra_env or {}),
    }
    return spawn(name, flare_argv("shard-worker"), workdir / f"{name}.log", child_env, cwd=cwd)
