"""One rank's Kineto (PyTorch profiler) trace → that rank's wire-v1 steps messages.

Steps are the `ProfilerStep#N` spans of the CPU timeline. Communication ops are taken from
the best source a trace has, because the generations differ:
1. NCCL kernels on the GPU timeline: the real duration of a collective (including the wait
   for late peers); recent traces put the collective's args (name, process group, sizes) on
   the kernel itself, older ones are paired in order with the CPU-side `nccl:*` annotations.
2. `gloo:*` annotations of gloo's worker threads (CPU training): the execution of each op,
   paired in order, per name, with the `c10d::*` call on the training thread that issued it.
   They name no group: a collective's group is its thread's (`thread_group`) until the
   replay infers it across ranks (`groups`); a send or receive runs on the calling thread
   and spans from its call to the end of its gloo event.
3. Otherwise the CPU-side `record_param_comms`, `c10d::*` or `nccl:*` events themselves.
An op belongs to the step in which it was issued (the kernel's CPU launch, the c10d call), even
when the GPU runs it after the step's CPU span has closed.

Compute: on GPU traces `gpu_compute` ops, the summed duration of the non-NCCL kernels (the
NVRx-style compute signal) of each stretch between the step's communication ops; on CPU
traces `fwd`, `bwd` and `optimizer` phases from the autograd engine's events and the
optimizer's annotations, the first two cut around the training thread's blocked waits
(`waits`).

`seq` is `(step << 20) | i`, the i-th op of the group in profiler step `step`: monotone and
equal on every rank that issued the same ops, even when ranks' traces cover different steps.
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from producers.kineto.groups import ProcessGroup, ThreadOps, process_groups
from producers.kineto.names import (
    P2P_NAMES,
    UNKNOWN_GROUP,
    canonical,
    comm_event_name,
    group_name,
    is_nccl_kernel,
    message_bytes,
    stream_group,
    stream_of,
    thread_group,
    thread_of,
)
from producers.kineto.waits import Leaves, blocked, pieces
from schemas.steps_message import steps_message

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_SEQ_SHIFT = 20
_GPU_COMPUTE = "gpu_compute"


class KinetoError(ValueError):
    """A file that is not a usable Kineto trace (the message says which and why)."""


class NoSteps(KinetoError):
    """A trace with no ProfilerStep#N span: on its own, nothing to replay; among a rank's
    windows, the empty one a profiler writes when training stops mid-window."""


@dataclass(slots=True)
class Op:
    kind: str
    name: str
    group: str
    start_ns: int
    dur_ns: int
    nbytes: int
    anchor_ns: int  # when it was issued: decides its step


@dataclass(slots=True)
class _Events:
    steps: list[tuple[int, float, float]] = field(default_factory=list)  # (step, t0, t1)
    nccl_kernels: list[dict[str, Any]] = field(default_factory=list)
    compute_kernels: list[dict[str, Any]] = field(default_factory=list)
    launches: dict[Any, float] = field(default_factory=dict)  # correlation -> CPU ts (us)
    param_comms: list[dict[str, Any]] = field(default_factory=list)
    gloo: list[dict[str, Any]] = field(default_factory=list)
    nccl_cpu: list[dict[str, Any]] = field(default_factory=list)
    c10d: list[dict[str, Any]] = field(default_factory=list)
    bwd: list[dict[str, Any]] = field(default_factory=list)
    fwd: list[dict[str, Any]] = field(default_factory=list)
    opt: list[dict[str, Any]] = field(default_factory=list)
    step_tid: Any = None  # the training thread: the one the profiler steps are on


def _scan(events: list[Any]) -> _Events:
    ev = _Events()
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X":
            continue
        name = e.get("name")
        ts = e.get("ts")
        if not isinstance(name, str) or not isinstance(ts, int | float):
            continue
        cat = e.get("cat", "")
        if cat == "kernel":
            (ev.nccl_kernels if is_nccl_kernel(name) else ev.compute_kernels).append(e)
        elif cat in ("cuda_runtime", "cuda_driver"):
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                ev.launches[corr] = ts
        elif cat in ("cpu_op", "user_annotation"):
            m = _STEP.match(name)
            if m is not None:
                ev.steps.append((int(m.group(1)), ts, ts + float(e.get("dur", 0) or 0)))
                ev.step_tid = e.get("tid")
            elif name == "record_param_comms":
                ev.param_comms.append(e)
            elif name.startswith("autograd::engine::evaluate_function"):
                ev.bwd.append(e)
            elif name.startswith("Optimizer.step#"):
                ev.opt.append(e)
            elif name.startswith("## forward") or name == "DistributedDataParallel.forward":
                ev.fwd.append(e)
            elif comm_event_name(name) is not None:
                low = name.lower()
                if low.startswith("gloo:"):
                    ev.gloo.append(e)
                elif low.startswith("nccl:"):
                    ev.nccl_cpu.append(e)
                elif low.startswith("c10d::"):
                    ev.c10d.append(e)
    for lst in (ev.nccl_kernels, ev.compute_kernels, ev.param_comms, ev.gloo, ev.nccl_cpu,
                ev.c10d, ev.bwd, ev.fwd, ev.opt):
        lst.sort(key=lambda x: x["ts"])
    ev.steps.sort(key=lambda s: s[1])
    return ev


def _thread_spans(events: list[Any], tid: Any) -> Iterator[tuple[Any, float, float, bool]]:
    """The CPU-side spans of one thread but its profiler steps: (tid, ts, dur, is it
    communication), what `waits.Leaves` reads. A second pass, only on CPU traces: a GPU
    trace's millions of events are not kept twice."""
    for e in events:
        if (isinstance(e, dict) and e.get("ph") == "X" and e.get("tid") == tid
                and e.get("cat") in ("cpu_op", "user_annotation")):
            name, ts = e.get("name"), e.get("ts")
            if isinstance(name, str) and isinstance(ts, int | float) and not _STEP.match(name):
                yield (tid, ts, float(e.get("dur", 0) or 0),
                       name == "record_param_comms" or comm_event_name(name) is not None)


