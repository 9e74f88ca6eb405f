"""Process groups of NCCL traces that name none, told from their CUDA streams.

Why: traces from before torch 2.2 put no process group on a collective (no `Process Group
Name` in its args) and list no `pg_config`. Replayed as one group (`pg.unknown`), a rank's
TP, DP and world collectives number into one sequence, no instance matches across ranks,
and a slow GPU reads as a job-wide shift.

What such traces still carry: the CUDA stream of every NCCL kernel. ProcessGroupNCCL runs
each group's collectives on a stream of its own, and each pair's sends and receives on the
stream of that pair's communicator. So a stream is one group's on its rank (a *lane*), and
what is left is which lanes of different ranks are one group's:
- **the same ops in the same order.** Every member runs a group's collectives in one order
  (NCCL requires it), so a group's lanes hold the same names, step by step (a pair's sends
  on one side are receives on the other: both count as `p2p`);
- **ending together.** The copies of one instance end within a hop of each other on every
  member, once each rank's clock offset (the median gap) is taken off; lanes of two groups
  that merely run in lockstep (two TP pairs' DP all-reduces of one bucket) stray by their
  network's noise, or as apart as they started (`_links`).
Lanes join into groups closest pair first, never two lanes of one rank, and a pair's stream
(sends and receives) with one other only, whose every send it receives. A group whose
members are those of an entry of `pg_config` (when a trace has one) takes its name; the
others are named by their order (`pg.s0`, `pg.s1`, ...: the kind of a group no trace names
is unknown). A lane nothing ends with keeps no group (`pg.unknown`).

Which pairs are judged: not every pair of lanes with the same ops (one lane per rank can
share them: quadratic in the ranks, hours at 8,192), but each lane against those that end
nearest to it, where its group's members are, and the nearest of other groups, where the
gap between the bands is (`lane_pairs`, which says why a pair left out could not have
linked); `exhaustive=True` judges them all, as the reference.

>>> ms = 1_000_000
>>> steps = np.repeat(np.arange(6), 2)
>>> jitter = np.random.default_rng(1).integers(0, 3 * ms, size=(4, 12))
>>> lanes = {}
>>> for r in range(4):  # stream 20: the world's all-reduce; 30: the TP pair's (0-1, 2-3)
...     world = steps * 100 * ms + 90 * ms
...     pair = steps * 100 * ms + 40 * ms + jitter[r // 2]
...     lanes[(r, "20")] = ThreadOps.of(["all_reduce"] * 12, world + r * 7_000, ms, steps)
...     lanes[(r, "30")] = ThreadOps.of(["all_reduce"] * 12, pair + r * 7_000, ms, steps)
>>> found = assign_streams(lanes, {}, {r: f"node-{r // 2}" for r in range(4)})
>>> found[(0, "20")].ranks, found[(0, "30")].ranks, found[(3, "30")].ranks
((0, 1, 2, 3), (0, 1), (2, 3))
>>> found[(0, "30")].name == found[(1, "30")].name != found[(2, "30")].name
True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from producers.kineto.groups import KAPPA, ProcessGroup, ThreadOps
from producers.kineto.lane_pairs import (
    candidate_pairs,
    components,
    foreign_pairs,
    neighbours,
)

Lane = tuple[int, str]  # (rank, CUDA stream)

_RESOLUTION_NS = 1_000  # older traces time events in whole µs: ends closer than this agree
_MIN_MATCHED = 3  # ops two lanes must share before they are judged
_ABSORBED = 0.25  # one group's lanes end at most this share as apart as they start
_GAP = 4.0  # two bands of strays this far apart: one group's pairs, and lockstep groups'
_TIGHT = 0.02  # one band is one group's when it strays under this share of the ops
_CHUNK = 4096  # lane pairs compared at once


@dataclass(slots=True)
class Weighed:
    """What one `assign_streams` call weighed (pass one in to count): the buckets of two
    lanes or more, every pair of lanes in them, and the pairs judged (medians over all their
    ops: the cost that grows with the ranks)."""

    buckets: int = 0
    pairs: int = 0
    judged: int = 0


def assign_streams(lanes: Mapping[Lane, ThreadOps],
                   known: Mapping[int, tuple[ProcessGroup, ...]],
                   nodes: Mapping[int, str], *, exhaustive: bool = False,
                   weighed: Weighed | None = None) -> dict[Lane, ProcessGroup]:
    """(rank, stream) → the process group its kernels belong to, where the traces tell.

    `lanes`: every traced rank's NCCL streams with their ops (`trace.stream_ops`); `known`:
    each rank's groups from `pg_config`, when its trace has one (only names come from it);
    `nodes`: each rank's node (one clock, no network between its ranks). A lane absent
    from the answer ended with no other rank's (module doc). `exhaustive` judges every pair
    of lanes, not only those `lane_pairs` picks: quadratic in the ranks, the reference the
    pruned search is held to (tests, `load-tests/bench_streams.py`); `weighed` counts.
    """
    steps = _common_steps(lanes)
    on = {k: _on(ops, steps) for k, ops in lanes.items()}
    links: list[tuple[float, Lane, Lane]] = []
    for bucket in _buckets(on).values():
        links += _links(bucket, on, nodes, exhaustive, weighed or Weighed())
    parent: dict[Lane, Lane] = {k: k for k in lanes}
    ranks: dict[Lane, set[int]] = {k: {k[0]} for k in lanes}

    def root(k: Lane) -> Lane:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    pair = {k for k, ops in lanes.items() if _way(ops.names).any()}
    for _s, a, b in sorted(links):
        ra, rb = root(a), root(b)
        if ra == rb or ranks[ra] & ranks[rb]:
            continue  # one lane per rank in a group
        if (a in pair or b in pair) and len(ranks[ra]) + len(ranks[rb]) > 2:
            continue  # a pair's communicator has two members
        parent[rb] = ra
        ranks[ra] |= ranks.pop(rb)
    members: dict[Lane, list[Lane]] = {}
    for k in lanes:
        members.setdefault(root(k), []).append(k)
    named = {g.ranks: g for gs in known.values() for g in gs}
    found = sorted(tuple(sorted(ranks[r])) for r, ks in members.items() if len(ks) >= 2)
    groups = {rs: named.get(rs) or ProcessGroup(f"s{i}", "", rs) for i, rs in enumerate(found)}
    return {k: groups[tuple(sorted(ranks[r]))] for r, ks in members.items() if len(ks) >= 2
            for k in ks}


def _common_steps(lanes: Mapping[Lane, ThreadOps]) -> np.ndarray:
    """The steps every rank's lanes cover (a rank's trace may hold more windows)."""
    by_rank: dict[int, list[np.ndarray]] = {}
    for (rank, _s), ops in lanes.items():
        by_rank.setdefault(rank, []).append(_steps_of(ops.step))
    if not by_rank:
        return np.empty(0, dtype=np.int64)
    each = [np.unique(np.concatenate(s)) for s in by_rank.values()]  # a few steps a rank
    steps, ranks = np.unique(np.concatenate(each), return_counts=True)
    return steps[ranks == len(each)].astype(np.int64)


def _steps_of(step: np.ndarray) -> np.ndarray:
    """A lane's steps, once each: its ops run in step order, so usually without a sort."""
    if (step[1:] >= step[:-1]).all():
        return step[np.concatenate([[True], step[1:] != step[:-1]])] if step.size else step
    return np.unique(step)


