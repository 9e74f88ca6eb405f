"""Stage 2 of one job across workers: merge its shards' assembled steps into the job's step.

Past one worker for one job (issue #17), stage 1 assembles each shard of a job's ranks (the
ranks `shard * shard_ranks` up to the next shard's) on whichever worker holds that shard's
partition, and sends the shard's `StepFrame` on (`schemas.partial_frame`). Stage 2 holds the
job: it waits for every shard of a step as the step assembler waits for every rank, with the
same grace in the job's own step times, and concatenates them. A shard that never reports
(its agents down, its stage-1 worker restarting past the grace) leaves its known ranks
`missing`, exactly as a rank that never reports does in one worker.

The merged frame is the one a single worker would have assembled from the same messages,
field by field, codes included: each shard's frame is sorted and has its stalls split
already (both are per rank), shards are merged in rank order, and the shards' string tables
are interned in that order, which is the order of first appearance one worker interns in.
`tests/unit/detectors/test_shard_merge.py` checks it on simulated jobs.

Two shards of two ranks each; step 0 is whole once both shards sent it:

>>> from detectors.assembly import StepAssembler
>>> from detectors.testing import rank_step
>>> from schemas.partial_frame import GONE, PartialFrame
>>> t0 = 10**18
>>> def shard_frame(shard):
...     asm = StepAssembler("j")
...     ops = [("compute", "fwd", "", 0, 0.0, 10.0 + shard, 0),
...            ("coll", "all_reduce", "dp.0", 1, 12.0, 5.0, 64)]
...     for r in (2 * shard, 2 * shard + 1):
...         asm.add(rank_step(r, f"n{shard}", 0, ops, t0_ns=t0), t0)
...     return PartialFrame(shard, 2, asm.flush()[0])
>>> merger = ShardMerger("j")
>>> merger.world_size = 4
>>> merger.add_partial(shard_frame(1), t0)
[]
>>> [f] = merger.add_partial(shard_frame(0), t0)
>>> f.rank.tolist(), f.nodes, f.off.tolist(), f.missing.tolist()
([0, 1, 2, 3], ['n0', 'n1'], [0, 2, 4, 6, 8], [])
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np

from detectors.assembly import PendingSteps
from schemas.frame import StepFrame
from schemas.partial_frame import GONE, PartialFrame

# Steps held while a shard's stage 1 lags (its watermark says its step is on its way):
# stage-1 workers drain a backlog at different rates, and a job's step leaving without a
# shard that lags would read its ranks as missing. Four times the step assembler's bound.
MAX_PENDING = 32


class ShardMerger(PendingSteps):
    """Pending steps of one job as shards' frames; emits the job's StepFrames in step order.

    Pieces are keyed by shard; `known` holds the shards that ever reported, and `seen` every
    rank any shard reported or listed missing."""

    def __init__(self, job: str, grace_s: float = 5.0, max_pending: int = MAX_PENDING,
                 grace_steps: float = 0.5) -> None:
        super().__init__(job, grace_s=grace_s, max_pending=max_pending, grace_steps=grace_steps)
        self.shard_ranks = 0  # ranks per shard, as the shards' frames say
        self.seen = np.zeros(0, dtype=bool)  # rank → ever reported or listed missing
        self.marks: dict[int, int] = {}  # shard → its stage 1's watermark (when it sends one)
        self.absent: set[int] = set()  # shards of the world given up on: none of it is traced

    def add_partial(self, part: PartialFrame, now_ns: int) -> list[StepFrame]:
        """Take one shard's step; return the job's frames this completed (usually 0 or 1)."""
        f = part.frame
        self.shard_ranks = part.shard_ranks
        if part.watermark_ns == GONE:
            self.marks.pop(part.shard, None)  # its stage 1 let it go: nothing more is coming
            self.absent.add(part.shard)
        elif part.watermark_ns > self.marks.get(part.shard, 0):
            self.marks[part.shard] = part.watermark_ns
            self.absent.discard(part.shard)
        if f.n_ranks == 0:
            return self.advance(now_ns)  # a watermark alone
        pending = self.pending.get(f.step)
        kept = pending.msgs.get(part.shard) if pending is not None else None
        if kept is not None and kept.frame.n_ranks > f.n_ranks:
            return self.advance(now_ns)  # a restarted stage 1 sent the step again, in part
        span = int((f.t_end_ns - f.t_start_ns).max())
        return self._take(f.step, part.shard, part, span, now_ns)

    def advance(self, now_ns: int) -> list[StepFrame]:
        """Steps whose grace is over leave, by the slowest shard's watermark: a shard whose
        stage 1 lags is waited for (its step is on its way); one whose ranks are silent is
        not, since its stage 1 moves its watermark on by its clock. Without watermarks (stage
        1 played in one process), by `now_ns`, as the step assembler does."""
        if self.marks:
            unheard = self._unheard()
            if unheard and len(self.pending) > self.max_pending:
                self.absent |= unheard  # waited long enough: nothing of it is traced
                unheard = set()
            # a shard not heard from yet may be one whose stage 1 lags: no step leaves by time
            now_ns = -1 if unheard else min(now_ns, min(self.marks.values()))
        return super().advance(now_ns)

    def _shards(self) -> int:
        """How many shards the job's world has (0: its start did not say)."""
        if self.world_size and self.shard_ranks:
            return -(-self.world_size // self.shard_ranks)
        return 0

    def _unheard(self) -> set[int]:
        """Shards of the world with no watermark yet, not given up on."""
        return set(range(self._shards())) - self.marks.keys() - self.absent

    def _expected(self) -> int:
        """Every shard of the job's world (when its start said it) but those given up on,
        else every shard seen."""
        return self._shards() - len(self.absent) if self._shards() else len(self.known)

    def _mark_seen(self, ranks: np.ndarray) -> None:
        if ranks.size == 0:
            return
        top = int(ranks.max()) + 1
        if top > self.seen.size:
            self.seen = np.concatenate((self.seen, np.zeros(top - self.seen.size, dtype=bool)))
        self.seen[ranks] = True

    def _frame(self, step: int, msgs: dict[int, Any]) -> StepFrame:
        parts = [msgs[s].frame for s in sorted(msgs)]
        for f in parts:
            self._mark_seen(f.rank)
            self._mark_seen(f.missing)
        name_of = [self.names.codes(f.names) for f in parts]
        group_of = [self.groups.codes(f.groups) for f in parts]
        node_of = [self.nodes.codes(f.nodes) for f in parts]
        rank = np.concatenate([f.rank for f in parts]).astype(np.int64, copy=False)
        present = np.zeros(self.seen.size, dtype=bool)
        present[rank] = True
        counts = np.concatenate([np.diff(f.off) for f in parts])
        off = np.zeros(rank.size + 1, dtype=np.int64)
        np.cumsum(counts, out=off[1:])
        first_rank = np.cumsum([0] + [f.n_ranks for f in parts[:-1]])

        def cat(field: str, dtype: type) -> np.ndarray:
            return np.concatenate([getattr(f, field) for f in parts]).astype(dtype, copy=False)

        def coded(field: str, tables: list[np.ndarray]) -> np.ndarray:
            return np.concatenate([t[getattr(f, field)] for f, t in zip(parts, tables,
                                                                      strict=True)])

        return StepFrame(
            job=self.job,
            step=step,
            rank=rank,
            node=coded("node", node_of).astype(np.int32, copy=False),
            nodes=self.nodes.table,
            local_rank=cat("local_rank", np.int32),
            coords=np.concatenate([f.coords for f in parts]).astype(np.int32, copy=False),
            t_start_ns=cat("t_start_ns", np.int64),
            t_end_ns=cat("t_end_ns", np.int64),
            off=off,
            op_kind=cat("op_kind", np.uint8),
            op_name=coded("op_name", name_of).astype(np.int32, copy=False),
            op_group=coded("op_group", group_of).astype(np.int32, copy=False),
            op_seq=cat("op_seq", np.int64),
            op_start_ns=cat("op_start_ns", np.int64),
            op_dur_ns=cat("op_dur_ns", np.int64),
            op_bytes=cat("op_bytes", np.int64),
            names=self.names.table,
            groups=self.groups.table,
            missing=np.flatnonzero(self.seen & ~present).astype(np.int64),
            stall_rank=np.concatenate([f.stall_rank + first for f, first in
                                       zip(parts, first_rank, strict=True)]).astype(np.int64),
            stall_name=coded("stall_name", name_of).astype(np.int32, copy=False),
            stall_ns=cat("stall_ns", np.int64),
        )


class CodedNames(Sequence[str]):
    """A rank's op groups (or names) read through their codes, without building the list.

    The hang detector keeps each rank's newest ops as a sequence of group names; a shard's
    frame holds them as codes into its table, and a list per rank would cost stage 2 a
    Python string per op of the job every step.

    >>> groups = CodedNames(np.array([1, 0, 1]), ["", "dp.0"])
    >>> groups[0], list(groups), len(groups[1:])
    ('dp.0', ['dp.0', '', 'dp.0'], 2)
    """

    __slots__ = ("codes", "table")

    def __init__(self, codes: np.ndarray, table: Sequence[str]) -> None:
        self.codes = codes
        self.table = table

    def __len__(self) -> int:
        return int(self.codes.size)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return CodedNames(self.codes[i], self.table)
        return self.table[int(self.codes[i])]

    def __iter__(self) -> Iterator[str]:
        table = self.table
        return (table[c] for c in self.codes.tolist())
