"""Process groups of the collectives a trace does not label, told from the traces themselves.

Why: under gloo (CPU training) a collective's trace events carry no process group. Replayed
as one group (`pg.unknown`), a rank's TP, DP and world collectives number into one sequence,
no instance matches across ranks, and a drill's slowed rank or NIC read as a job-wide shift.

What the traces do carry:
- `distributedInfo.pg_config`: the groups the rank belongs to, with their global names (the
  order of creation, the same on every rank) and member ranks;
- the worker thread that ran each collective: every gloo process group owns its threads
  (`THREADS_PER_GROUP`), so a thread's collectives are all one group's.

Three things tell which group a thread serves, each checking the one before:
1. **When its collectives end.** The copies of one collective instance end together on every
   member: the last chunk reaches them all within a hop. So for the thread's group, each
   traced member has an op of the same name ending at the same time, up to its clock's
   constant offset; for another candidate, the nearest ends on some member belong to other
   instances (another TP pair's all-reduce of the same layer) and stray with the ranks'
   jitter. The largest group all of whose traced members end with the thread fits best
   (every subgroup of a world collective fits it too) (`_costs`).
2. **The order gloo made the threads in.** A group's threads start when it is created, in
   the order of the groups' names, so a rank's threads sorted by id fall into consecutive
   blocks of one group each. Timing picks which groups the blocks are; the blocks are kept
   when no thread pays much for them (`_in_creation_order`).
3. **How many ops each member ran.** Every member of a group runs as many of its ops in each
   step. A thread that leaves its rank's count off the other members' is moved to the group
   that lacks exactly its ops (`_repaired`).

A thread no traced member can speak for keeps `pg.unknown`. The p2p ops, which gloo runs
on the calling thread, get their pairs in `peers`.
NCCL traces name their groups since torch 2.2; older ones, whose kernels sit on one CUDA
stream per group, are not inferred here.

>>> world, tp0, tp1 = (ProcessGroup("0", "default_pg", (0, 1, 2, 3)),
...                    ProcessGroup("1", "", (0, 1)), ProcessGroup("2", "", (2, 3)))
>>> ms, rng = 1_000_000, np.random.default_rng(0)
>>> lag = rng.integers(0, 5 * ms, size=(2, 20))  # each TP group's own pace, step by step
>>> steps = np.arange(20)
>>> threads = {}
>>> for r in range(4):  # threads 11, 12 take turns at the world all-reduce; 13, 14 the TP's
...     for tid, turn in (("13", 0), ("14", 1)):
...         at = steps[turn::2]
...         threads[(r, tid)] = ThreadOps.of(["all_reduce"] * 10,
...                                          at * 100 * ms + 40 * ms + lag[r // 2][at], ms, at)
...     for tid, turn in (("11", 0), ("12", 1)):
...         at = steps[turn::2]
...         threads[(r, tid)] = ThreadOps.of(["all_reduce"] * 10, at * 100 * ms + 90 * ms, ms,
...                                          at)
>>> found = assign_threads(threads, {0: (world, tp0), 1: (world, tp0), 2: (world, tp1),
...                                  3: (world, tp1)})
>>> found[(0, "13")].name, found[(0, "12")].name, found[(3, "14")].name
('1', '0', '2')
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import numpy as np

KAPPA = 2.0  # a member ends with the thread when it scatters within this × the closest
THREADS_PER_GROUP = 2  # ProcessGroupGloo's worker threads per group (its default)
_OTHER_FIT, _UNSEEN = 0.2, 1.0  # thread costs (see _costs)
_MEAN_ACCEPTED, _WORST_ACCEPTED = 1.0, 4.0  # what the creation-order prior may cost
_MIN_MATCHED = 3  # ops a thread needs before its group is judged
_JUDGES = 16  # members of a large group that judge a thread (see _judges)


@dataclass(frozen=True, slots=True)
class ProcessGroup:
    """One entry of a trace's `pg_config`: global name, description, member ranks."""

    name: str
    desc: str
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ThreadOps:
    """A worker thread's collectives: names, end times and durations (ns), and the profiler
    step each was issued in."""

    names: np.ndarray  # str
    end_ns: np.ndarray  # int64
    dur_ns: np.ndarray  # int64
    step: np.ndarray  # int64

    @staticmethod
    def of(names: list[str], end_ns: Any, dur_ns: Any, step: Any) -> ThreadOps:
        n = len(names)

        def col(x: Any) -> np.ndarray:
            return np.broadcast_to(np.asarray(x, dtype=np.int64), (n,)).copy()

        return ThreadOps(np.asarray(names, dtype=str), col(end_ns), col(dur_ns), col(step))


