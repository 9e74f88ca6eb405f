"""The node agent's state, free of I/O: frames from local ranks in, Kafka messages out.

One agent runs per node. Ranks connect over a Unix socket (protocol in
`producers.torch_hook.wire`); their step messages are forwarded untouched to `flare.steps.v1`
(the rank already built wire v1), and every `interval_s` the agent samples each connected
rank's latest in-flight table (what is in flight and since when) and may publish it as a
heartbeat to `flare.heartbeats.v1` (`producers.agent.cadence` says when). A rank whose
process dies closes its socket and stops being heartbeated (its silence is the evidence); a
rank stuck in Python or C code keeps its last table, so peers blocked in a collective and a
rank stuck outside it are both visible. Rank 0's hello and goodbye become the job's `start`
and `end` events; the start event carries the node → switch map the agent was given
(`producers.agent.topology`), so a congested switch can be named.

Kept apart from the socket server (`producers.agent.server`) so that every rule above is
tested with a fake clock and plain byte strings, without sockets or threads.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import orjson

from producers.agent.cadence import Cadence, RankBeat
from producers.agent.metrics import NodeMetrics
from producers.publisher import Message
from producers.torch_hook.wire import BYE, HELLO, INFLIGHT, STEPS, FrameError
from schemas import topics
from schemas.clock import NanoClock
from schemas.wire import InflightOp

MAX_INFLIGHT = 256  # ops of one rank's table kept (a runaway table must not grow heartbeats)
MAX_STACK = 20  # innermost frames of a dying rank's stack passed on
_FRAME = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def read_fault_file(path: str) -> tuple[str | None, list[str]]:
    """What faulthandler wrote before the process died: (`signal: <its error line>`, the
    frames of the thread that crashed as `file:line in function`, outermost first); (None,
    []) when there is no such file or nothing in it (killed without a word). faulthandler
    lists the other threads first and marks the crashing one "Current thread".

    >>> import tempfile, os
    >>> with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
    ...     _ = f.write("Fatal Python error: Segmentation fault\\n\\n"
    ...                 "Thread 0x2 (most recent call first):\\n"
    ...                 '  File "/x/threading.py", line 982 in run\\n\\n'
    ...                 "Current thread 0x1 (most recent call first):\\n"
    ...                 '  File "/x/train.py", line 42 in step\\n'
    ...                 '  File "/x/train.py", line 9 in <module>\\n')
    >>> read_fault_file(f.name)
    ('signal: Segmentation fault', ['train.py:9 in <module>', 'train.py:42 in step'])
    >>> os.unlink(f.name)
    """
    if not path:
        return None, []
    try:
        with open(path, errors="replace") as f:
            text = f.read(256 * 1024)
    except OSError:
        return None, []
    lines = text.splitlines()
    error = next((ln for ln in lines if ln.startswith("Fatal Python error:")), None)
    if error is None:
        return None, []
    heads = [i for i, ln in enumerate(lines) if ln.startswith(("Current thread", "Thread 0x",
                                                                 "Stack (most recent"))]
    current = [i for i in heads if lines[i].startswith("Current thread")]
    start = (current or heads or [lines.index(error)])[0] + 1
    frames: list[str] = []
    for ln in lines[start:]:
        m = _FRAME.match(ln)
        if m is None:
            break
        frames.append(f"{Path(m['file']).name}:{m['line']} in {m['func']}")
    return f"signal: {error.partition(':')[2].strip()}", frames[::-1]


def _forget_file(path: str) -> None:
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


class Hello(msgspec.Struct):
    job: str
    rank: int
    node: str = ""
    local_rank: int = 0
    world_size: int = 0
    pid: int = 0
    fault_file: str = ""  # where the rank's faulthandler writes a fatal signal's stacks


class Bye(msgspec.Struct):
    """A goodbye; with `exit`, the rank is ending on an error it names."""

    exit: str = ""
    detail: str = ""
    stack: list[str] = []


class Table(msgspec.Struct):
    step: int
    inflight: list[InflightOp] = []


_hello = msgspec.json.Decoder(Hello)
_bye = msgspec.json.Decoder(Bye)
_table = msgspec.json.Decoder(Table)


@dataclass(slots=True)
class RankState:
    hello: Hello
    node: str
    step: int = 0
    inflight: list[InflightOp] = field(default_factory=list)
    beat: RankBeat = field(default_factory=RankBeat)


@dataclass(slots=True)
class CoreStats:
    steps: int = 0
    tables: int = 0
    samples: int = 0  # heartbeat samples taken (published or not)
    heartbeats: int = 0  # heartbeats published
    bad_frames: int = 0
    vanished: int = 0  # ranks whose socket closed without a goodbye


class AgentCore:
    """Feed frames, collect messages to publish; time comes from `now` (the node's clock)."""

    def __init__(self, node: str, now: NanoClock = time.time_ns, *,
                 cadence: Cadence | None = None,
                 switch_of_node: dict[str, str] | None = None) -> None:
        self.node = node
        self.switch_of_node = switch_of_node or {}
        self.metrics = NodeMetrics(node)
        self.now = now
        self.cadence = cadence or Cadence()
        self.ranks: dict[int, RankState] = {}  # by connection id
        self.stats = CoreStats()
        self._started: set[str] = set()

    def on_frame(self, conn: int, ftype: int, payload: bytes) -> list[Message]:
        """One frame from connection `conn`; FrameError when it breaks the protocol."""
        if ftype == HELLO:
            return self._on_hello(conn, payload)
        st = self.ranks.get(conn)
        if st is None:
            raise FrameError("the first frame of a connection must be a hello")
        if ftype == STEPS:
            self.stats.steps += 1
            self.metrics.observe_step(payload)
            return [(topics.STEPS, st.hello.job.encode(), payload)]
        if ftype == INFLIGHT:
            try:
                table = _table.decode(payload)
            except msgspec.DecodeError as exc:
                raise FrameError(f"bad in-flight table: {exc}") from None
            st.step = max(table.step, 0)
            st.inflight = table.inflight[:MAX_INFLIGHT]
            self.stats.tables += 1
            return []
        if ftype == BYE:
            try:
                bye = _bye.decode(payload) if payload.strip() else Bye()
            except msgspec.DecodeError:
                bye = Bye()  # an unreadable goodbye is still a goodbye
            _forget_file(st.hello.fault_file)
            if bye.exit:  # it is exiting on an error: that is no clean end of the job
                self.ranks.pop(conn, None)
                return [self._exit_beat(st, f"{bye.exit}: {bye.detail}", bye.stack)]
            out = []
            if st.hello.rank == 0:
                out.append(self._job_event(st.hello.job, "end"))
                self.metrics.forget(st.hello.job)
            self.ranks.pop(conn, None)
            return out
        raise FrameError(f"unknown frame type {ftype}")

    def on_disconnect(self, conn: int, *, broken: bool = False) -> list[Message]:
        """The rank's socket closed: stop heartbeating it.

        A rank that said goodbye is gone already. One that did not was killed or crashed
        hard (no Python exit ran): its last heartbeat says so, with the step and ops it was
        in, so the first rank to die is named instead of the peers that fail after it. A
        connection the agent closed itself (`broken`: it broke the protocol) says nothing
        about the process.
        """
        st = self.ranks.pop(conn, None)
        if st is None or broken:
            return []
        reason, stack = read_fault_file(st.hello.fault_file)
        _forget_file(st.hello.fault_file)
        return [self._exit_beat(st, reason, stack)]

    def _exit_beat(self, st: RankState, reason: str | None, stack: list[str]) -> Message:
        """The last heartbeat of a rank whose process ended without a clean goodbye."""
        self.stats.vanished += 1
        msg: dict[str, Any] = {
            "v": 1, "job": st.hello.job, "rank": st.hello.rank, "node": st.node,
            "ts_ns": self.now(), "step": st.step, "inflight": st.inflight, "exited": "vanished",
        }
        if reason:
            msg["exit_reason"] = reason[:600]
            msg["exit_stack"] = [line[:300] for line in stack[-MAX_STACK:]]
        return (topics.HEARTBEATS, st.hello.job.encode(), msgspec.json.encode(msg))

    def metrics_text(self, dropped: int = 0, version: str = "") -> str:
        """The node's Prometheus metrics now (`producers.agent.metrics`)."""
        since: dict[tuple[str, int], list[int]] = {}
        for st in self.ranks.values():
            since.setdefault((st.hello.job, st.hello.rank), []).extend(
                op.start_ns for op in st.inflight)
        return self.metrics.render(self.now(), lambda j, r: since.get((j, r), ()), dropped,
                                   version)

    def heartbeats(self) -> list[Message]:
        """Sample every connected rank now; the heartbeats the cadence says to publish.

        Called every `cadence.interval_s` by the server.
        """
        now = self.now()
        out = []
        for st in self.ranks.values():
            if not self.cadence.sample(st.beat, st.inflight, now):
                continue
            msg = {
                "v": 1, "job": st.hello.job, "rank": st.hello.rank, "node": st.node,
                "ts_ns": now, "step": st.step, "inflight": st.inflight,
            }
            out.append((topics.HEARTBEATS, st.hello.job.encode(), msgspec.json.encode(msg)))
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
            out.append(self._job_event(hello.job, "start", hello.world_size,
                                       self.switch_of_node))
        return out

    def _job_event(self, job: str, event: str, world_size: int = 0,
                   switch_of_node: dict[str, str] | None = None) -> Message:
        msg: dict[str, Any] = {"v": 1, "job": job, "event": event, "ts_ns": self.now()}
        if world_size:
            msg["world_size"] = world_size
        if switch_of_node:  # the cluster's map, not the job's node list (wire v1 `topology`)
            msg["topology"] = [{"node": n, "switch": s} for n, s in switch_of_node.items()]
        return (topics.JOBS, job.encode(), orjson.dumps(msg))
