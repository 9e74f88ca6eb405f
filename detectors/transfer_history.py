"""Each transfer's own past: the reference for an instance its step cannot compare, and a
second opinion on one it can.

`network_suspects` compares an instance's transfer with the instances of the same signature
in the same step, so that a job-wide slowdown cancels. A small job, or a large one traced one
rank per tensor-parallel group, may run only two of a kind per step: two data-parallel
all-reduces across nodes, one pipeline send per micro-batch. Which of two is slow the step
cannot say; the instance's own past can. A NIC held to a tenth of its rate made every traced
transfer through it 50–500× its usual in such a drill, and it read as a job-wide shift.

Among few peers the step's own comparison is also fragile: the second micro-batch's send
waits behind the first's and is ×10 its peers' lower quartile in every step of a healthy
drill, which a pooled noise of a handful of instances calls significant. Such an instance is
not slow against its own past, so an instance with both must be slow against both.

An instance is known across steps by its group, op, size, the copies seen and its place among
its group's instances in the step. Its reference is the median of its last `depth` transfers,
its noise their MAD in log space, and its `top` the slowest of them (`OwnPast.slow`). One
call a step (`observe`) reads the past and adds the step to it.

What the past holds must stay healthy, or a fault becomes its own reference:
- a step is remembered `delay` steps late, and the steps still waiting are dropped while a
  network incident is open (`drop_recent`): a fault's first steps come before its incident;
- a transfer twice its past's slowest (`OwnPast.new`), or slow against both its past and its
  step's peers, is never remembered: a flapping NIC's bursts would become its instances'
  usual and hide the next ones (at 256 simulated GPUs traced one per tensor-parallel group,
  a ÷2 NIC's bursts were then named 2 steps later). Jitter's tail is learned all the same:
  a spike its peers show too, or within twice its past's slowest, is the job's own noise.

Only instances with fewer than `FEW_PEERS` of their signature in the step have a past: with
more, the step's own comparison is robust (and a past held to every instance of a 256-GPU
job, which learned its bursts, missed a third of the flapping NICs the step alone names).

Two data-parallel pairs on four nodes, one all-reduce each; the second pair's runs 40× its
usual:

>>> import numpy as np
>>> from detectors.features import step_features
>>> from detectors.network_suspects import reference_and_peers
>>> from detectors.testing import frame_of, rank_step
>>> def frame(slow):
...     def ops(r):
...         ms = slow if r % 2 else 10.0
...         return [("coll", "all_reduce", f"dp.{r % 2}", 1, 0.0, ms, 1 << 20)]
...     return frame_of([rank_step(r, f"n{r}", 0, ops(r)) for r in range(4)])
>>> history = TransferHistory(delay=0)
>>> for _ in range(6):
...     f = frame(10.0)
...     inst = step_features(f).inst
...     _ = history.observe(f, inst, *reference_and_peers(inst))
>>> f = frame(400.0)
>>> inst = step_features(f).inst
>>> own = history.observe(f, inst, *reference_and_peers(inst), learn=False)
>>> (own.ref * 1e3).round(1).tolist(), (inst.transfer_s / own.ref).round(1).tolist()
([10.0, 10.0], [1.0, 40.0])
>>> own.slow(inst.transfer_s).tolist()
[False, True]
"""

from __future__ import annotations

from collections import deque

import numpy as np

from detectors.base import Stateful
from detectors.evidence import WINDOW
from detectors.features import Instances
from detectors.network_suspects import OwnPast, slow_within_step, summarize_past
from schemas.frame import StepFrame

FEW_PEERS = 16  # instances of a signature in a step under which each has its own past
_MAX_KNOWN = 4096  # instances per step remembered at most: a bound on the per-step work
MIN_PAST = 5  # transfers of its own before an instance's past is a reference

InstanceKey = tuple[str, str, int, int, int]  # group, op, bytes, copies, place in its group