class _Clock:
    """Trace µs (float, maybe relative to `baseTimeNanoseconds`) → absolute int ns."""

    def __init__(self, base_ns: int) -> None:
        self.base_ns = base_ns

    def ns(self, ts_us: float) -> int:
        return self.base_ns + int(round(ts_us * 1000.0))

    def dur(self, e: Mapping[str, Any]) -> int:
        return max(int(round(float(e.get("dur", 0) or 0) * 1000.0)), 0)


def _op_from(e: Mapping[str, Any], wire: str, args: Mapping[str, Any], clock: _Clock,
             anchor_us: float) -> Op:
    return Op(
        kind="p2p" if wire in P2P_NAMES else "coll",
        name=wire,
        group=group_name(args),
        start_ns=clock.ns(e["ts"]),
        dur_ns=clock.dur(e),
        nbytes=message_bytes(args, wire),
        anchor_ns=clock.ns(anchor_us),
    )


def _wire_of(e: Mapping[str, Any]) -> tuple[str | None, Mapping[str, Any]]:
    args = e.get("args") or {}
    coll = args.get("Collective name")
    wire = canonical(str(coll)) if coll else comm_event_name(e["name"])
    return wire, args


def _comm_ops(ev: _Events, clock: _Clock) -> list[Op]:
    ops: list[Op] = []
    if ev.nccl_kernels:
        k_have_args = any("Collective name" in (k.get("args") or {}) for k in ev.nccl_kernels)
        cpu = ev.param_comms if len(ev.param_comms) == len(ev.nccl_kernels) else ev.nccl_cpu
        paired = not k_have_args and len(cpu) == len(ev.nccl_kernels)
        for i, k in enumerate(ev.nccl_kernels):
            src = cpu[i] if paired else k
            wire, args = _wire_of(src)
            if wire is None:
                wire, args = _wire_of(k)
            kargs = k.get("args") or {}
            anchor = ev.launches.get(kargs.get("correlation"), src["ts"] if paired else k["ts"])
            op = _op_from(k, wire or "sendrecv", args, clock, anchor)
            if op.group == UNKNOWN_GROUP:  # an older trace: the group is its stream's
                op.group = stream_group(kargs.get("stream", k.get("tid", "")))
            ops.append(op)
        return ops
    if ev.gloo:
        issued: dict[str, deque[dict[str, Any]]] = defaultdict(deque)
        for c in ev.c10d:
            w = comm_event_name(c["name"])
            if w is not None:
                issued[w].append(c)
        for g in ev.gloo:
            wire = comm_event_name(g["name"]) or "sendrecv"
            call = issued[wire].popleft() if issued[wire] else None
            args = (call.get("args") or {}) if call is not None else {}
            op = _op_from(g, wire, args, clock, call["ts"] if call else g["ts"])
            if op.kind == "p2p" and call is not None:
                # A send or receive runs on the calling thread, and its wait is in the
                # call or in the gloo event after it, depending on the version: the op
                # is both, from its post to its end.
                end = max(op.start_ns + op.dur_ns, op.anchor_ns + clock.dur(call))
                op.start_ns, op.dur_ns = op.anchor_ns, end - op.anchor_ns
            elif op.group == UNKNOWN_GROUP:
                op.group = thread_group(g.get("tid", ""))  # its group's thread: see groups
            ops.append(op)
        return ops
    for source in (ev.param_comms, ev.c10d, ev.nccl_cpu):
        if source:
            for e in source:
                wire, args = _wire_of(e)
                if wire is not None:
                    ops.append(_op_from(e, wire, args, clock, e["ts"]))
            return ops
    return ops


