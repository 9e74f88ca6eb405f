"""The per-rank op log of the torch hook: one row per op, cut into steps, built into v1 JSON.

The hot path (one collective call) only appends a small row to the current step's rows and
notes it as pending; everything costly (columns, offsets, JSON) happens once per step, off the
training thread, in `steps_message` (through the one v1 builder, `schemas.steps_message`). A row is
``[kind, name, group, seq, start_ns, end_ns, bytes, blocks]`` with ``end_ns == -1`` while the op
is in flight, so the in-flight table that makes heartbeats is just the pending rows.

A row is a list (`Row`, from `begin`) when something ends it later or elsewhere (phases,
stalls, p2p, async and GPU-timed ops), and a tuple (`Done`) for a synchronous collective on the
CPU path, which the hot path puts in its slot when the call returns (`seal`). Why: a step's
rows live until it ends, and the interpreter's cyclic GC walks every live list at each
collection of the generation holding it, older ones included, so with lists the cost per op
grew with the ops per step (1-1.4 µs at 10,000, against 0.6 at 1,000). The collector stops
tracking a tuple of strs and ints the first time it looks at it (its next young collection):
one look per op, whatever the size of the step, and never the user's GC settings touched.
Readers index rows either way (`Op`) and never mutate one they did not begin. `blocks`
says the training thread sat in the op until it ended (a synchronous collective or send/recv,
or a named host stall, `stalls`): a compute phase timed around such a call did not compute
meanwhile, so the message carries the phase without it (`exclusive_compute`).

With GPU timing (`gpu_timing`), the sender replaces the host times of the rows the GPU timed
and appends each row's issue latency (``ISSUE``, -1 without a GPU measure) before the columns
are built; the hot path's rows are never longer.
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from schemas.rankstep import HOST_STALL_PREFIX
from schemas.steps_message import steps_message as build_steps_message

KIND, NAME, GROUP, SEQ, START, END, NBYTES, BLOCKS = range(8)
ISSUE = 8  # only in the rows `steps_message` builds from GPU times
COMPUTE, COLL, P2P = "compute", "coll", "p2p"
MAX_INFLIGHT_REPORTED = 256

Row = list[Any]  # an op something ends later (`OpLog.end`)
Done = tuple[Any, ...]  # a synchronous collective's row once its call returned
Op = Sequence[Any]  # either, as readers see a step's rows


@dataclass(slots=True)
class RankMeta:
    """Who the rank is: fixed for a message, learnt lazily (dist may initialise after install)."""

    job: str
    rank: int
    node: str
    local_rank: int = 0
    world_size: int = 0
    coords: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class StepCut:
    """One finished step handed from the training thread to the sender."""

    step: int
    t_start_ns: int
    boundary_ns: int
    rows: list[Op]
    gpu: list[Any] | None = None  # the step's `gpu_timing.GpuSpan`s, resolved by the sender


class OpLog:
    """Rows of the current step, ops still in flight, and the step counter of one rank.

    Shared by the training thread (begin/end/cut) and the completion callbacks of async ops
    (end); each mutation is a single list or dict operation, atomic under the GIL.
    """

    __slots__ = ("rows_ref", "pending", "clock", "step", "step_t0", "ops_cut")

    def __init__(self, clock: Callable[[], int] = time.time_ns, first_step: int = 0) -> None:
        self.clock = clock
        # The current step's rows, behind one level of indirection so the hot path can bind
        # the holder once and `cut` can swap the list in a single (GIL-atomic) store.
        self.rows_ref: list[list[Op]] = [[]]
        self.pending: dict[int, Op] = {}
        self.step = first_step
        self.step_t0 = clock()
        self.ops_cut = 0  # ops handed over in finished steps so far

    @property
    def rows(self) -> list[Op]:
        return self.rows_ref[0]

    def begin(self, kind: str, name: str, group: str, seq: int, nbytes: int,
              blocks: bool = False) -> Row:
        row = [kind, name, group, seq, self.clock(), -1, nbytes, blocks]
        self.rows_ref[0].append(row)
        self.pending[id(row)] = row
        return row

    def end(self, row: Row) -> None:
        if row[END] < 0:
            row[END] = self.clock()
        self.pending.pop(id(row), None)

    def cut(self) -> StepCut:
        """Close the current step at now; the next step's window starts here."""
        now = self.clock()
        rows = self.rows_ref[0]
        self.rows_ref[0] = []
        self.ops_cut += len(rows)
        out = StepCut(self.step, self.step_t0, now, rows)
        self.step += 1
        self.step_t0 = now
        return out

    def inflight(self) -> dict[str, Any]:
        """The in-flight table: communication ops and named host stalls started and not
        finished (oldest first). A stall is there so that a rank saving a long checkpoint
        shows it is working, not stopped, while its peers wait for it."""
        rows = [r for r in list(self.pending.values())
                if r[END] < 0 and (r[KIND] != COMPUTE or r[NAME].startswith(HOST_STALL_PREFIX))]
        rows.sort(key=lambda r: r[START])
        return {
            "step": self.step,
            "inflight": [
                {"group": r[GROUP], "name": r[NAME], "seq": r[SEQ], "start_ns": r[START]}
                for r in rows[:MAX_INFLIGHT_REPORTED]
            ],
        }


def seal(step: list[Op], row: Op, done: Done) -> None:
    """Put `done` in the slot of in-flight `row` (by identity, searched from the end).

    The hot path replaces the last row itself, and comes here only when rows were logged
    during the call (a GC stall, another thread's ops): the search then passes over just
    those. Never raises (it runs after the user's collective returned); a row it cannot find
    (nobody removes rows) stays in flight.
    """
    for i in range(len(step) - 1, -1, -1):
        if step[i] is row:
            step[i] = done
            return