def process_groups(dist: Mapping[str, Any]) -> tuple[ProcessGroup, ...]:
    """The groups of a trace's `distributedInfo` with two members or more (a lone rank's
    group has no peer to wait for); malformed entries are skipped."""
    out = []
    for g in dist.get("pg_config") or ():
        if not isinstance(g, Mapping):
            continue
        ranks = g.get("ranks")
        if not isinstance(ranks, list) or not all(isinstance(r, int) for r in ranks):
            continue
        if len(set(ranks)) >= 2 and g.get("pg_name") is not None:
            out.append(ProcessGroup(str(g["pg_name"]), str(g.get("pg_desc") or ""),
                                    tuple(sorted(set(ranks)))))
    return tuple(out)


def _scatter(mine: ThreadOps, theirs: Mapping[str, tuple[np.ndarray, np.ndarray]]
             ) -> tuple[float, float] | None:
    """How far the nearest of a member's same-name op ends stray from this thread's, once
    the member's clock offset (their median gap) is taken off: the median absolute gap, in
    ns; and the median of the shorter of each matched pair's durations, which copies of one
    instance ending together stay within. None when the member has too few such ops.
    `theirs`: the member's ends (sorted) and durations by name."""
    parts = [(mine.names == n, t) for n in np.unique(mine.names)
             if (t := theirs.get(str(n))) is not None and t[0].size > 0]
    if sum(int(sel.sum()) for sel, _t in parts) < _MIN_MATCHED:
        return None
    offset = float(np.median(np.concatenate(
        [_nearest(mine.end_ns[sel], t[0])[0] for sel, t in parts])))
    gaps, shorter = [], []
    for sel, (ends, durs) in parts:
        gap, at = _nearest(mine.end_ns[sel] + offset, ends)
        gaps.append(np.abs(gap))
        shorter.append(np.minimum(mine.dur_ns[sel], durs[at]))
    return float(np.median(np.concatenate(gaps))), float(np.median(np.concatenate(shorter)))


