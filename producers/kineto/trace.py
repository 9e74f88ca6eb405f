"""One rank's Kineto (PyTorch profiler) trace → that rank's wire-v1 steps messages.

Steps are the `ProfilerStep#N` spans of the CPU timeline. Communication ops are taken from
the best source a trace has, because the generations differ:
1. NCCL kernels on the GPU timeline: the real duration of a collective (including the wait
   for late peers); recent traces put the collective's args (name, process group, sizes) on
   the kernel itself, older ones are paired in order with the CPU-side `nccl:*` annotations.
2. `gloo:*` annotations of gloo's worker threads (CPU training): the execution of each op,
   paired in order, per name, with the `c10d::*` call on the training thread that issued it.
3. Otherwise the CPU-side `record_param_comms`, `c10d::*` or `nccl:*` events themselves.
An op belongs to the step in which it was issued (the kernel's CPU launch, the c10d call), even
when the GPU runs it after the step's CPU span has closed.

Compute: on GPU traces one `gpu_compute` op per step, the summed duration of the step's
non-NCCL kernels (the NVRx-style compute signal); on CPU traces `fwd`, `bwd` and `optimizer`
phases from the autograd engine's events and the optimizer's annotations.

`seq` is `(step << 20) | i`, the i-th op of the group in profiler step `step`: monotone and
equal on every rank that issued the same ops, even when ranks' traces cover different steps.
"""

from __future__ import annotations

import re
from collections import defaultdict, deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from producers.kineto.names import (
    P2P_NAMES,
    UNKNOWN_GROUP,
    canonical,
    comm_event_name,
    group_name,
    is_nccl_kernel,
    message_bytes,
)
from schemas.steps_message import steps_message

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_SEQ_SHIFT = 20


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
            corr = (k.get("args") or {}).get("correlation")
            anchor = ev.launches.get(corr, src["ts"] if paired else k["ts"])
            ops.append(_op_from(k, wire or "sendrecv", args, clock, anchor))
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
            ops.append(_op_from(g, wire, args, clock, call["ts"] if call else g["ts"]))
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
            ops.append(Op("compute", "gpu_compute", "", clock.ns(k["ts"]), clock.dur(k), 0,
                          clock.ns(anchor)))
        return ops
    for name, lst in (("fwd", ev.fwd), ("bwd", ev.bwd), ("optimizer", ev.opt)):
        for e in lst:
            t = clock.ns(e["ts"])
            ops.append(Op("compute", name, "", t, clock.dur(e), 0, t))
    return ops


def _merge_compute(ops: list[Op], t0: int) -> list[Op]:
    """One op per compute name in a step: `bwd` as the span of the autograd engine's events
    (they nest and overlap), `fwd` before it when no annotation marks the forward, the others
    as summed busy time starting at their first event."""
    by: dict[str, list[Op]] = defaultdict(list)
    for o in ops:
        by[o.name].append(o)
    out: list[Op] = []
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


@dataclass(slots=True)
class RankTrace:
    rank: int
    world_size: int
    node: str
    local_rank: int
    steps: list[dict[str, Any]]


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
    for op in _comm_ops(ev, clock) + _compute_ops(ev, clock):
        i = int(np.searchsorted(t0s, op.anchor_ns, side="right")) - 1
        if i >= 0 and op.anchor_ns <= t1s[i]:
            per_step[i].append(op)

    messages = []
    for (step_no, _a, _b), t0, t1, ops in zip(ev.steps, t0s.tolist(), t1s.tolist(), per_step,
                                              strict=True):
        comm = sorted((o for o in ops if o.kind != "compute"), key=lambda o: o.start_ns)
        compute = _merge_compute([o for o in ops if o.kind == "compute"], t0)
        counters: dict[str, int] = defaultdict(int)
        seqs = []
        for o in comm:
            seqs.append((step_no << _SEQ_SHIFT) | counters[o.group])
            counters[o.group] += 1
        seqs += list(range(len(compute)))
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
    return RankTrace(rank, world, node, local, messages)