def steps_message(meta: RankMeta, cut: StepCut, now_ns: int,
                  gpu: Mapping[int, tuple[int, int, int]] | None = None) -> dict[str, Any]:
    """The wire-v1 steps object of one cut step (numpy columns, orjson serialises them).

    Ops still in flight at send time get the duration they have had so far (a lower bound);
    the in-flight table keeps reporting them until they finish. Compute ops are numbered
    within the step, as the contract says. `gpu` (from `GpuTimer.resolve`: row id → GPU
    start, end and issue latency in host ns) replaces the times of the rows it names, and the
    message then carries `issue_ns` (-1 for every other op); without it, no such column.
    """
    rows = cut.rows
    if gpu is not None:
        rows = [[*r[:START], t[0], t[1], *r[END + 1:], t[2]] if (t := gpu.get(id(r)))
                else [*r, -1] for r in rows]
    rows = exclusive_compute(rows)
    n = len(rows)
    if n == 0:
        return build_steps_message(
            job=meta.job, rank=meta.rank, node=meta.node, local_rank=meta.local_rank,
            step=cut.step, coords=meta.coords, t_start_ns=cut.t_start_ns,
            t_end_ns=cut.boundary_ns, kind=[], name=[], group=[], seq=[], start_ns=[],
            dur_ns=[], bytes=[],
        )
    kind, name, group, seq, start, end, nbytes, _, *issue = (
        list(c) for c in zip(*rows, strict=True))
    start_a = np.fromiter(start, dtype=np.int64, count=n)
    end_a = np.fromiter(end, dtype=np.int64, count=n)
    end_a = np.where(end_a < 0, max(now_ns, cut.boundary_ns), end_a)
    end_a = np.maximum(end_a, start_a)
    t0 = min(cut.t_start_ns, int(start_a.min()))
    is_compute = np.fromiter((k == COMPUTE for k in kind), dtype=bool, count=n)
    seq_a = np.fromiter(seq, dtype=np.int64, count=n)
    seq_a[is_compute] = np.arange(int(is_compute.sum()), dtype=np.int64)
    return build_steps_message(
        job=meta.job, rank=meta.rank, node=meta.node, local_rank=meta.local_rank,
        step=cut.step, coords=meta.coords, t_start_ns=t0, t_end_ns=int(end_a.max()),
        kind=kind, name=name, group=group, seq=seq_a, start_ns=start_a - t0,
        dur_ns=end_a - start_a, bytes=np.fromiter(nbytes, dtype=np.int64, count=n),
        issue_ns=np.fromiter(issue[0], dtype=np.int64, count=n) if issue else None,
    )


def exclusive_compute(rows: list[Op]) -> list[Op]:
    """`rows` with every compute phase cut around the blocking ops that ran inside it.

    A phase is timed by module hooks around everything the thread did, and a tensor-parallel
    forward calls its all-reduce from inside: timed whole, the forward of every rank of the
    group includes the wait for its slowest member, and one slow rank reads as a slow node.
    The thread computed only outside its blocking calls, so the phase becomes the pieces
    between them (same name; the step's compute total is then what was computed). Async ops
    run beside the thread and cut nothing. A named host stall (`host:<what>`, also blocking)
    cuts the phases around it, and is itself never cut: it is a wait, not a phase. Only the
    piece that starts where the phase did keeps its issue latency (``ISSUE``, when present).

    >>> fwd = ["compute", "fwd", "", -1, 0, 100, 0, False]
    >>> ar = ["coll", "all_reduce", "tp.0", 3, 40, 90, 64, True]
    >>> [(r[1], r[4], r[5]) for r in exclusive_compute([fwd, ar])]
    [('fwd', 0, 40), ('all_reduce', 40, 90), ('fwd', 90, 100)]
    """
    waits = sorted((r[START], r[END]) for r in rows if r[BLOCKS] and r[END] >= 0)
    if not waits:
        return rows
    # The waits as disjoint spans in time order (a GC inside a checkpoint save is one span):
    # each phase then finds the first span it meets by bisection instead of scanning them all.
    # An end before its start (the wall clock stepped back) is read as an instant.
    starts: list[int] = []
    ends: list[int] = []
    for s, e in waits:
        if ends and s <= ends[-1]:
            ends[-1] = max(ends[-1], e)
        else:
            starts.append(s)
            ends.append(max(s, e))
    out: list[Op] = []
    for r in rows:
        if r[KIND] != COMPUTE or r[END] < 0 or r[NAME].startswith(HOST_STALL_PREFIX):
            out.append(r)
            continue
        at, stop = r[START], r[END]
        pieces: list[Row] = []
        i = bisect_right(ends, at)
        while i < len(starts) and starts[i] < stop:
            if starts[i] > at:
                pieces.append([*r[:START], at, starts[i], *r[END + 1:]])
            at = max(at, ends[i])
            i += 1
        if at < stop:
            pieces.append([*r[:START], at, stop, *r[END + 1:]])
        if len(r) > ISSUE:
            for piece in pieces:
                if piece[START] != r[START]:
                    piece[ISSUE] = -1
        out.extend(pieces)
    out.sort(key=lambda r: r[START])
    return out


def encode(msg: Mapping[str, Any]) -> bytes:
    return orjson.dumps(msg, option=orjson.OPT_SERIALIZE_NUMPY)