def _nearest(ends: np.ndarray, theirs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each end, the signed gap to the nearest of `theirs` (sorted), and its index."""
    if theirs.size == 1:
        return theirs[0] - ends, np.zeros(ends.size, dtype=np.int64)
    i = np.clip(np.searchsorted(theirs, ends), 1, theirs.size - 1)
    lo, hi = theirs[i - 1] - ends, theirs[i] - ends
    left = np.abs(lo) <= np.abs(hi)
    return np.where(left, lo, hi), np.where(left, i - 1, i)


def _costs(mine: ThreadOps, groups: tuple[ProcessGroup, ...],
           scatter: Mapping[int, tuple[float, float]], floor: float
           ) -> dict[ProcessGroup, float]:
    """How badly each of the rank's groups explains the thread's ops: 0 for the likeliest.

    Each traced member of any of the rank's groups either ends its ops with this thread's
    or not: its `scatter` is within `KAPPA` times the closest member's (or the job's usual
    closest, `floor`, when that is larger: a few ops can end a member within 1 µs by
    chance), and within the shorter duration of the two ops it pairs (`_scatter`). Copies
    of one instance end within its last hop, which each copy lasts at least; when the
    thread's own group has no other member traced, the closest member is another group's
    op in lockstep, and ends milliseconds off.
    A group fits when all its traced members do: the largest fitting group costs 0 (a world
    collective fits every subgroup too), the other fits `_OTHER_FIT`, a group no traced
    member speaks for `_UNSEEN`, and a group whose worst member strays 1 plus the log of
    how far: a group seen not to fit is less likely than one not seen.
    """
    if not scatter:
        return {}
    near = KAPPA * max(min(s for s, _cap in scatter.values()), floor) \
        + 0.01 * float(np.median(mine.dur_ns))
    # each member's scatter over what it may be (≤ 1: it ends with the thread)
    over = {m: s / max(min(near, cap), 1.0) for m, (s, cap) in scatter.items()}
    worst = {g: max((over[m] for m in g.ranks if m in over), default=None) for g in groups}
    fitting = [(len(g.ranks), -w, _order(g), g) for g, w in worst.items()
               if w is not None and w <= 1.0]
    largest = max(fitting, key=lambda x: x[:3])[3] if fitting else None
    return {g: _UNSEEN if w is None else 0.0 if g == largest else _OTHER_FIT if w <= 1.0
            else 1.0 + float(np.log(w)) for g, w in worst.items()}


def _in_creation_order(tids: list[str], costs: list[dict[ProcessGroup, float]],
                       groups: tuple[ProcessGroup, ...]) -> list[ProcessGroup] | None:
    """The threads' groups when gloo made them as it does: each group's
    `THREADS_PER_GROUP` worker threads at its creation, groups in the order their names
    count, so a rank's threads sorted by id fall into consecutive blocks of one group each,
    in that order. The cheapest such assignment, or None when the threads do not divide
    into blocks or it would give some thread a group that clearly does not explain it (a
    job with other thread counts, or groups created lazily)."""
    k = THREADS_PER_GROUP
    order = sorted(groups, key=lambda g: -_order(g))
    if not tids or len(tids) % k or len(tids) // k > len(order):
        return None
    blocks = len(tids) // k
    cost = np.array([[sum(costs[b * k + i].get(g, _UNSEEN) for i in range(k)) for g in order]
                     for b in range(blocks)])
    best = np.full(cost.shape, np.inf)  # best[b, j]: blocks 0..b placed, block b on group j
    came = np.zeros(cost.shape, dtype=np.int64)
    best[0] = cost[0]
    for b in range(1, blocks):
        for j in range(1, len(order)):
            i = int(np.argmin(best[b - 1][:j]))
            best[b, j] = cost[b, j] + best[b - 1][i]
            came[b, j] = i
    j = int(np.argmin(best[-1]))
    if not np.isfinite(best[-1, j]):
        return None
    picks = [j]
    for b in range(blocks - 1, 0, -1):
        j = int(came[b, j])
        picks.append(j)
    chosen = [order[j] for j in reversed(picks) for _ in range(k)]
    paid = [c.get(g, _UNSEEN) for c, g in zip(costs, chosen, strict=True)]
    if sum(paid) > _MEAN_ACCEPTED * len(paid) or max(paid) > _WORST_ACCEPTED:
        return None
    return chosen


def assign_threads(threads: Mapping[tuple[int, str], ThreadOps],
                   groups: Mapping[int, tuple[ProcessGroup, ...]]
                   ) -> dict[tuple[int, str], ProcessGroup]:
    """(rank, thread) → the process group its collectives belong to, where the traces tell.

    `threads`: every traced rank's worker threads with their collectives. `groups`: each
    rank's process groups (`process_groups`). Each thread first gets its best fit (module
    doc); then the members of every group must have run as many of its ops in each step,
    and a thread that breaks that is moved to another group it fits (`_repaired`).
    """
    ends_by_rank = _ends_by_rank(threads)
    out: dict[tuple[int, str], ProcessGroup] = {}
    fits: dict[tuple[int, str], list[ProcessGroup]] = {}
    scatter = {}
    for (rank, tid), ops in threads.items():
        peers = {m for g in groups.get(rank, ()) for m in _judges(g, rank, ends_by_rank)}
        scatter[(rank, tid)] = {m: s for m in peers
                                if (s := _scatter(ops, ends_by_rank[m])) is not None}
    closest = [min(s for s, _cap in v.values()) for v in scatter.values() if v]
    floor = float(np.median(closest)) if closest else 0.0
    for rank in sorted({k[0] for k in threads}):
        keys = sorted((k for k in threads if k[0] == rank), key=lambda k: _tid_order(k[1]))
        costs = [_costs(threads[k], groups.get(rank, ()), scatter[k], floor) for k in keys]
        for k, c in zip(keys, costs, strict=True):
            fits[k] = sorted(c, key=lambda g: c[g])
            if fits[k]:
                out[k] = fits[k][0]
        blocks = _in_creation_order([k[1] for k in keys], costs, groups.get(rank, ()))
        if blocks is not None:
            out.update(zip(keys, blocks, strict=True))
    return _repaired(out, fits, threads)


def _ends_by_rank(threads: Mapping[tuple[int, str], ThreadOps]
                  ) -> dict[int, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Each rank's collectives of each name, all threads together: ends (sorted) and the
    durations in that order."""
    parts: dict[int, dict[str, list[tuple[np.ndarray, np.ndarray]]]] = {}
    for (rank, _tid), ops in threads.items():
        by = parts.setdefault(rank, {})
        for n in np.unique(ops.names):
            sel = ops.names == n
            by.setdefault(str(n), []).append((ops.end_ns[sel], ops.dur_ns[sel]))
    out: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for rank, by in parts.items():
        out[rank] = {}
        for n, cols in by.items():
            ends = np.concatenate([c[0] for c in cols])
            durs = np.concatenate([c[1] for c in cols])
            order = np.argsort(ends, kind="stable")
            out[rank][n] = (ends[order], durs[order])
    return out


