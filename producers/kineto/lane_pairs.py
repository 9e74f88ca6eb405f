"""Which pairs of a bucket's lanes `streams` judges: those that can end together, not all.

Why: a bucket of `streams` can hold one lane per rank (every rank's data-parallel stream
runs the same ops), and judging a pair takes medians over all its ops, so judging every
pair grows with the square of the ranks: seconds at 512 ranks, hours at 8,192. The lanes
of one group end together once each pair's clock offset is off, so a lane's group members
are among the few lanes that end nearest to it, and only those are judged: a few dozen
pairs a lane, however many ranks.

How:
- **on a node**, every pair (up to `_NODE_LANES` lanes a node): a node holds a few GPUs'
  lanes, and its pairs are banded on their own (`streams._links`), so that band is whole;
- **across nodes**, the lanes nearest in when they end (`neighbours`). A lane's *residual*
  is its ends less a reference lane's, less the median of that gap (the two clocks'
  offset): two lanes of one group have the same residual, to a hop, at all but a few ops
  (their stray is the median of that difference). At `_PROBES` ops spread over the trace
  the lanes are sorted by residual (a pair's stream: one lane's sends against the other's
  receives), and each is compared over all the probes (the median of the residuals'
  difference, less its own median) with the `_REACH` lanes after it in every order. It is
  judged against the `_CHAIN` lanes after it in every order and the `_NEAREST` of those
  compared that are closest to it (`candidate_pairs`);
- **then the nearest lanes of other groups** (`foreign_pairs`): once the pairs above are
  banded, each lane against the `_NEAREST` closest compared lanes outside the group they
  make of it.

Why a pruned pair could not have linked lanes that the judged pairs leave apart. Two lanes
of one group end within a hop of each other at most probes; they are pruned only if, at
every probe, more than `_REACH` lanes end between them (so within that hop of both) and
each of the two has `_NEAREST` lanes closer to it over the probes. Those lanes are of their
own group, or of groups that end with it to the hop at every probe (lockstep groups end by
their own members' arrival, apart). Lanes of their own group chain the two: in every order
the group's members are at most `_CHAIN` apart, each such pair is judged and strays a hop
as the pruned pair does, so union-find joins the same lanes. A pair of two groups links only
below the gap between the two bands; the pairs that could bridge it are those of two
groups that end nearest, and those are judged: each lane against the nearest lanes of
other groups. What stays out of reach:
- more than about `_REACH` lanes of other groups crowding one group's hop at every probe
  (hundreds of tiny groups in lockstep to a few µs);
- a band decided by one extreme pair: where a single pair of two groups, of millions,
  strays within `_GAP` of one group's pairs while the others stray far above, judging
  every pair finds it and sees one band (no groups), the nearest lanes on the probes may
  not (the groups). Between the simulator's jobs' bands lie factors of 50 and more.
`streams.assign_streams(exhaustive=True)` judges every pair: the tests and
`load-tests/bench_streams.py` hold this search to it.

>>> ms = 1_000_000
>>> rng = np.random.default_rng(0)
>>> pattern = rng.integers(0, 300_000, size=(50, 16))  # 50 groups in lockstep, 4 lanes each
>>> end = (np.arange(16) * ms + pattern[np.arange(200) % 50]
...        + rng.integers(0, 3_000, size=(200, 16)))  # and each lane's hop
>>> zero = np.zeros(200, dtype=np.int64)
>>> i, j = candidate_pairs(neighbours(end, end, zero, zero), np.arange(200).astype(str))
>>> i.size, 200 * 199 // 2  # judged, of every pair
(2498, 19900)
>>> judged = set(zip(i.tolist(), j.tolist()))
>>> all((a, b) in judged for a in range(200) for b in range(a + 1, 200) if a % 50 == b % 50)
True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_PROBES = 8  # ops at which a bucket's lanes are sorted by their residual end
_CHAIN = 2  # lanes after each in every order that it is judged against
_REACH = 32  # lanes after each in every order that are compared with it on the probes
_NEAREST = 8  # of those, the closest to a lane that it is judged against
_NODE_LANES = 64  # a node's lanes judged pair by pair, up to this many in a bucket
_CHUNK = 65_536  # lane pairs compared on the probes at once


@dataclass(frozen=True, slots=True)
class Neighbours:
    """A bucket's lanes compared on the probes with the lanes that end near them (module
    doc): pair p is lanes `i[p]` < `j[p]`, the first's sends against the second's receives
    as `streams._links` judges them, their residuals `far[p]` apart over the probes; each
    pair listed under both its lanes, by lane then by how far (`lane`, `pair`); `chain`:
    the pairs judged in any case, as codes i · n + j."""

    n: int
    i: np.ndarray
    j: np.ndarray
    far: np.ndarray
    lane: np.ndarray
    pair: np.ndarray
    chain: np.ndarray


def neighbours(end_f: np.ndarray, end_r: np.ndarray, sends: np.ndarray, takes: np.ndarray
               ) -> Neighbours:
    """Each lane compared with the `_REACH` lanes after it in every probe's order.

    `end_f`, `end_r`: (lanes, ops) ends, each step's sends first (`end_f`) or its receives
    first (`end_r`), as `streams._links` compares them; lane i's sends mirror lane j's
    receives when `sends[i] == takes[j]`. Work and memory: `_PROBES` · `_REACH` pairs a lane.
    """
    n, ops = end_f.shape
    probes = np.unique(np.linspace(0, ops - 1, min(_PROBES, ops)).round().astype(np.int64))
    res_f = residuals(end_f, end_f[0], probes)
    mirror = not np.array_equal(end_f, end_r)  # a pair's stream: sends against receives
    res_r = residuals(end_r, end_f[0], probes) if mirror else res_f
    if mirror:  # each lane twice in an order: its sends side, its receives side
        lane, side = np.tile(np.arange(n), 2), np.repeat([True, False], n)
        at, cls = np.concatenate([res_f, res_r]), np.concatenate([sends, takes])
    else:
        lane, side, at, cls = np.arange(n), np.ones(n, dtype=bool), res_f, sends
    hop = 2 if mirror else 1
    near, chain = [np.empty(0, dtype=np.int64)], [np.empty(0, dtype=np.int64)]
    for p in range(probes.size):
        order = np.lexsort((at[:, p], cls))
        for d in range(1, min(hop * _REACH, order.size - 1) + 1):
            x, y = order[:-d], order[d:]
            fit = (cls[x] == cls[y]) & (lane[x] != lane[y])
            if mirror:
                fit &= side[x] != side[y]  # one lane's sends against the other's receives
            code = _code(n, lane[x[fit]], lane[y[fit]])
            near.append(code)
            if d <= hop * _CHAIN:
                chain.append(code)
    seen = distinct(np.concatenate(near))
    i, j = seen // n, seen % n
    far = _probe_stray(res_f, res_r, i, j)
    both, pair = np.concatenate([i, j]), np.tile(np.arange(seen.size), 2)
    by_far = np.argsort(np.tile(far, 2), kind="stable")
    order = by_far[np.argsort(both[by_far], kind="stable")]  # by lane, then by far
    return Neighbours(n, i, j, far, both[order], pair[order], np.concatenate(chain))


def candidate_pairs(nb: Neighbours, node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs (i < j) judged first, in (i, j) order: every pair on one node (`node`: each
    lane's), the chain of every order, and each lane's `_NEAREST` closest compared lanes:
    at most `_PROBES` · `_CHAIN` + `_NEAREST` pairs a lane (a pair's streams sit twice in
    each order: twice the chain) and its node's."""
    kept = nb.pair[_nearest(nb.lane, np.ones(nb.lane.size, dtype=bool))]
    return _split(nb.n, np.concatenate([_on_node(node), nb.chain,
                                        _code(nb.n, nb.i[kept], nb.j[kept])]))