def _buckets(on: Mapping[Lane, ThreadOps]) -> dict[tuple[bytes, bytes], list[Lane]]:
    """Lanes by what they ran on the common steps (`on`), step by step: only lanes with the
    same ops in the same order can be one group's. (The key is the bytes of the steps and of
    the names, as wide as the longest: one key a lane, not a string an op.)"""
    out: dict[tuple[bytes, bytes], list[Lane]] = {}
    for k, ops in on.items():
        if ops.step.size >= _MIN_MATCHED:
            names = np.where(_way(ops.names) != 0, "p2p", ops.names)
            names = names.astype(f"U{int(np.strings.str_len(names).max())}")
            out.setdefault((ops.step.tobytes(), names.tobytes()), []).append(k)
    return out


def _links(bucket: list[Lane], on: Mapping[Lane, ThreadOps], nodes: Mapping[int, str],
           exhaustive: bool, weighed: Weighed) -> list[tuple[float, Lane, Lane]]:
    """The pairs of a bucket's lanes (of different ranks) that end together, with how far
    their ends stray: the median gap once the pair's clock offset is off.

    - A pair's sends are its peer's receives, copy for copy, step by step (`_mirrored`).
    - Copies of one instance end together however apart their members started: the early
      ones wait for the last, so the ends stray far less than the starts (`_ABSORBED`), or
      not beyond what the trace's timestamps resolve. Lanes of two groups in lockstep end
      as apart as they started, each group on its own members' arrival.
    - Copies end within the shorter op of the two, which lasts at least the last hop.
    - One group's pairs stray by a hop, pairs of two groups by their network's noise: where
      a bucket's strays fall in two bands `_GAP` apart, only the lower is one group's;
      where they fall in one, it is one group's only if tight against the ops (`_TIGHT`: a
      lone traced member of each of several groups stays alone). Pairs on one node (one
      clock, no network between them) and across nodes are banded apart.

    The pairs judged are those `lane_pairs` picks, first each lane's nearest, then the
    nearest lanes of other groups (the lower end of the upper band); every pair with
    `exhaustive`.
    """
    n = len(bucket)
    if n < 2:
        return []
    lanes = _Sides.of(bucket, on, nodes)
    weighed.buckets += 1
    weighed.pairs += n * (n - 1) // 2
    if exhaustive:
        i, j, stray, shorter, ok = lanes.judged(*np.triu_indices(n, 1))
    else:
        near = neighbours(lanes.end_f, lanes.end_r, lanes.sends, lanes.takes)
        i, j, stray, shorter, ok = lanes.judged(*candidate_pairs(near, lanes.node))
        linked = _banded(lanes.node[i] == lanes.node[j], stray, shorter, ok)
        i2, j2 = foreign_pairs(near, components(n, i[linked], j[linked]))
        fresh = ~_among(i2 * n + j2, i * n + j)
        more = lanes.judged(i2[fresh], j2[fresh])
        i, j, stray, shorter, ok = (np.concatenate(c) for c in zip((i, j, stray, shorter, ok),
                                                                    more, strict=True))
    weighed.judged += i.size
    ok = _banded(lanes.node[i] == lanes.node[j], stray, shorter, ok)
    return [(float(stray[p]), bucket[int(i[p])], bucket[int(j[p])]) for p in np.flatnonzero(ok)]


