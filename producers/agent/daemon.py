"""The node daemon (`flare agent`): local ranks' steps and in-flight tables in, Kafka out.

One per node. Ranks connect over a Unix socket (protocol in `torch_wire`); their step
messages are forwarded untouched to `flare.steps.v1` (the rank already built wire v1), and
every `interval_s` the daemon samples each connected rank's latest in-flight table (what is in
flight and since when) and may publish it as a heartbeat to `flare.heartbeats.v1`. A rank whose
process dies closes its socket and stops being heartbeated (its silence is the evidence); a
rank stuck in Python or C code keeps its last table, so peers blocked in a collective and a
rank stuck outside it are both visible. Rank 0's hello and goodbye become the job's `start`
and `end` events.

Heartbeat cadence (the simulator follows the same policy). Every Kafka message costs the
worker tens of µs of consumer-framework overhead, and one heartbeat per rank per second made
~90% of an 8,192-GPU job's messages; step messages already prove a rank alive while it
progresses, and heartbeats matter only when an op sits in flight for long (hang detection).
So sampling stays every `interval_s`, but a rank's sample is PUBLISHED only if
  (a) it is the rank's first sample since it connected, or
  (b) its set of *long* in-flight ops -- in flight for >= `long_op_s` at the sample time,
      identified by (group, seq) -- differs from that set at its previous sample (an op that
      becomes long is reported within one interval, and so is its end), or
  (c) `keepalive_s` has passed since its last published heartbeat (keepalive; due half an
      interval early so timer jitter does not push it one whole sample late).
A published heartbeat carries the rank's FULL in-flight list (wire v1 unchanged). Healthy
training costs ~1/keepalive_s heartbeats per rank plus a few per long op. `long_op_s` is 3 s:
pipeline bubbles keep ops in flight for 1-3 s every step, and at 1 s they added 70% to the
keepalives (3.7 instead of 2.2 heartbeats per rank-step of 10.5 s, TP8·PP8). `keepalive_s +
long_op_s` must stay below the smallest hang timeout (10 s): a waiting rank then never looks
silent, and a short op seen in a stale heartbeat never looks stuck.

The parts: `AgentCore` is pure state (frames in, messages out, time from a `now` callable),
`Outbox` is the bounded queue and the thread that talks to the publisher (batching and
reconnection are the Kafka client's job), `AgentDaemon` is the asyncio socket server.
`MemoryPublisher` is the in-memory publisher for tests and dry runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec
import orjson

from producers.torch_hook.wire import (
    BYE,
    HEADER,
    HELLO,
    INFLIGHT,
    STEPS,
    FrameError,
    decode_header,
)
from schemas.wire import InflightOp

STEPS_TOPIC = "flare.steps.v1"
HEARTBEATS_TOPIC = "flare.heartbeats.v1"
JOBS_TOPIC = "flare.jobs.v1"
MAX_INFLIGHT = 256
MIN_HANG_TIMEOUT_S = 10.0  # DetectorSettings.hang_timeout_s default, the smallest in use
log = logging.getLogger("flare.agent")

Message = tuple[str, bytes, bytes]  # topic, key, value


class Publisher(Protocol):
    """What the daemon needs of a Kafka publisher (`producers.publisher.Publisher`)."""

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any]) -> None: ...

    def flush(self, timeout_s: float = ...) -> Any: ...


class MemoryPublisher:
    """A publisher that keeps messages in a list (tests, `flare agent --dry-run`)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.flushes = 0
        self._lock = threading.Lock()

    def publish(self, topic: str, key: str | bytes, value: bytes | Mapping[str, Any]) -> None:
        k = key if isinstance(key, bytes) else key.encode()
        v = value if isinstance(value, bytes) else orjson.dumps(value)
        with self._lock:
            self.messages.append((topic, k, v))

    def flush(self, timeout_s: float = 30.0) -> None:
        self.flushes += 1

    def on(self, topic: str) -> list[dict[str, Any]]:
        """Decoded values published on `topic`, in order."""
        with self._lock:
            return [orjson.loads(v) for t, _k, v in self.messages if t == topic]


class Hello(msgspec.Struct):
    job: str
    rank: int
    node: str = ""
    local_rank: int = 0
    world_size: int = 0
    pid: int = 0


class Table(msgspec.Struct):
    step: int
    inflight: list[InflightOp] = []


_hello = msgspec.json.Decoder(Hello)
_table = msgspec.json.Decoder(Table)