def _compute_ops(ev: _Events, clock: _Clock) -> list[Op]:
    """Per-event compute ops (phases are merged per step later)."""
    ops: list[Op] = []
    if ev.nccl_kernels or ev.compute_kernels:
        for k in ev.compute_kernels:
            corr = (k.get("args") or {}).get("correlation")
            anchor = ev.launches.get(corr, k["ts"])
            ops.append(Op("compute", _GPU_COMPUTE, "", clock.ns(k["ts"]), clock.dur(k), 0,
                          clock.ns(anchor)))
        return ops
    for name, lst in (("fwd", ev.fwd), ("bwd", ev.bwd), ("optimizer", ev.opt)):
        for e in lst:
            t = clock.ns(e["ts"])
            ops.append(Op("compute", name, "", t, clock.dur(e), 0, t))
    return ops


def _merge_compute(ops: list[Op], t0: int, comm: list[Op]) -> list[Op]:
    """The step's compute ops: `bwd` as the span of the autograd engine's events (they nest
    and overlap), `fwd` before it when no annotation marks the forward, a GPU's kernels one
    op per stretch between communication ops (`_gpu_stretches`), the others as summed busy
    time starting at their first event."""
    by: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        by[o.name].append(o)
    out: list[Op] = _gpu_stretches(by.pop(_GPU_COMPUTE, []), comm)
    bwd = by.pop("bwd", [])
    if bwd:
        b0 = min(o.start_ns for o in bwd)
        b1 = max(o.start_ns + o.dur_ns for o in bwd)
        if "fwd" not in by:
            out.append(Op("compute", "fwd", "", t0, max(b0 - t0, 0), 0, t0))
        out.append(Op("compute", "bwd", "", b0, b1 - b0, 0, b0))
    for name, lst in by.items():
        out.append(Op("compute", name, "", min(o.start_ns for o in lst),
                      sum(o.dur_ns for o in lst), 0, lst[0].anchor_ns))
    return out


def _gpu_stretches(kernels: list[Op], comm: list[Op]) -> list[Op]:
    """A GPU's compute kernels as one op per stretch between the step's communication ops
    (by start): its busy time, from its first kernel, never past its last kernel's end.

    One op of the step's summed kernel time, put at its first kernel, overlaps the transfers
    it really ran between, and how much depends on how long they waited: the gaps a host
    stall leaves and a pipeline partner's waits read as each other's."""
    if not kernels:
        return []
    cuts = np.sort(np.array([o.start_ns for o in comm], dtype=np.int64))
    starts = np.array([k.start_ns for k in kernels], dtype=np.int64)
    ends = starts + np.array([k.dur_ns for k in kernels], dtype=np.int64)
    stretch = np.searchsorted(cuts, starts, side="right")
    out = []
    for i in np.unique(stretch).tolist():
        sel = stretch == i
        first = int(starts[sel].min())
        busy = min(int((ends[sel] - starts[sel]).sum()), int(ends[sel].max()) - first)
        anchor = kernels[int(np.flatnonzero(sel)[0])].anchor_ns
        out.append(Op("compute", _GPU_COMPUTE, "", first, busy, 0, anchor))
    return out


