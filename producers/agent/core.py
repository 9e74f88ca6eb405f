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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import orjson

from producers.agent.cadence import Cadence, RankBeat
from producers.agent.metrics import NodeMetrics
from producers.agent.topology import TopologyError, expand_hostlist
from producers.publisher import Message
from producers.torch_hook.wire import BYE, HELLO, INFLIGHT, STEPS, FrameError
from schemas import topics
from schemas.clock import NanoClock
from schemas.wire import InflightOp, Layout, ThreadStack

MAX_INFLIGHT = 256  # ops of one rank's table kept (a runaway table must not grow heartbeats)
MAX_STACK = 20  # innermost frames of a dying rank's stack passed on
MAX_THREADS, MAX_FRAMES = 16, 40  # of a rank's thread stacks passed on (hang forensics)
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


def read_proc_state(pid: int, proc: str = "/proc", cgroups: str = "/sys/fs/cgroup"
                    ) -> str | None:
    """Why a rank's process cannot answer, when its node can tell: "stopped" (SIGSTOP, a
    debugger), "frozen" (a cgroup freezer holds it), "blocked" (in uninterruptible kernel
    sleep: a freezer whose cgroup this agent cannot read, stuck I/O, a driver call); None
    when it runs or sleeps normally, or is gone. The freezer is read from the process's own
    cgroup (v1 `freezer.state`, v2 `cgroup.events`): on some kernels a frozen task's state
    and wait channel do not say it is frozen, and an agent started by `ip netns exec` sees
    no cgroup file system at all.

    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); os.makedirs(f"{d}/7"); os.makedirs(f"{d}/9")
    >>> _ = open(f"{d}/7/stat", "w").write("7 (python (x)) T 1 7 7 0 -1")
    >>> _ = open(f"{d}/9/stat", "w").write("9 (python) D 1 9 9 0 -1")
    >>> _ = open(f"{d}/9/cgroup", "w").write("7:freezer:/drill\\n0::/\\n")
    >>> read_proc_state(7, d, d), read_proc_state(8, d, d), read_proc_state(9, d, d)
    ('stopped', None, 'blocked')
    >>> os.makedirs(f"{d}/freezer/drill")
    >>> _ = open(f"{d}/freezer/drill/freezer.state", "w").write("FROZEN\\n")
    >>> read_proc_state(9, d, d)
    'frozen'
    """
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read(512)
        close = stat.rindex(b")")
        state = stat[close + 2:close + 3]
        if state in (b"T", b"t"):
            return "stopped"
        if state not in (b"D", b"S"):
            return None
        with open(f"{proc}/{pid}/cgroup") as f:
            lines = f.read(4096).splitlines()
    except (OSError, ValueError):
        return None
    frozen: tuple[str, ...]
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if "freezer" in controllers.split(","):
            where, frozen = f"{cgroups}/freezer{path}/freezer.state", ("FROZEN", "FREEZING")
        elif controllers == "" and path:
            where, frozen = f"{cgroups}{path.rstrip('/')}/cgroup.events", ("frozen 1",)
        else:
            continue
        try:
            with open(where) as f:
                if any(word in f.read(512) for word in frozen):
                    return "frozen"
        except OSError:
            continue
    return "blocked" if state == b"D" else None


def job_nodes(hostlist: str) -> list[str]:
    """The job's node names from its Slurm host list; [] when it is empty, unreadable or
    larger than any cluster (`expand_hostlist` refuses those): a wrong list must not make
    every node of the job look dark.

    >>> job_nodes("gpu-[01-03],login1"), job_nodes("gpu-[x]"), job_nodes("")
    (['gpu-01', 'gpu-02', 'gpu-03', 'login1'], [], [])
    """
    try:
        names = expand_hostlist(hostlist) if hostlist else []
    except TopologyError:
        return []
    return names


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
    job_nodes: str = ""  # rank 0: the job's nodes, a Slurm host list (SLURM_JOB_NODELIST)


class Bye(msgspec.Struct):
    """A goodbye; with `exit`, the rank is ending on an error it names."""

    exit: str = ""
    detail: str = ""
    stack: list[str] = []


class RankThread(msgspec.Struct):
    """A thread's stack as the hook sends it; cut to the wire's bounds here, not refused."""

    thread: str
    frames: list[str]
    training: bool = False