def _judges(g: ProcessGroup, rank: int, traced: Mapping[int, Any]) -> list[int]:
    """The traced members of `g` that judge whether a thread of `rank` serves it: all of
    them, or `_JUDGES` spread over a large group (a world group's every member would make
    the inference quadratic in the ranks; a spread sample still holds members of every
    other group the thread might serve instead)."""
    members = [m for m in g.ranks if m != rank and m in traced]
    if len(members) <= _JUDGES:
        return members
    return [members[i] for i in np.linspace(0, len(members) - 1, _JUDGES).astype(int)]


def _tid_order(tid: str) -> tuple[int, str]:
    return (int(tid), "") if tid.isdigit() else (1 << 62, tid)


def _order(g: ProcessGroup) -> int:
    """Later-created groups rank lower among equals: groups with the same members are told
    apart by no timing, and every member must pick the same one."""
    return -int(g.name) if g.name.isdigit() else 0


def _repaired(out: dict[tuple[int, str], ProcessGroup],
              fits: Mapping[tuple[int, str], list[ProcessGroup]],
              threads: Mapping[tuple[int, str], ThreadOps]) -> dict[tuple[int, str],
                                                                   ProcessGroup]:
    """Move threads until every group's traced members run the same number of its ops in
    each step they all traced.

    A world all-reduce whose copies end within tens of µs also fits a pair of its members,
    and with a few such ops a thread can be given the pair. The pair's count then has one
    op too many on that rank, in exactly the steps where that thread ran one, and the
    world's one too few: the thread whose per-step count is that difference moves to the
    group it fits that lacks it.
    """
    if not threads:
        return out
    steps = np.unique(np.concatenate([t.step for t in threads.values()]))
    per: dict[tuple[int, str], np.ndarray] = {
        k: np.bincount(np.searchsorted(steps, t.step), minlength=steps.size)
        for k, t in threads.items()}
    traced: dict[int, np.ndarray] = {}
    for (rank, _tid), v in per.items():
        traced[rank] = traced.get(rank, np.zeros(steps.size, dtype=bool)) | (v > 0)
    for _ in range(len(out)):
        moved = False
        serving: dict[tuple[int, ProcessGroup], list[tuple[int, str]]] = {}
        for k, h in out.items():
            serving.setdefault((k[0], h), []).append(k)
        # the larger groups first: more members agree on what each should count
        for g in sorted({g for f in fits.values() for g in f}, key=lambda g: -len(g.ranks)):
            ranks = [r for r in g.ranks if r in traced]
            mask = np.logical_and.reduce([traced[r] for r in ranks])
            if len(ranks) < 2 or mask.sum() < _MIN_MATCHED:
                continue
            count = {r: sum((per[k][mask] for k in serving.get((r, g), ())),
                            np.zeros(int(mask.sum()), dtype=np.int64)) for r in ranks}
            votes = Counter(tuple(v.tolist()) for v in count.values()).most_common(2)
            if len(votes) == 1 or votes[0][1] == votes[1][1]:
                continue  # all agree, or nothing to repair towards
            ref = np.array(votes[0][0], dtype=np.int64)
            for r, v in count.items():
                if (ref != v).any() and _move(out, fits, per, mask, r, g, ref - v):
                    moved = True
            if moved:
                break  # the index of who serves what is stale
        if not moved:
            break
    return out


def _move(out: dict[tuple[int, str], ProcessGroup],
          fits: Mapping[tuple[int, str], list[ProcessGroup]], per: Mapping[tuple[int, str],
                                                                           np.ndarray],
          mask: np.ndarray, rank: int, g: ProcessGroup, need: np.ndarray) -> bool:
    """Move one or two of the rank's threads (a group has two by default) whose per-step
    counts add up to `need`: into `g` when it lacks them, out of it (to each thread's next
    best fit) when it has them too many."""
    if (need > 0).any() and (need < 0).any():
        return False
    into = bool((need > 0).any())
    pool = [k for k in per if k[0] == rank and
            ((out.get(k) != g and g in fits.get(k, ())) if into else out.get(k) == g)]
    for n in (1, 2):
        for ks in combinations(pool, n):
            if np.array_equal(sum(per[k][mask] for k in ks), np.abs(need)):
                for k in ks:
                    others = [h for h in fits.get(k, ()) if h != g]
                    if into:
                        out[k] = g
                    elif others:
                        out[k] = others[0]
                    else:
                        del out[k]
                return True
    return False
