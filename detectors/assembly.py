"""Step assembly: gather one job's rank-step messages into whole-step frames.

A step is complete when every known rank reported, or when its grace period (stream time)
expired: a missing rank is evidence (slow or hung), never a reason to wait forever. The grace
is measured in the job's own units: a fraction of its recent step time (or, before the first
step, of the step the received ranks took), never less than a floor, so a 60 s step waits for
a rank 6 s behind the first while a 0.5 s step does not hold the stream for seconds. Steps
leave in order. Names and groups are interned in job-level tables, so codes are stable across
steps and a rank whose op names repeat step after step is interned once.

A job of two ranks (its start event said so); step 0 is whole once both reported, step 1
(rank 1 silent) leaves when its grace period is over, with rank 1 missing:

>>> from detectors.testing import rank_step
>>> asm = StepAssembler("j", grace_s=5.0)
>>> asm.world_size = 2
>>> t0 = 10**18
>>> asm.add(rank_step(0, "n0", 0, [], t0_ns=t0), t0)
[]
>>> [f.step for f in asm.add(rank_step(1, "n0", 0, [], t0_ns=t0), t0)]
[0]
>>> asm.add(rank_step(0, "n0", 1, [], t0_ns=t0), t0 + 1 * NS_PER_S)
[]
>>> [(f.step, f.missing.tolist()) for f in asm.advance(t0 + 7 * NS_PER_S)]
[(1, [1])]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from detectors.base import Stateful
from detectors.stalls import split_stalls
from schemas.clock import NS_PER_S
from schemas.frame import StepFrame
from schemas.rankstep import COORD_DIMS, RankStep


@dataclass(slots=True)
class _Pending:
    first_seen_ns: int
    msgs: dict[int, Any] = field(default_factory=dict)  # rank → RankStep, or shard → frame
    span_ns: int = 0  # longest step window among the ranks received


class Interner:
    """Job-level string table: code of a string never changes."""

    def __init__(self, first: str | None = None) -> None:
        self.table: list[str] = []
        self.index: dict[str, int] = {}
        if first is not None:
            self.code(first)

    def code(self, s: str) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.table)
            self.table.append(s)
        return i

    def codes(self, items: Sequence[str]) -> np.ndarray:
        """The codes of `items`; strings new to the table get theirs in order of first
        appearance. The lookups run in C (`map` over the dict's `__getitem__`): a job's
        first step interns every rank's ~830 names and groups, ~14 M strings at 16,384 GPUs."""
        idx = self.index
        try:
            return np.fromiter(map(idx.__getitem__, items), dtype=np.int32, count=len(items))
        except KeyError:
            for s in dict.fromkeys(items):  # distinct, in order of first appearance
                if s not in idx:
                    idx[s] = len(self.table)
                    self.table.append(s)
        return np.fromiter(map(idx.__getitem__, items), dtype=np.int32, count=len(items))


class PendingSteps(Stateful):
    """Pending steps of one job, each gathered from pieces; emits StepFrames in step order.

    The waiting (a step leaves whole, or when its grace is over) is the same whether the
    pieces are ranks' messages (`StepAssembler`) or shards' frames (`shard_merge`); only
    how pieces make a frame differs (`_frame`). `max_pending` bounds memory when a rank
    stops for good: the oldest step leaves once that many are waiting, even before its grace
    period is over."""

    def __init__(
        self, job: str, grace_s: float = 5.0, max_pending: int = 8, grace_steps: float = 0.5
    ) -> None:
        self.job = job
        self.grace_ns = int(grace_s * NS_PER_S)  # floor
        self.grace_steps = grace_steps  # the grace in step times
        self.step_ns = 0  # the job's recent step time (`set_step_time`)
        self.max_pending = max_pending
        self.world_size: int | None = None
        self.known: set[int] = set()
        self.pending: dict[int, _Pending] = {}
        self.emitted_upto = -1
        self.late_dropped = 0
        self.names = Interner()
        self.groups = Interner("")
        self.nodes = Interner()

    def _take(self, step: int, key: int, piece: Any, span_ns: int, now_ns: int
              ) -> list[StepFrame]:
        """File `piece` (a rank's message, or a shard's frame) under `key` in its step."""
        if step <= self.emitted_upto:
            self.late_dropped += 1
            return []
        self.known.add(key)
        p = self.pending.get(step)
        if p is None:
            p = self.pending[step] = _Pending(now_ns)
        p.msgs[key] = piece
        p.span_ns = max(p.span_ns, span_ns)
        return self.advance(now_ns)

    def _expected(self) -> int:
        """How many pieces make a step whole: the job's ranks (by its start, else seen)."""
        return self.world_size or len(self.known)

    def held_since_ns(self) -> int | None:
        """Stream time the oldest pending step began to wait (None: nothing pending): what
        this assembler has not yet passed on starts no earlier."""
        return min((p.first_seen_ns for p in self.pending.values()), default=None)

    def set_step_time(self, seconds: float) -> None:
        """The job's recent step time, which the grace period scales with."""
        if seconds > 0 and np.isfinite(seconds):
            self.step_ns = int(seconds * NS_PER_S)

    def _grace(self, p: _Pending) -> float:
        return max(self.grace_ns, self.grace_steps * max(self.step_ns, p.span_ns))

    def advance(self, now_ns: int) -> list[StepFrame]:
        out = []
        while self.pending:
            s = min(self.pending)
            p = self.pending[s]
            complete = len(p.msgs) >= self._expected() and (
                self.world_size is not None or self.emitted_upto >= 0 or len(self.pending) > 1
            )
            expired = now_ns - p.first_seen_ns > self._grace(p)
            if not (complete or expired or len(self.pending) > self.max_pending):
                break
            del self.pending[s]
            self.emitted_upto = s
            out.append(self._frame(s, p.msgs))
        return out

    def flush(self) -> list[StepFrame]:
        out = []
        for s in sorted(self.pending):
            out.append(self._frame(s, self.pending[s].msgs))
            self.emitted_upto = s
        self.pending.clear()
        return out

    def _frame(self, step: int, msgs: dict[int, Any]) -> StepFrame:
        raise NotImplementedError


class StepAssembler(PendingSteps):
    """Pending steps of one job as its ranks' messages; emits StepFrames in step order."""

    def __init__(
        self, job: str, grace_s: float = 5.0, max_pending: int = 8, grace_steps: float = 0.5
    ) -> None:
        super().__init__(job, grace_s=grace_s, max_pending=max_pending, grace_steps=grace_steps)
        self._cache: dict[int, tuple[Sequence[str], np.ndarray, Sequence[str], np.ndarray]] = {}

    def add(self, msg: RankStep, now_ns: int) -> list[StepFrame]:
        """Take one message; return the frames this completed (usually zero or one)."""
        return self._take(msg.step, msg.rank, msg, msg.t_end_ns - msg.t_start_ns, now_ns)

    def _codes(self, m: RankStep) -> tuple[np.ndarray, np.ndarray]:
        c = self._cache.get(m.rank)
        if c is not None and (c[0] is m.name or c[0] == m.name) and (
            c[2] is m.group or c[2] == m.group
        ):
            return c[1], c[3]
        nc = self.names.codes(m.name)
        gc = self.groups.codes(m.group)
        self._cache[m.rank] = (m.name, nc, m.group, gc)
        return nc, gc

    def _frame(self, step: int, msgs: dict[int, Any]) -> StepFrame:
        ranks = sorted(msgs)
        ms = [msgs[r] for r in ranks]
        R = len(ms)
        counts = np.fromiter((m.n_ops for m in ms), dtype=np.int64, count=R)
        off = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(counts, out=off[1:])
        coords = np.full((R, len(COORD_DIMS)), -1, dtype=np.int32)
        for i, m in enumerate(ms):
            for d, v in m.coords.items():
                if d in COORD_DIMS:
                    coords[i, COORD_DIMS.index(d)] = v
        codes = [self._codes(m) for m in ms]

        def cat(arrs: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(arrs).astype(dtype, copy=False) if arrs else np.zeros(0, dtype)

        start = cat([m.start_ns for m in ms], np.int64)
        frame = StepFrame(
            job=self.job,
            step=step,
            rank=np.array(ranks, dtype=np.int64),
            node=np.array([self.nodes.code(m.node) for m in ms], dtype=np.int32),
            nodes=self.nodes.table,
            local_rank=np.array([m.local_rank for m in ms], dtype=np.int32),
            coords=coords,
            t_start_ns=np.array([m.t_start_ns for m in ms], dtype=np.int64),
            t_end_ns=np.array([m.t_end_ns for m in ms], dtype=np.int64),
            off=off,
            op_kind=cat([m.kind for m in ms], np.uint8),
            op_name=cat([c[0] for c in codes], np.int32),
            op_group=cat([c[1] for c in codes], np.int32),
            op_seq=cat([m.seq for m in ms], np.int64),
            op_start_ns=start,
            op_dur_ns=cat([m.dur_ns for m in ms], np.int64),
            op_bytes=cat([m.bytes for m in ms], np.int64),
            names=self.names.table,
            groups=self.groups.table,
            missing=np.array(sorted(self.known - set(ranks)), dtype=np.int64),
        )
        return split_stalls(sort_ops(frame))


def sort_ops(frame: StepFrame) -> StepFrame:
    """Ensure each rank's ops are in start order (producers may emit completion order).

    Checked in one pass over the starts: a step back counts only inside a rank (the first
    op of the next rank starts again near 0)."""
    n = frame.n_ops
    if n < 2:
        return frame
    st = frame.op_start_ns
    back = st[1:] < st[:-1]
    last = frame.off[1:-1] - 1  # each rank's last row, followed by the next rank's first
    back[last[(last >= 0) & (last < n - 1)]] = False
    if not back.any():
        return frame
    order = np.lexsort((st, frame.op_rank_index()))
    for f in ("op_kind", "op_name", "op_group", "op_seq", "op_start_ns", "op_dur_ns", "op_bytes"):
        setattr(frame, f, getattr(frame, f)[order])
    return frame
