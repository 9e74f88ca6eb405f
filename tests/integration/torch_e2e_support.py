"""Helpers of the torch end-to-end tests: a real node daemon on the real broker, and ranks.

The ranks are `tests.integration.test_torch_gloo.train` (a tiny transformer under DDP plus
tagged tp/dp subgroups, with the Flare hook on); only the launcher is ours, because each end-
to-end test needs its own job id (the worker of every test reads the whole topic, so a shared
id would mix runs). The daemon is `run_agent` on a thread of the test process, publishing
through the real Kafka publisher; a tap in front of the publisher records, per rank, the end of
the newest step it shipped, which is how a test knows when a stopped rank stopped.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from producers.agent.server import run_agent
from producers.publisher import KafkaPublisher, Publisher
from schemas.kafka import KafkaConnection
from schemas.topics import STEPS
from tests.integration.test_torch_gloo import WORLD
from tests.integration.test_torch_gloo import launch_ranks as gloo_launch

__all__ = ["WORLD", "KafkaAgent", "StepTap", "launch_ranks", "run_to_end", "stop_all"]


@dataclass(frozen=True, slots=True)
class ShippedStep:
    step: int
    t_end_ns: int  # end of the rank's step on its node's clock (time.time_ns here)


class StepTap:
    """Forwards every message to the real publisher; remembers each rank's newest step.

    Not a fake: nothing is held back or altered, the broker gets exactly what the daemon
    publishes.
    """

    def __init__(self, inner: Publisher) -> None:
        self.inner = inner
        self.newest: dict[int, ShippedStep] = {}
        self._lock = threading.Lock()

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any]) -> None:
        if topic == STEPS and isinstance(value, bytes):
            m = orjson.loads(value)
            with self._lock:
                old = self.newest.get(m["rank"])
                if old is None or m["step"] > old.step:
                    self.newest[m["rank"]] = ShippedStep(m["step"], m["t_end_ns"])
        self.inner.publish(topic, key, value)

    def flush(self, timeout_s: float = 30.0) -> Any:
        return self.inner.flush(timeout_s)

    def newest_step(self, rank: int) -> ShippedStep | None:
        with self._lock:
            return self.newest.get(rank)


class KafkaAgent:
    """The node daemon (`run_agent`) on its own thread and loop, publishing to `conn`."""

    def __init__(self, conn: KafkaConnection, socket_path: Path, node: str,
                 interval_s: float) -> None:
        self.socket_path = socket_path
        self.node = node
        self.interval_s = interval_s
        self.publisher = KafkaPublisher(conn)
        self.tap = StepTap(self.publisher)
        self.error: BaseException | None = None
        self._stop = asyncio.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="flare-e2e-agent", daemon=True)

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(run_agent(
                self.tap, self.socket_path, self.node, interval_s=self.interval_s,
                stop=self._stop))
        except BaseException as exc:  # surfaced by __exit__, never swallowed
            self.error = exc
        finally:
            self._loop.close()

    def __enter__(self) -> KafkaAgent:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.socket_path.exists():
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise AssertionError(f"the node daemon did not listen on {self.socket_path}: "
                                     f"{self.error!r}")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        """Stop the daemon: it publishes what it holds and flushes the publisher."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        try:
            self.publisher.flush(10)  # raises PublishError if anything was not delivered
        finally:
            self.publisher.close()
        assert self.error is None, f"the node daemon failed: {self.error!r}"

    def delivered(self) -> bool:
        """After exit: everything the daemon published reached the broker."""
        s = self.publisher.stats
        return s.failed == 0 and s.delivered == s.queued > 0


def launch_ranks(sock: Path, job: str, steps: int, **kw: Any) -> list[subprocess.Popen[bytes]]:
    """Start the WORLD ranks of `tests.integration.test_torch_gloo.train` as job `job` (hook on)."""
    return gloo_launch(sock, steps, job=job, **kw)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Kill the ranks still running (a stopped rank and the peers it blocks)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(10)


def run_to_end(procs: list[subprocess.Popen[bytes]], timeout_s: float = 90.0) -> None:
    """Wait for every rank to finish its training; each must exit 0."""
    try:
        codes = [p.wait(timeout_s) for p in procs]
        assert codes == [0] * len(procs), f"rank exit codes {codes}"
    finally:
        stop_all(procs)