def with_few_peers(peers: np.ndarray) -> np.ndarray:
    """Indices of the comparable instances with fewer than `FEW_PEERS` of their signature in
    the step (`peers`: `network_suspects.reference_and_peers`)."""
    return np.flatnonzero((peers > 0) & (peers < FEW_PEERS))[:_MAX_KNOWN]


class TransferHistory(Stateful):
    """The last `depth` transfers of every comparable instance (module docstring), one row
    of a ring per instance."""

    def __init__(self, depth: int = 30, delay: int = WINDOW) -> None:
        self.depth = depth
        self.delay = delay
        self._recent: deque[tuple[list[InstanceKey], np.ndarray]] = deque()
        self._row: dict[InstanceKey, int] = {}
        self._ring = np.full((0, depth), np.nan)
        self._count = np.zeros(0, dtype=np.int64)

    def observe(self, frame: StepFrame, inst: Instances, ref: np.ndarray, peers: np.ndarray,
                learn: bool = True) -> OwnPast:
        """Each instance's own past (NaN for one with too little, or with many peers), and,
        when `learn`, this step's transfers remembered once `delay` more steps have come,
        but for those new to their past or slow against both it and their step's peers
        (`ref`, `peers`: `network_suspects.reference_and_peers`)."""
        idx = with_few_peers(peers)
        keys = _keys(frame, inst, idx)
        own = self._own_past(inst.transfer_s.size, idx, keys)
        if learn:
            t = inst.transfer_s
            unusual = (own.new(t) | (own.slow(t) & slow_within_step(t, ref)))[idx]
            kept = np.flatnonzero(~unusual)
            self._recent.append(([keys[i] for i in kept.tolist()], t[idx[kept]]))
            while len(self._recent) > self.delay:
                old_keys, values = self._recent.popleft()
                rows = self._rows(old_keys, add=True)
                self._ring[rows, self._count[rows] % self.depth] = values
                self._count[rows] += 1
        return own

    def drop_recent(self) -> None:
        """Forget the steps not yet remembered (a network incident is open: they may be its
        fault's)."""
        self._recent.clear()

    def _own_past(self, n: int, idx: np.ndarray, keys: list[InstanceKey]) -> OwnPast:
        own = OwnPast(*(np.full(n, np.nan) for _ in range(3)))
        if idx.size == 0 or not self._row:
            return own
        rows = self._rows(keys, add=False)
        known = rows >= 0
        rows, idx = rows[known], idx[known]
        enough = self._count[rows] >= MIN_PAST
        rows, idx = rows[enough], idx[enough]
        if rows.size == 0:
            return own
        own.ref[idx], own.sigma[idx], own.top[idx] = summarize_past(self._ring[rows])
        return own

    def _rows(self, keys: list[InstanceKey], add: bool) -> np.ndarray:
        """Each key's ring row; new keys get one when `add`, else -1."""
        if add:
            for k in keys:
                if k not in self._row:
                    self._row[k] = len(self._row)
            grow = len(self._row) - self._count.size
            if grow > 0:
                self._ring = np.vstack([self._ring, np.full((grow, self.depth), np.nan)])
                self._count = np.concatenate([self._count, np.zeros(grow, dtype=np.int64)])
        return np.array([self._row.get(k, -1) for k in keys], dtype=np.int64)


def _keys(frame: StepFrame, inst: Instances, idx: np.ndarray) -> list[InstanceKey]:
    """Each instance's name across steps; its place is its seq after its group's first in
    the step (seqs count on across steps, places do not)."""
    if idx.size == 0:
        return []
    first = np.full(len(frame.groups), np.iinfo(np.int64).max)
    np.minimum.at(first, inst.group[idx], inst.seq[idx])
    place = inst.seq[idx] - first[inst.group[idx]]
    return [
        (frame.groups[g], frame.names[n], b, c, p)
        for g, n, b, c, p in zip(
            inst.group[idx].tolist(), inst.name[idx].tolist(), inst.bytes[idx].tolist(),
            inst.n_copies[idx].tolist(), place.tolist(), strict=True,
        )
    ]
