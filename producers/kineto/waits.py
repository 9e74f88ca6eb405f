"""A CPU training thread's waits on communication, cut out of its compute phases.

Why: a trace's forward and backward are spans of everything the training thread did, and a
tensor-parallel layer calls its all-reduce from inside them. Timed whole, the phase of every
member of the group holds the wait for its slowest member, and one slow rank reads as two
(a drill's CPU-starved rank and its tensor-parallel peer both "computed" 50-70% slower).
The hook cuts its phases around its blocking calls (`torch_hook.buffer.exclusive_compute`);
a trace says which calls blocked by what the thread did meanwhile.

A communication op blocked the thread when the thread ran (almost) nothing while it was in
flight: its leaf events (the innermost ones: `aten::mm`, not the autograd function around
it) cover less than half of the op. An asynchronous all-reduce beside the backward (DDP's
buckets) overlaps the backward's own kernels and cuts nothing. A phase's compute is its span
cut around the blocked time inside it, as the hook's are.

>>> spans = [(1, 0.0, 100.0, False),              # the backward's autograd function
...          (1, 0.0, 40.0, False),               #   aten::mm, a leaf
...          (1, 40.0, 2.0, True),                #   the all-reduce's call
...          (1, 90.0, 10.0, False)]              #   aten::mul, a leaf
>>> busy = Leaves.of(spans, tid=1, ns=lambda us: int(us * 1000))
>>> waits = blocked([(42_000, 90_000)], busy)     # the all-reduce ran while the thread idled
>>> pieces(0, 100_000, waits)                     # 100 µs of backward, 48 µs of waiting
[(0, 42000), (90000, 100000)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

BLOCKED_BELOW = 0.5  # a comm op blocked the thread when its leaves cover less of it


@dataclass(frozen=True, slots=True)
class Leaves:
    """One thread's innermost non-communication events, disjoint and in time order (ns)."""

    start: np.ndarray
    end: np.ndarray
    _cum: np.ndarray  # prefix sums of their durations

    @staticmethod
    def of(spans: Iterable[tuple[Any, float, float, bool]], tid: Any,
           ns: Callable[[float], int]) -> Leaves:
        """From (tid, ts µs, dur µs, is communication) spans. Events of one thread nest:
        sorted by start, a parent before a child that starts with it, an event is a leaf
        when the next one starts at or after its end."""
        rows = [(ns(ts), ns(ts + dur), comm) for t, ts, dur, comm in spans if t == tid]
        if not rows:
            empty = np.empty(0, dtype=np.int64)
            return Leaves(empty, empty, np.zeros(1, dtype=np.int64))
        a, b, comm = (np.array(col) for col in zip(*rows, strict=True))
        order = np.lexsort((-b, a))  # by start; the longer (the parent) first
        a, b, comm = a[order].astype(np.int64), b[order].astype(np.int64), comm[order]
        leaf = np.ones(a.size, dtype=bool)
        leaf[:-1] = a[1:] >= b[:-1]
        keep = leaf & ~comm
        a, b = a[keep], b[keep]
        return Leaves(a, b, np.concatenate([[0], np.cumsum(b - a)]))

    def busy(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Time the leaves cover inside each [lo, hi)."""
        if self.start.size == 0:
            return np.zeros(np.shape(lo), dtype=np.int64)
        i0 = np.searchsorted(self.end, lo, side="right")  # first leaf ending after lo
        i1 = np.searchsorted(self.start, hi, side="left")  # leaves starting before hi
        total = self._cum[np.maximum(i1, i0)] - self._cum[i0]
        first = np.minimum(i0, self.start.size - 1)
        last = np.clip(i1 - 1, 0, self.start.size - 1)
        has = i1 > i0
        # the leaves at the two edges count only their part inside
        total = total - np.where(has, np.maximum(lo - self.start[first], 0), 0)
        total = total - np.where(has, np.maximum(self.end[last] - hi, 0), 0)
        return np.maximum(total, 0)


def blocked(ops: Iterable[tuple[int, int]], leaves: Leaves) -> tuple[np.ndarray, np.ndarray]:
    """The communication ops (start, end ns) that blocked the thread, merged into disjoint
    spans in time order."""
    arr = np.array(list(ops), dtype=np.int64).reshape(-1, 2)
    lo, hi = arr[:, 0], np.maximum(arr[:, 1], arr[:, 0])
    keep = leaves.busy(lo, hi) < BLOCKED_BELOW * (hi - lo)
    lo, hi = lo[keep], hi[keep]
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], hi[order]
    if lo.size == 0:
        return lo, hi
    reach = np.maximum.accumulate(hi)
    new = np.ones(lo.size, dtype=bool)
    new[1:] = lo[1:] > reach[:-1]
    group = np.cumsum(new) - 1
    ends = np.zeros(int(group[-1]) + 1, dtype=np.int64)
    np.maximum.at(ends, group, hi)
    return lo[new], ends


def pieces(lo: int, hi: int, waits: tuple[np.ndarray, np.ndarray]) -> list[tuple[int, int]]:
    """A phase's span [lo, hi) cut around the blocked time inside it: the (start, end) of
    each piece in which the thread computed, as the hook cuts its phases."""
    starts, ends = waits
    i = int(np.searchsorted(ends, lo, side="right"))  # the first wait that ends after lo
    out, at = [], lo
    while i < starts.size and starts[i] < hi:
        if starts[i] > at:
            out.append((at, int(starts[i])))
        at = max(at, int(ends[i]))
        i += 1
    if at < hi:
        out.append((at, hi))
    return out
