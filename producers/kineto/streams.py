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

import numpy as np

from producers.kineto.groups import KAPPA, ProcessGroup, ThreadOps

Lane = tuple[int, str]  # (rank, CUDA stream)

_RESOLUTION_NS = 1_000  # older traces time events in whole µs: ends closer than this agree
_MIN_MATCHED = 3  # ops two lanes must share before they are judged
_ABSORBED = 0.25  # one group's lanes end at most this share as apart as they start
_GAP = 4.0  # two bands of strays this far apart: one group's pairs, and lockstep groups'
_TIGHT = 0.02  # one band is one group's when it strays under this share of the ops
_CHUNK = 4096  # lane pairs compared at once
_DIRECTION = ("send", "recv")
_P2P = dict.fromkeys(_DIRECTION, "p2p")  # a pair's lanes: a send on one side, a recv on the other


def assign_streams(lanes: Mapping[Lane, ThreadOps],
                   known: Mapping[int, tuple[ProcessGroup, ...]],
                   nodes: Mapping[int, str]) -> dict[Lane, ProcessGroup]:
    """(rank, stream) → the process group its kernels belong to, where the traces tell.

    `lanes`: every traced rank's NCCL streams with their ops (`trace.stream_ops`); `known`:
    each rank's groups from `pg_config`, when its trace has one (only names come from it);
    `nodes`: each rank's node (one clock, no network between its ranks). A lane absent
    from the answer ended with no other rank's (module doc).
    """
    steps = _common_steps(lanes)
    links: list[tuple[float, Lane, Lane]] = []
    for bucket in _buckets(lanes, steps).values():
        links += _links(bucket, lanes, steps, nodes)
    parent: dict[Lane, Lane] = {k: k for k in lanes}
    ranks: dict[Lane, set[int]] = {k: {k[0]} for k in lanes}

    def root(k: Lane) -> Lane:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    pair = {k for k, ops in lanes.items() if np.isin(ops.names, _DIRECTION).any()}
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
    by_rank: dict[int, set[int]] = {}
    for (rank, _s), ops in lanes.items():
        by_rank.setdefault(rank, set()).update(ops.step.tolist())
    common = set.intersection(*by_rank.values()) if by_rank else set()
    return np.array(sorted(common), dtype=np.int64)


def _buckets(lanes: Mapping[Lane, ThreadOps], steps: np.ndarray
             ) -> dict[tuple[str, ...], list[Lane]]:
    """Lanes by what they ran on `steps`, step by step: only lanes with the same ops in the
    same order can be one group's."""
    out: dict[tuple[str, ...], list[Lane]] = {}
    for k, ops in lanes.items():
        sel = np.isin(ops.step, steps)
        if int(sel.sum()) >= _MIN_MATCHED:
            key = tuple(f"{s}:{_P2P.get(str(n), str(n))}"
                        for s, n in zip(ops.step[sel].tolist(), ops.names[sel], strict=True))
            out.setdefault(key, []).append(k)
    return out


def _links(bucket: list[Lane], lanes: Mapping[Lane, ThreadOps], steps: np.ndarray,
           nodes: Mapping[int, str]) -> list[tuple[float, Lane, Lane]]:
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
    """
    if len(bucket) < 2:
        return []
    ops = [_on(lanes[k], steps) for k in bucket]
    fwd, rev = [_mirrored(o, 1) for o in ops], [_mirrored(o, -1) for o in ops]
    rank = np.array([k[0] for k in bucket])
    node = np.array([nodes.get(int(r), f"rank-{r}") for r in rank])
    way_f = np.stack([_way(o.names) for o in fwd])
    way_r = np.stack([_way(o.names) for o in rev])
    i, j = np.triu_indices(len(bucket), 1)
    keep = (rank[i] != rank[j]) & (way_f[i] == -way_r[j]).all(axis=1)
    i, j = i[keep], j[keep]
    end_f, end_r = np.stack([o.end_ns for o in fwd]), np.stack([o.end_ns for o in rev])
    dur_f, dur_r = np.stack([o.dur_ns for o in fwd]), np.stack([o.dur_ns for o in rev])
    stray, start_stray, shorter = (np.empty(i.size) for _ in range(3))
    for c in range(0, i.size, _CHUNK):  # pairs × ops at a time, so memory stays bounded
        a, b = i[c:c + _CHUNK], j[c:c + _CHUNK]
        stray[c:c + a.size] = _stray(end_f[a] - end_r[b])
        start_stray[c:c + a.size] = _stray((end_f[a] - dur_f[a]) - (end_r[b] - dur_r[b]))
        shorter[c:c + a.size] = np.median(np.minimum(dur_f[a], dur_r[b]), axis=1)
    ok = (stray <= np.maximum(shorter, _RESOLUTION_NS)) \
        & ((stray <= KAPPA * _RESOLUTION_NS) | (stray <= _ABSORBED * start_stray))
    for same in (node[i] == node[j], node[i] != node[j]):
        sel = ok & same
        if not sel.any():
            continue
        bands = np.unique(stray[sel])
        ratios = bands[1:] / bands[:-1]
        if ratios.size and ratios.max() >= _GAP:
            ok &= ~same | (stray <= bands[int(np.argmax(ratios))])
        elif bands[-1] > _TIGHT * float(np.median(shorter[sel])):
            ok &= ~same
    return [(float(stray[p]), bucket[int(i[p])], bucket[int(j[p])]) for p in np.flatnonzero(ok)]


def _mirrored(ops: ThreadOps, sign: int) -> ThreadOps:
    """A lane's ops, each step's sends first and receives last (`sign` 1) or the other way
    round (-1): a pair's two lanes then meet copy for copy, one's sends against the other's
    receives, whatever order each ran them in (each direction keeps its own order)."""
    order = np.lexsort((-sign * _way(ops.names), ops.step))
    return ThreadOps(ops.names[order], ops.end_ns[order], ops.dur_ns[order], ops.step[order])


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
    """A lane's ops on `steps`, in the lane's order."""
    sel = np.isin(ops.step, steps)
    return ThreadOps(ops.names[sel], ops.end_ns[sel], ops.dur_ns[sel], ops.step[sel])