@dataclass(slots=True)
class RankTrace:
    rank: int
    world_size: int
    node: str
    local_rank: int
    steps: list[dict[str, Any]]
    process_groups: tuple[ProcessGroup, ...] = ()  # the rank's groups, from pg_config


def parse_trace(doc: Mapping[str, Any], job: str, *, rank: int | None, node: str | None,
                source: str = "trace") -> RankTrace:
    """The steps messages of one rank's trace document (already JSON-decoded)."""
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        raise KinetoError(f"{source}: no traceEvents list (not a Kineto trace)")
    dist = doc.get("distributedInfo") or {}
    if isinstance(dist.get("rank"), int):
        rank = int(dist["rank"])
    if rank is None:
        raise KinetoError(f"{source}: the rank is neither in distributedInfo nor in the name")
    world = int(dist.get("world_size") or 0)
    node = str(doc.get("host_name") or node or f"unknown-{rank}")
    clock = _Clock(int(doc.get("baseTimeNanoseconds") or 0))
    ev = _scan(events)
    if not ev.steps:
        raise NoSteps(f"{source}: no ProfilerStep#N spans (profile with a schedule and "
                          "call prof.step() each iteration)")
    devices = [(k.get("args") or {}).get("device") for k in ev.nccl_kernels[:1]]
    local = int(devices[0]) if devices and isinstance(devices[0], int) else 0

    t0s = np.array([clock.ns(s[1]) for s in ev.steps], dtype=np.int64)
    t1s = np.array([clock.ns(s[2]) for s in ev.steps], dtype=np.int64)
    per_step: list[list[Op]] = [[] for _ in ev.steps]
    comm_ops = _comm_ops(ev, clock)
    on_gpu = bool(ev.nccl_kernels or ev.compute_kernels)
    waits = None if on_gpu else blocked(
        ((o.start_ns, o.start_ns + o.dur_ns) for o in comm_ops),
        Leaves.of(_thread_spans(events, ev.step_tid), ev.step_tid, clock.ns))
    for op in comm_ops + _compute_ops(ev, clock):
        i = int(np.searchsorted(t0s, op.anchor_ns, side="right")) - 1
        if i >= 0 and op.anchor_ns <= t1s[i]:
            per_step[i].append(op)

    messages = []
    for (step_no, _a, _b), t0, t1, ops in zip(ev.steps, t0s.tolist(), t1s.tolist(), per_step,
                                              strict=True):
        comm = sorted((o for o in ops if o.kind != "compute"), key=lambda o: o.start_ns)
        compute = _merge_compute([o for o in ops if o.kind == "compute"], t0, comm)
        if waits is not None:  # the CPU's phases cut around their waits (`waits`)
            compute = [Op(o.kind, o.name, "", a, b - a, 0, a) if o.name in _SPANNED else o
                       for o in compute
                       for a, b in (pieces(o.start_ns, o.start_ns + o.dur_ns, waits)
                                    if o.name in _SPANNED else [(0, 0)])]
        seqs = _seqs(step_no, [o.group for o in comm]) + list(range(len(compute)))
        allops = comm + compute
        t_end = max([t1] + [o.start_ns + o.dur_ns for o in allops])
        messages.append(steps_message(
            job=job, rank=rank, node=node, local_rank=local, step=step_no,
            t_start_ns=t0, t_end_ns=t_end,
            kind=[o.kind for o in allops],
            name=[o.name for o in allops],
            group=[(o.group or UNKNOWN_GROUP) if o.kind != "compute" else "" for o in allops],
            seq=seqs,
            start_ns=[max(o.start_ns - t0, 0) for o in allops],
            dur_ns=[o.dur_ns for o in allops],
            bytes=[o.nbytes for o in allops],
        ))
    return RankTrace(rank, world, node, local, messages, process_groups(dist))


_SPANNED = ("fwd", "bwd")  # the phases timed as spans of everything the thread did


