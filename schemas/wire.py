"""msgspec models of every v1 topic (DESIGN §3).

These are the validating decoders of the worker and the source of the checked-in JSON Schema
files; producers may build plain dicts, the worker accepts exactly these shapes.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
# Every integer of an input ends up in a numpy int64 (the detectors) and a ClickHouse Int64:
# one outside that range (JSON has no limit, msgspec goes up to 2**64 - 1) is refused here,
# not met half-way through a diagnoser that has already changed part of its state.
Int64 = Annotated[int, msgspec.Meta(ge=I64_MIN, le=I64_MAX)]
NonNeg = Annotated[int, msgspec.Meta(ge=0, le=I64_MAX)]
# A job's ranks are numbered below this (a million GPUs): per-rank state is sized by the
# largest rank a job has shown, so a rank of 10**9 in one message is refused here rather
# than grow every detector's arrays to that size.
MAX_RANKS = 1 << 20
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_RANKS)]
WorldSize = Annotated[int, msgspec.Meta(ge=0, le=MAX_RANKS)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
OpKind = Literal["compute", "coll", "p2p"]
IncidentKind = Literal["gpu", "node", "host", "link", "switch", "hang", "job"]


class Coords(msgspec.Struct, forbid_unknown_fields=False, omit_defaults=True):
    """Position of a rank in each parallel dimension, when the producer knows it."""

    tp: NonNeg | None = None
    pp: NonNeg | None = None
    dp: NonNeg | None = None
    ep: NonNeg | None = None
    cp: NonNeg | None = None


IssueNs = Annotated[int, msgspec.Meta(ge=-1)]


class Ops(msgspec.Struct):
    """Columnar ops of one rank-step: equal-length arrays, one entry per op."""

    kind: list[OpKind]
    name: list[str]
    group: list[str]
    seq: list[int]
    start_ns: list[int]
    dur_ns: list[int]
    bytes: list[int]
    # Additive in v1 (GPU-side timing): per op, ns from the CPU's launch to the GPU's start,
    # measured with CUDA events; -1 for an op without a GPU measure (CPU/gloo, or its events
    # were not done when the step was sent). Absent: the producer timed nothing on a GPU.
    # When present, its ops' start_ns/dur_ns are GPU times mapped to the node's clock.
    issue_ns: list[IssueNs] | None = None


class StepsV1(msgspec.Struct):
    """`flare.steps.v1`: one message per rank per training step."""

    v: Literal[1]
    job: Name
    rank: Rank
    node: Name
    step: NonNeg
    t_start_ns: Int64
    t_end_ns: Int64
    ops: Ops
    local_rank: NonNeg = 0
    coords: Coords | None = None


class InflightOp(msgspec.Struct):
    group: str
    name: str
    seq: Int64
    start_ns: Int64


Frame = Annotated[str, msgspec.Meta(max_length=1000)]


class ThreadStack(msgspec.Struct):
    """One thread of a rank as its hook saw it while the rank made no progress."""

    thread: str
    frames: Annotated[list[Frame], msgspec.Meta(max_length=128)]  # outermost first
    training: bool = False  # the thread that runs the training loop (it ends the steps)


class HeartbeatV1(msgspec.Struct):
    """`flare.heartbeats.v1`: about every second per rank; ops in flight tell a hang."""

    v: Literal[1]
    job: Name
    rank: Rank
    node: Name
    ts_ns: Int64
    step: NonNeg
    inflight: list[InflightOp] = []
    # Additive in v1: set on a rank's last heartbeat when its process ended without saying
    # goodbye. "vanished": its socket closed with no goodbye (SIGKILL, a hard crash, the OOM
    # killer); `step` and `inflight` are where it was. A rank that exits through Python
    # (even on an exception) says goodbye and gets no such heartbeat.
    exited: Literal["vanished"] | None = None
    # Additive in v1: why it ended, when the rank could say (`exception: <type>: <message>`,
    # `signal: <what faulthandler named>`), and the innermost frames of its stack, outermost
    # first (`file:line in function`). Absent: killed without a word (SIGKILL, OOM).
    exit_reason: str | None = None
    exit_stack: list[str] | None = None
    # Additive in v1 (hang forensics): every thread's Python stack (`file:line in function`,
    # outermost first), taken by the rank's hook at `stacks_ts_ns` because its current step
    # had lasted well past its usual step time; sent once per capture. And the state the
    # agent read for the rank's process when it is not running, so a rank that can say
    # nothing is still explained: "stopped" (SIGSTOP, a debugger), "frozen" (cgroup freezer),
    # "blocked" (in uninterruptible kernel sleep for over a sample: a freezer the agent
    # cannot see, stuck I/O, a driver call).
    stacks: Annotated[list[ThreadStack], msgspec.Meta(max_length=128)] | None = None
    stacks_ts_ns: Int64 | None = None
    proc_state: Literal["stopped", "frozen", "blocked"] | None = None


class Layout(msgspec.Struct, omit_defaults=True):
    tp: NonNeg | None = None
    pp: NonNeg | None = None
    dp: NonNeg | None = None
    ep: NonNeg | None = None


class NodeInfo(msgspec.Struct):
    node: Name
    switch: str | None = None


class JobV1(msgspec.Struct, omit_defaults=True):
    """`flare.jobs.v1`: job start (with layout and optional topology) or end."""

    v: Literal[1]
    job: Name
    event: Literal["start", "end"]
    ts_ns: Int64
    world_size: WorldSize | None = None
    layout: Layout | None = None
    nodes: list[NodeInfo] | None = None
    # Additive in v1: the cluster's node → switch map as an agent found it (a topology file
    # or labels). It may name nodes outside the job, so unlike `nodes` it says nothing about
    # which nodes the job has; it only lets a switch be named.
    topology: list[NodeInfo] | None = None


class Suspect(msgspec.Struct):
    entity: str
    confidence: float


class StackGroup(msgspec.Struct):
    """One distinct stack of a hang's merged view: which ranks are there, which are not.

    `ranks` and `not_ranks` are rank ranges ("0-3,5"): at 10,000 ranks the odd one out is
    the point, and a list would bury it. A group with no frames holds the ranks that sent no
    stack since the hang began, and `note` says why when it is known.
    """

    thread: str  # "training" (the thread that ends steps), else the thread's name
    frames: list[str]  # outermost first, `file:line in function`
    ranks: str
    n_ranks: int
    not_ranks: str
    note: str = ""


class IncidentV1(msgspec.Struct):
    """Incident v1: the Kafka value, the API resource and the ClickHouse row."""

    v: Literal[1]
    id: str
    job: str
    status: Literal["open", "resolved"]
    kind: IncidentKind
    culprit: str
    suspects: list[Suspect]
    onset_step: int
    opened_step: int
    opened_ts_ns: int
    last_step: int
    resolved_step: int | None
    slowdown: float
    lost_gpu_seconds: float  # in total: what-if cost summed over the incident's steps
    evidence_steps: int
    summary: str
    # the latest step's what-if cost (a hang: one step time of the whole job); 0 in records
    # written before it existed
    lost_gpu_seconds_per_step: float = 0.0
    # a hang: the ranks' Python stacks merged (additive in v1; None when none were sent)
    stacks: list[StackGroup] | None = None


class DeadLetterV1(msgspec.Struct):
    """`flare.deadletter.v1`: an input that could not be used, with the reason."""

    v: Literal[1]
    topic: str
    partition: int
    offset: int
    reason: str
    payload_b64: str


TOPIC_MODELS: dict[str, type[msgspec.Struct]] = {
    "flare.steps.v1": StepsV1,
    "flare.heartbeats.v1": HeartbeatV1,
    "flare.jobs.v1": JobV1,
    "flare.incidents.v1": IncidentV1,
    "flare.deadletter.v1": DeadLetterV1,
}