def _among(x: np.ndarray, sorted_: np.ndarray) -> np.ndarray:
    """`np.isin(x, sorted_)` for a sorted int array, by bisection (numpy 2's `isin` sorts
    or hashes both sides, ten times as long on a few hundred thousand pairs)."""
    if not sorted_.size:
        return np.zeros(x.size, dtype=bool)
    at = np.minimum(np.searchsorted(sorted_, x), sorted_.size - 1)
    return sorted_[at] == x


def _banded(same: np.ndarray, stray: np.ndarray, shorter: np.ndarray, ok: np.ndarray
            ) -> np.ndarray:
    """`ok` less the pairs above the lower of two bands, or of a band that is not tight,
    pairs on one node (`same`) and across nodes apart (`_links`)."""
    ok = ok.copy()
    for one in (same, ~same):
        sel = ok & one
        if not sel.any():
            continue
        bands = np.unique(stray[sel])
        ratios = bands[1:] / bands[:-1]
        if ratios.size and ratios.max() >= _GAP:
            ok &= ~one | (stray <= bands[int(np.argmax(ratios))])
        elif bands[-1] > _TIGHT * float(np.median(shorter[sel])):
            ok &= ~one
    return ok


@dataclass(frozen=True, slots=True)
class _Sides:
    """A bucket's lanes as (lanes, ops) arrays, each step's sends first (`_f`) or its
    receives first (`_r`, `_mirrored`), with each lane's rank and node; lane i's sends
    mirror lane j's receives when `sends[i] == takes[j]`."""

    rank: np.ndarray
    node: np.ndarray
    end_f: np.ndarray
    end_r: np.ndarray
    dur_f: np.ndarray
    dur_r: np.ndarray
    sends: np.ndarray
    takes: np.ndarray

    @staticmethod
    def of(bucket: list[Lane], on: Mapping[Lane, ThreadOps], nodes: Mapping[int, str]
           ) -> _Sides:
        rank = np.array([k[0] for k in bucket])
        end = np.stack([on[k].end_ns for k in bucket])
        dur = np.stack([on[k].dur_ns for k in bucket])
        step = on[bucket[0]].step  # a bucket's lanes ran the same steps (its key)
        # a bucket's lanes differ only in which of their p2p ops are sends: a few patterns
        ways, lane_way = np.unique(_way(np.stack([on[k].names for k in bucket])), axis=0,
                                   return_inverse=True)
        lane_way = lane_way.ravel()
        fwd, rev = _mirrored(ways, step, 1), _mirrored(ways, step, -1)
        # one id per pattern of sends and receives: lane i's mirror lane j's when they match
        ids = np.unique(np.concatenate([np.take_along_axis(ways, fwd, 1),
                                        -np.take_along_axis(ways, rev, 1)]),
                        axis=0, return_inverse=True)[1].ravel()
        fwd, rev = fwd[lane_way], rev[lane_way]
        return _Sides(rank, np.array([nodes.get(int(r), f"rank-{r}") for r in rank]),
                      np.take_along_axis(end, fwd, 1), np.take_along_axis(end, rev, 1),
                      np.take_along_axis(dur, fwd, 1), np.take_along_axis(dur, rev, 1),
                      ids[:len(ways)][lane_way], ids[len(ways):][lane_way])

    def judged(self, i: np.ndarray, j: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The pairs (i, j) of different ranks whose sends and receives mirror, with how far
        their ends stray, their shorter op (medians) and whether they end together."""
        keep = (self.rank[i] != self.rank[j]) & (self.sends[i] == self.takes[j])
        i, j = i[keep], j[keep]
        stray, shorter = np.empty(i.size), np.empty(i.size)
        absorbed = np.zeros(i.size, dtype=bool)
        for c in range(0, i.size, _CHUNK):  # pairs × ops at a time, so memory stays bounded
            a, b = i[c:c + _CHUNK], j[c:c + _CHUNK]
            s = stray[c:c + a.size] = _stray(self.end_f[a] - self.end_r[b])
            short = shorter[c:c + a.size] = np.median(np.minimum(self.dur_f[a], self.dur_r[b]),
                                                      axis=1)
            # the starts matter only to a pair that ends close enough, and not to the µs
            ask = np.flatnonzero((s <= np.maximum(short, _RESOLUTION_NS))
                                 & (s > KAPPA * _RESOLUTION_NS))
            if ask.size:
                a, b = a[ask], b[ask]
                starts = (self.end_f[a] - self.dur_f[a]) - (self.end_r[b] - self.dur_r[b])
                absorbed[c + ask] = s[ask] <= _ABSORBED * _stray(starts)
        ok = (stray <= np.maximum(shorter, _RESOLUTION_NS)) \
            & ((stray <= KAPPA * _RESOLUTION_NS) | absorbed)
        return i, j, stray, shorter, ok


def _mirrored(way: np.ndarray, step: np.ndarray, sign: int) -> np.ndarray:
    """The order of each lane's ops (rows of `way`) with each step's sends first and
    receives last (`sign` 1) or the other way round (-1): a pair's two lanes then meet copy
    for copy, one's sends against the other's receives, whatever order each ran them in
    (each direction keeps its own order: the sort is stable)."""
    return np.argsort(step * 3 + (1 - sign * way), axis=1, kind="stable")


def _way(names: np.ndarray) -> np.ndarray:
    """+1 for a send, -1 for a receive, 0 for a collective."""
    return (names == "send").astype(np.int8) - (names == "recv").astype(np.int8)


def _stray(gap: np.ndarray) -> np.ndarray:
    """(pairs, ops) gaps → each pair's median distance from its own median gap (its clocks'
    offset), at least the trace's resolution."""
    g = gap.astype(np.float64)
    g -= np.median(g, axis=1, keepdims=True)
    return np.maximum(np.median(np.abs(g), axis=1), _RESOLUTION_NS)


def _on(ops: ThreadOps, steps: np.ndarray) -> ThreadOps:
    """A lane's ops on `steps`, in the lane's order (the lane itself when it ran no other)."""
    at = np.minimum(np.searchsorted(steps, ops.step), max(steps.size - 1, 0))
    sel = steps[at] == ops.step if steps.size else np.zeros(ops.step.size, dtype=bool)
    if sel.all():
        return ops
    return ThreadOps(ops.names[sel], ops.end_ns[sel], ops.dur_ns[sel], ops.step[sel])