class Table(msgspec.Struct):
    step: int
    inflight: list[InflightOp] = []
    stacks: list[RankThread] | None = None  # every thread's stack, now and then (hangs)
    stacks_ts_ns: int = 0
    layout: Layout | None = None  # members per group of each tagged kind, once known


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
    stacks: list[ThreadStack] | None = None  # sent with the next heartbeat, then dropped
    stacks_ts_ns: int = 0
    proc_state: str | None = None  # as published last: "stopped" | "frozen" | "blocked"
    seen_state: str | None = None  # as read at the last sample


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
                 switch_of_node: dict[str, str] | None = None,
                 proc_state: Callable[[int], str | None] = read_proc_state,
                 read_stacks: Callable[[int], list[ThreadStack] | None] | None = None
                 ) -> None:
        self.node = node
        self.proc_state = proc_state
        # a stopped rank's stacks, read from outside it (`producers.agent.outside_stacks`):
        # its hook cannot send them; None: not read
        self.read_stacks = read_stacks
        self.switch_of_node = switch_of_node or {}
        self.metrics = NodeMetrics(node)
        self.now = now
        self.cadence = cadence or Cadence()
        self.ranks: dict[int, RankState] = {}  # by connection id
        self.stats = CoreStats()
        self._started: set[str] = set()
        self._layouts: dict[str, Layout] = {}  # by job: the layout its start was sent with

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
            if table.stacks:
                st.stacks = [
                    ThreadStack(t.thread[:200], [f[:300] for f in t.frames[-MAX_FRAMES:]],
                                t.training)
                    for t in table.stacks[:MAX_THREADS]]
                st.stacks_ts_ns = table.stacks_ts_ns or self.now()
            self.stats.tables += 1
            if table.layout is not None and st.hello.rank == 0:
                return self._start_with_layout(st.hello, table.layout)
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
                self._layouts.pop(st.hello.job, None)
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
            due = self.cadence.sample(st.beat, st.inflight, now)
            seen = self.proc_state(st.hello.pid) if st.hello.pid > 0 else None
            # a moment in uninterruptible sleep is ordinary (a page fault, a disk write):
            # "blocked" is said only when two samples in a row find it so
            state = seen if seen != "blocked" or st.seen_state == "blocked" else st.proc_state
            st.seen_state = seen
            if state and state != st.proc_state and self.read_stacks is not None:
                # it just became unable to run: where it stopped, read once from outside
                taken = self.read_stacks(st.hello.pid)
                if taken:
                    st.stacks, st.stacks_ts_ns = taken, now
            if not (due or st.stacks or state != st.proc_state):
                continue
            msg: dict[str, Any] = {
                "v": 1, "job": st.hello.job, "rank": st.hello.rank, "node": st.node,
                "ts_ns": now, "step": st.step, "inflight": st.inflight,
            }
            if st.stacks:  # once: the worker keeps each rank's newest
                msg["stacks"], msg["stacks_ts_ns"] = st.stacks, st.stacks_ts_ns
                st.stacks = None
            if state:
                msg["proc_state"] = state
            st.proc_state = state
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
            out.append(self._start_event(hello))
        return out

    def _start_event(self, hello: Hello) -> Message:
        """Rank 0's job start: its size, the cluster's topology, the job's nodes and, once
        known, its layout."""
        return self._job_event(hello.job, "start", hello.world_size, self.switch_of_node,
                               job_nodes(hello.job_nodes), self._layouts.get(hello.job))

    def _start_with_layout(self, hello: Hello, layout: Layout) -> list[Message]:
        """The job's start again, now with the layout rank 0's tagged groups tell.

        Rank 0 says hello as soon as its process group exists, before it creates the groups
        that give the layout. Without it a group's untraced members look absent, so partial
        tracing could not be told from a smaller group: the start is repeated once the
        layout is known (and if it changes), which a diagnoser takes as the same job.
        """
        if hello.world_size <= 0 or self._layouts.get(hello.job) == layout:
            return []
        if len(self._layouts) > 10_000:
            self._layouts.clear()
        self._layouts[hello.job] = layout
        return [self._start_event(hello)]

    def _job_event(self, job: str, event: str, world_size: int = 0,
                   switch_of_node: dict[str, str] | None = None,
                   nodes: list[str] | None = None, layout: Layout | None = None) -> Message:
        msg: dict[str, Any] = {"v": 1, "job": job, "event": event, "ts_ns": self.now()}
        if world_size:
            msg["world_size"] = world_size
        if layout is not None:
            msg["layout"] = msgspec.to_builtins(layout)
        if nodes:  # the job's own nodes: one that never reports is a dark node of the job
            where = switch_of_node or {}
            msg["nodes"] = [{"node": n, "switch": where[n]} if n in where else {"node": n}
                            for n in nodes]
        if switch_of_node:  # the cluster's map, not the job's node list (wire v1 `topology`)
            msg["topology"] = [{"node": n, "switch": s} for n, s in switch_of_node.items()]
        return (topics.JOBS, job.encode(), orjson.dumps(msg))