@dataclass(frozen=True, slots=True)
class Cadence:
    """When heartbeats are sampled and published (the policy is in the module docstring)."""

    interval_s: float = 1.0
    keepalive_s: float = 5.0
    long_op_s: float = 3.0

    def __post_init__(self) -> None:
        for name in ("interval_s", "keepalive_s", "long_op_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s!r}")
        if self.keepalive_s < self.interval_s:
            raise ValueError(
                f"keepalive_s ({self.keepalive_s:g}) must be >= interval_s ({self.interval_s:g}):"
                " heartbeats are only sampled every interval"
            )
        if self.keepalive_s + self.long_op_s >= MIN_HANG_TIMEOUT_S:
            raise ValueError(
                f"keepalive_s + long_op_s ({self.keepalive_s + self.long_op_s:g} s) must stay "
                f"below the {MIN_HANG_TIMEOUT_S:g} s hang timeout, or a rank waiting in a "
                "collective may look silent, and a short op in a stale heartbeat stuck"
            )


@dataclass(slots=True)
class RankState:
    hello: Hello
    node: str
    step: int = 0
    inflight: list[InflightOp] = field(default_factory=list)
    last_table_ns: int = 0
    long_ops: frozenset[tuple[str, int]] | None = None  # at the previous sample; None: none yet
    published_ns: int = 0  # time of the last published heartbeat


@dataclass(slots=True)
class CoreStats:
    steps: int = 0
    tables: int = 0
    samples: int = 0  # heartbeat samples taken (published or not)
    heartbeats: int = 0  # heartbeats published
    bad_frames: int = 0


class AgentCore:
    """The daemon's state, free of I/O: feed frames, collect messages to publish."""

    def __init__(self, node: str, now: Callable[[], int] = time.time_ns, *,
                 cadence: Cadence | None = None) -> None:
        self.node = node
        self.now = now
        self.cadence = cadence or Cadence()
        self.ranks: dict[int, RankState] = {}  # by connection id
        self.stats = CoreStats()
        self._started: set[str] = set()
        c = self.cadence
        self._long_ns = int(c.long_op_s * 1e9)
        self._keepalive_ns = int((c.keepalive_s - c.interval_s / 2) * 1e9)

    def on_frame(self, conn: int, ftype: int, payload: bytes) -> list[Message]:
        """One frame from connection `conn`; FrameError when it breaks the protocol."""
        if ftype == HELLO:
            return self._on_hello(conn, payload)
        st = self.ranks.get(conn)
        if st is None:
            raise FrameError("the first frame of a connection must be a hello")
        if ftype == STEPS:
            self.stats.steps += 1
            return [(STEPS_TOPIC, st.hello.job.encode(), payload)]
        if ftype == INFLIGHT:
            try:
                table = _table.decode(payload)
            except msgspec.DecodeError as exc:
                raise FrameError(f"bad in-flight table: {exc}") from None
            st.step = max(table.step, 0)
            st.inflight = table.inflight[:MAX_INFLIGHT]
            st.last_table_ns = self.now()
            self.stats.tables += 1
            return []
        if ftype == BYE:
            out = []
            if st.hello.rank == 0:
                out.append(self._job_event(st.hello.job, "end"))
            self.ranks.pop(conn, None)
            return out
        raise FrameError(f"unknown frame type {ftype}")

    def on_disconnect(self, conn: int) -> None:
        """The rank's process closed its socket (or died): stop heartbeating it."""
        self.ranks.pop(conn, None)

    def heartbeats(self) -> list[Message]:
        """Sample every connected rank now; the heartbeats the cadence says to publish.

        Called every `cadence.interval_s`. Per rank, a sample is published when it is the
        first since the rank connected, when its set of long in-flight ops changed since the
        previous sample, or when the keepalive is due (module docstring).
        """
        now = self.now()
        out = []
        for st in self.ranks.values():
            long_ops = frozenset(
                (op.group, op.seq) for op in st.inflight if now - op.start_ns >= self._long_ns
            )
            due = (
                st.long_ops is None
                or long_ops != st.long_ops
                or now - st.published_ns >= self._keepalive_ns
            )
            st.long_ops = long_ops
            if not due:
                continue
            st.published_ns = now
            msg = {
                "v": 1, "job": st.hello.job, "rank": st.hello.rank, "node": st.node,
                "ts_ns": now, "step": st.step, "inflight": st.inflight,
            }
            out.append((HEARTBEATS_TOPIC, st.hello.job.encode(), msgspec.json.encode(msg)))
        self.stats.samples += len(self.ranks)
        self.stats.heartbeats += len(out)
        return out

    def _on_hello(self, conn: int, payload: bytes) -> list[Message]:
        try:
            hello = _hello.decode(payload)
        except msgspec.DecodeError as exc:
            raise FrameError(f"bad hello: {exc}") from None
        if not hello.job or hello.rank < 0:
            raise FrameError("hello needs a job and a rank >= 0")
        self.ranks[conn] = RankState(hello, hello.node or self.node)
        out: list[Message] = []
        if hello.rank == 0 and hello.world_size > 0 and hello.job not in self._started:
            if len(self._started) > 10_000:
                self._started.clear()
            self._started.add(hello.job)
            out.append(self._job_event(hello.job, "start", hello.world_size))
        return out

    def _job_event(self, job: str, event: str, world_size: int = 0) -> Message:
        msg: dict[str, Any] = {"v": 1, "job": job, "event": event, "ts_ns": self.now()}
        if world_size:
            msg["world_size"] = world_size
        return (JOBS_TOPIC, job.encode(), orjson.dumps(msg))