def foreign_pairs(nb: Neighbours, group: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs (i < j) of each lane and the `_NEAREST` closest compared lanes that are not
    of its group (`group`: each lane's, as the first pairs linked them): at most `_NEAREST`
    pairs a lane."""
    kept = nb.pair[_nearest(nb.lane, group[nb.i[nb.pair]] != group[nb.j[nb.pair]])]
    return _split(nb.n, _code(nb.n, nb.i[kept], nb.j[kept]))


def components(n: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """The group of each of `n` lanes that the pairs (i, j) join, named by its lowest lane:
    each side takes the lower label of the two, then each label its own label's, until no
    label moves (a few rounds: the jumps halve every chain)."""
    label = np.arange(n)
    while True:
        low = np.minimum(label[i], label[j])
        before = label.copy()
        np.minimum.at(label, i, low)
        np.minimum.at(label, j, low)
        label = label[label]
        if np.array_equal(label, before):
            return label


def residuals(end: np.ndarray, ref: np.ndarray, probes: np.ndarray) -> np.ndarray:
    """(lanes, ops) ends → each lane's offset-free ends at `probes`: the gap to the reference
    lane's, less its median (the two clocks' offset)."""
    gap = end - ref
    return (gap[:, probes] - np.median(gap, axis=1, keepdims=True)).astype(np.float64)


def distinct(x: np.ndarray) -> np.ndarray:
    """`np.unique` of an int array, by sorting: numpy 2's hashing `unique` takes 40 times
    as long on a few million pair codes."""
    x = np.sort(x)
    return x[np.concatenate([[True], x[1:] != x[:-1]])] if x.size else x


def _probe_stray(res_f: np.ndarray, res_r: np.ndarray, i: np.ndarray, j: np.ndarray
                 ) -> np.ndarray:
    """How far lane i's sends and lane j's receives stray over the probes: the pair test's
    stray (`streams._stray`) on the probes alone, a few pairs of rows at a time."""
    out = np.empty(i.size)
    for c in range(0, i.size, _CHUNK):
        gap = res_f[i[c:c + _CHUNK]] - res_r[j[c:c + _CHUNK]]
        gap -= _median(gap)[:, None]
        out[c:c + _CHUNK] = _median(np.abs(gap))
    return out


def _median(x: np.ndarray) -> np.ndarray:
    """Each row's median; a sort of a few columns is three times as fast as `np.median`'s
    partition."""
    x = np.sort(x, axis=1)
    return (x[:, (x.shape[1] - 1) // 2] + x[:, x.shape[1] // 2]) / 2


def _nearest(lane: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Of entries sorted by lane then by how far, the eligible ones among the first
    `_NEAREST` eligible of their lane."""
    count = np.cumsum(eligible)
    before = count - eligible  # eligible entries before each
    start = np.searchsorted(lane, lane)  # where each lane's entries start
    return eligible & (before - before[start] < _NEAREST)


def _on_node(node: np.ndarray) -> np.ndarray:
    """Every pair of lanes on one node (up to `_NODE_LANES` lanes a node), as codes."""
    n = node.size
    order = np.argsort(np.unique(node, return_inverse=True)[1].ravel(), kind="stable")
    codes = [np.empty(0, dtype=np.int64)]
    for d in range(1, min(_NODE_LANES, n)):
        a, b = order[:-d], order[d:]
        same = node[a] == node[b]
        if not same.any():
            break  # sorted by node: no node holds more than d lanes
        codes.append(_code(n, a[same], b[same]))
    return np.concatenate(codes)


def _code(n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Unordered pairs of lanes as one int each: i · n + j with i < j."""
    return np.minimum(a, b) * n + np.maximum(a, b)


def _split(n: int, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    codes = distinct(codes)
    return codes // n, codes % n