def _seqs(step_no: int, groups: list[str]) -> list[int]:
    """Per group, the i-th communication op of profiler step `step_no` (see module doc)."""
    counters: dict[str, int] = defaultdict(int)
    seqs = []
    for g in groups:
        seqs.append((step_no << _SEQ_SHIFT) | counters[g])
        counters[g] += 1
    return seqs


def thread_ops(trace: RankTrace) -> dict[str, ThreadOps]:
    """The rank's collectives whose group is still their worker thread's, by thread."""
    return _lane_ops(trace, thread_of)


def stream_ops(trace: RankTrace) -> dict[str, ThreadOps]:
    """The rank's NCCL ops whose group is still their CUDA stream's, by stream, in the order
    the stream ran them."""
    return _lane_ops(trace, stream_of)


def _lane_ops(trace: RankTrace, lane_of: Callable[[str], str | None]) -> dict[str, ThreadOps]:
    by: dict[str, tuple[list[str], list[int], list[int], list[int]]] = {}
    for m in trace.steps:
        ops = m["ops"]
        for g, n, st, d in zip(ops["group"], ops["name"], ops["start_ns"], ops["dur_ns"],
                               strict=True):
            tid = lane_of(g)
            if tid is not None:
                names, ends, durs, steps = by.setdefault(tid, ([], [], [], []))
                names.append(n)
                ends.append(m["t_start_ns"] + st + d)
                durs.append(d)
                steps.append(m["step"])
    return {tid: ThreadOps.of(*cols) for tid, cols in by.items()}


def p2p_posted(trace: RankTrace) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The rank's p2p ops with no group in the trace, in message order: (is_send, start_ns,
    end_ns), what `peers.pick_peers` pairs them by."""
    rows = [(n == "send", m["t_start_ns"] + st, m["t_start_ns"] + st + d)
            for m in trace.steps
            for k, n, g, st, d in zip(*(m["ops"][c] for c in _P2P_COLUMNS), strict=True)
            if k == "p2p" and g == UNKNOWN_GROUP]
    if not rows:
        return np.empty(0, dtype=bool), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    send, start, end = zip(*rows, strict=True)
    return (np.array(send, dtype=bool), np.array(start, dtype=np.int64),
            np.array(end, dtype=np.int64))


_P2P_COLUMNS = ("kind", "name", "group", "start_ns", "dur_ns")


def relabel(trace: RankTrace, threads: Mapping[str, str], transfers: list[str],
            streams: Mapping[str, tuple[str, int]] | None = None) -> None:
    """Give the ops with no group in the trace their inferred groups, and number them again
    per group: collectives by their thread (`threads`: thread → wire name; others become
    `pg.unknown`), p2p ops by `transfers` (one wire name each, in `p2p_posted` order), and
    an NCCL kernel by its stream (`streams`: stream → its group's wire name and, for a pair's
    stream, the peer a send goes to or a receive comes from; -1 for a collective's; a stream
    not there is the rank's own, whose instances no other rank's match)."""
    left = iter(transfers)
    lanes = streams or {}

    def inferred(kind: str, name: str, g: str) -> str:
        if (t := thread_of(g)) is not None:
            return threads.get(t, UNKNOWN_GROUP)
        if (s := stream_of(g)) is not None:
            wire, peer = lanes.get(s, (f"{UNKNOWN_GROUP}-r{trace.rank}-s{s}", -1))
            if kind != "p2p" or peer < 0 or name not in P2P_NAMES:
                return wire
            src, dst = (trace.rank, peer) if name == "send" else (peer, trace.rank)
            return f"{wire}.{src}-{dst}"
        if kind == "p2p" and g == UNKNOWN_GROUP:
            return next(left)
        return g

    for m in trace.steps:
        ops = m["ops"]
        groups = [inferred(k, n, g)
                  for k, n, g in zip(ops["kind"], ops["name"], ops["group"], strict=True)]
        if groups == ops["group"]:
            continue
        comm = [i for i, k in enumerate(ops["kind"]) if k != "compute"]
        for i, q in zip(comm, _seqs(m["step"], [groups[i] for i in comm]), strict=True):
            ops["seq"][i] = q
        ops["group"] = groups