@dataclass(slots=True)
class OutboxStats:
    published: int = 0
    dropped: int = 0
    publish_errors: int = 0
    flush_errors: int = 0


class Outbox:
    """A bounded queue drained by one thread into the publisher (memory stays bounded).

    The publisher may block (its own queue full, broker away); the event loop never does:
    when this queue is full new messages are dropped and counted.
    """

    def __init__(self, publisher: Publisher, *, max_messages: int = 100_000,
                 flush_every_s: float = 1.0, flush_timeout_s: float = 10.0) -> None:
        self.publisher = publisher
        self.flush_every_s = flush_every_s
        self.flush_timeout_s = flush_timeout_s
        self.stats = OutboxStats()
        self._q: queue.Queue[Message | None] = queue.Queue(max_messages)
        self._thread = threading.Thread(target=self._run, name="flare-agent-outbox", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, messages: list[Message]) -> None:
        for m in messages:
            try:
                self._q.put_nowait(m)
            except queue.Full:
                self.stats.dropped += 1

    def close(self, timeout_s: float = 10.0) -> None:
        """Publish what is queued, flush, stop."""
        with contextlib.suppress(queue.Full):
            self._q.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)

    def _flush(self) -> None:
        try:
            self.publisher.flush(self.flush_timeout_s)
        except Exception as exc:
            self.stats.flush_errors += 1
            log.warning("flush failed: %s", exc)

    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_every_s
        while True:
            try:
                item = self._q.get(timeout=max(0.0, next_flush - time.monotonic()))
            except queue.Empty:
                item = ()  # type: ignore[assignment]
            if item is None:
                self._flush()
                return
            if item:
                topic, key, value = item
                try:
                    self.publisher.publish(topic, key, value)
                    self.stats.published += 1
                except Exception as exc:
                    self.stats.publish_errors += 1
                    log.warning("publish failed: %s", exc)
            if time.monotonic() >= next_flush:
                self._flush()
                next_flush = time.monotonic() + self.flush_every_s


class AgentDaemon:
    """The Unix socket server of one node; `serve()` runs until `stop` is set."""

    def __init__(self, core: AgentCore, outbox: Outbox, socket_path: Path | str, *,
                 interval_s: float | None = None) -> None:
        self.core = core
        self.outbox = outbox
        self.socket_path = Path(socket_path)
        # the sampling period; the core's cadence one unless told otherwise
        self.interval_s = core.cadence.interval_s if interval_s is None else interval_s
        self.ready = asyncio.Event()
        self._next_conn = 0

    async def serve(self, stop: asyncio.Event) -> None:
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = await asyncio.start_unix_server(self._client, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o666)  # ranks may run as other users of the node
        self.outbox.start()
        beat = asyncio.create_task(self._beat(stop))
        self.ready.set()
        try:
            await stop.wait()
        finally:
            beat.cancel()
            server.close()
            await server.wait_closed()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            await asyncio.to_thread(self.outbox.close)

    async def _beat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.interval_s)
            self.outbox.put(self.core.heartbeats())

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self._next_conn
        self._next_conn += 1
        try:
            while True:
                header = await reader.readexactly(HEADER.size)
                length, ftype = decode_header(header)
                payload = await reader.readexactly(length)
                self.outbox.put(self.core.on_frame(conn, ftype, payload))
                if ftype == BYE:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except FrameError as exc:
            self.core.stats.bad_frames += 1
            log.warning("closing connection %d: %s", conn, exc)
        finally:
            self.core.on_disconnect(conn)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def run_agent(publisher: Publisher, socket_path: Path | str, node: str, *,
                    interval_s: float = 1.0, keepalive_s: float = 5.0, long_op_s: float = 3.0,
                    stop: asyncio.Event | None = None,
                    max_messages: int = 100_000) -> AgentDaemon:
    """Build and run a daemon until `stop` (a new event when None: runs until cancelled).

    ValueError when the cadence is invalid (see `Cadence`).
    """
    cadence = Cadence(interval_s=interval_s, keepalive_s=keepalive_s, long_op_s=long_op_s)
    daemon = AgentDaemon(AgentCore(node, cadence=cadence),
                         Outbox(publisher, max_messages=max_messages), socket_path)
    await daemon.serve(stop or asyncio.Event())
    return daemon
