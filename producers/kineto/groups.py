"""Process groups of the collectives a trace does not label, told from the traces themselves.

Why: under gloo (CPU training) a collective's trace events carry no process group. Replayed
as one group (`pg.unknown`), a rank's TP, DP and world collectives number into one sequence,
no instance matches across ranks, and a drill's slowed rank or NIC read as a job-wide shift.

What the traces do carry:
- `distributedInfo.pg_config`: the groups the rank belongs to, with their global names (the
  order of creation, the same on every rank) and member ranks;
- the worker thread that ran each collective: every gloo process group owns its threads
  (`THREADS_PER_GROUP`), so a thread's collectives are all one group's.

Three things tell which group a thread serves, each checking the ones before:
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
   that lacks exactly its ops (`_repaired`). When counts still disagree (on a loaded host
   the scheduler holds ends by milliseconds, and timing misplaces whole blocks), each rank
   takes the creation-order placement that makes its groups' counts agree (`_counted`).
   Groups with the same members are told apart by nothing: the earliest is named.

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

import math
from collections import Counter
from collections.abc import Iterable, Mapping
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
_PLACEMENTS = 1024  # creation-order placements of one rank's threads worth trying


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


@dataclass(frozen=True, slots=True)
class Placement:
    """One way a rank's threads, sorted by id, sit on its groups: one group per thread,
    with what timing says it costs in all (`paid`) and for the worst-placed thread."""

    paid: float
    worst: float
    groups: tuple[ProcessGroup, ...]


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


def _placements(n_threads: int, costs: list[dict[ProcessGroup, float]],
                groups: tuple[ProcessGroup, ...]) -> list[Placement]:
    """Every way the rank's threads, sorted by id, can be gloo's: consecutive blocks of
    `THREADS_PER_GROUP`, each one group's, the groups in the order their names count (a group
    that ran no collective left no threads in the trace). [] when the threads do not divide
    into blocks, or the ways are too many to try."""
    k = THREADS_PER_GROUP
    order = sorted(groups, key=lambda g: -_order(g))
    blocks = n_threads // k
    if not n_threads or n_threads % k or blocks > len(order) \
            or math.comb(len(order), blocks) > _PLACEMENTS:
        return []
    out = []
    for picks in combinations(order, blocks):
        chosen = tuple(g for g in picks for _ in range(k))
        paid = [c.get(g, _UNSEEN) for c, g in zip(costs, chosen, strict=True)]
        out.append(Placement(sum(paid), max(paid), chosen))
    return out


def _in_creation_order(placements: list[Placement]) -> tuple[ProcessGroup, ...] | None:
    """The cheapest placement, or None when it would give some thread a group that clearly
    does not explain it (a job with other thread counts, or groups created lazily)."""
    if not placements:
        return None
    best = min(placements, key=lambda p: p.paid)
    n = len(best.groups)
    if best.paid > _MEAN_ACCEPTED * n or best.worst > _WORST_ACCEPTED:
        return None
    return best.groups


def assign_threads(threads: Mapping[tuple[int, str], ThreadOps],
                   groups: Mapping[int, tuple[ProcessGroup, ...]]
                   ) -> dict[tuple[int, str], ProcessGroup]:
    """(rank, thread) → the process group its collectives belong to, where the traces tell.

    `threads`: every traced rank's worker threads with their collectives. `groups`: each
    rank's process groups (`process_groups`). Each thread first gets its best fit (module
    doc); then the members of every group must have run as many of its ops in each step,
    and a thread that breaks that is moved to another group it fits (`_repaired`), or its
    rank's threads to the creation-order placement the counts agree with (`_counted`).
    """
    ends_by_rank = _ends_by_rank(threads)
    out: dict[tuple[int, str], ProcessGroup] = {}
    fits: dict[tuple[int, str], list[ProcessGroup]] = {}
    options: dict[int, list[dict[tuple[int, str], ProcessGroup]]] = {}
    paid: dict[int, list[float]] = {}
    scatter = {}
    for (rank, tid), ops in threads.items():
        peers = {m for g in groups.get(rank, ()) for m in _judges(g, rank, ends_by_rank)}
        scatter[(rank, tid)] = {m: s for m in peers
                                if (s := _scatter(ops, ends_by_rank[m])) is not None}
    closest = [min(s for s, _cap in v.values()) for v in scatter.values() if v]
    floor = float(np.median(closest)) if closest else 0.0
    cost: dict[tuple[int, str], dict[ProcessGroup, float]] = {}
    for rank in sorted({k[0] for k in threads}):
        keys = sorted((k for k in threads if k[0] == rank), key=lambda k: _tid_order(k[1]))
        costs = [_costs(threads[k], groups.get(rank, ()), scatter[k], floor) for k in keys]
        for k, c in zip(keys, costs, strict=True):
            cost[k] = c
            fits[k] = sorted(c, key=lambda g: c[g])
            if fits[k]:
                out[k] = fits[k][0]
        placements = _placements(len(keys), costs, groups.get(rank, ()))
        blocks = _in_creation_order(placements)
        if blocks is not None:
            out.update(zip(keys, blocks, strict=True))
        options[rank] = [dict(zip(keys, p.groups, strict=True)) for p in placements]
        paid[rank] = [p.paid for p in placements]
    counts = _PerStep.of(threads)
    timed = _repaired(out, fits, threads, counts)
    for rank, opts in options.items():  # the timed assignment first: it stays unless beaten
        mine = {k: g for k, g in timed.items() if k[0] == rank}
        opts.insert(0, mine)
        paid[rank].insert(0, sum(cost[k].get(g, _UNSEEN) for k, g in mine.items()))
    return _counted(options, paid, counts, groups)


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
              threads: Mapping[tuple[int, str], ThreadOps],
              counts: _PerStep | None = None) -> dict[tuple[int, str], ProcessGroup]:
    """Move threads until every group's traced members run the same number of its ops in
    each step they all traced (`counts`: the threads' `_PerStep`, made here when not given).

    A world all-reduce whose copies end within tens of µs also fits a pair of its members,
    and with a few such ops a thread can be given the pair. The pair's count then has one
    op too many on that rank, in exactly the steps where that thread ran one, and the
    world's one too few: the thread whose per-step count is that difference moves to the
    group it fits that lacks it.
    """
    if not threads:
        return out
    counts = counts or _PerStep.of(threads)
    per = counts.per
    checked = counts.masks({g for f in fits.values() for g in f})
    for _ in range(len(out)):
        moved = False
        serving: dict[tuple[int, ProcessGroup], list[tuple[int, str]]] = {}
        for k, h in out.items():
            serving.setdefault((k[0], h), []).append(k)
        # the larger groups first: more members agree on what each should count
        for g in sorted(checked, key=lambda g: -len(g.ranks)):
            ranks, mask = checked[g]
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


@dataclass(frozen=True, slots=True)
class _PerStep:
    """How many collectives each thread ran in each profiler step, and the steps each rank
    traced at all: a group's members must count alike only in steps they all traced."""

    per: dict[tuple[int, str], np.ndarray]
    traced: dict[int, np.ndarray]

    @staticmethod
    def of(threads: Mapping[tuple[int, str], ThreadOps]) -> _PerStep:
        steps = np.unique(np.concatenate([t.step for t in threads.values()])) if threads \
            else np.zeros(0, dtype=np.int64)
        per = {k: np.bincount(np.searchsorted(steps, t.step), minlength=steps.size)
               for k, t in threads.items()}
        traced: dict[int, np.ndarray] = {}
        for (rank, _tid), v in per.items():
            traced[rank] = traced.get(rank, np.zeros(steps.size, dtype=bool)) | (v > 0)
        return _PerStep(per, traced)

    def masks(self, groups: Iterable[ProcessGroup]
              ) -> dict[ProcessGroup, tuple[list[int], np.ndarray]]:
        """Of `groups`, each whose traced members can be compared: those members, and the
        steps they all traced (at least `_MIN_MATCHED`)."""
        out = {}
        for g in groups:
            ranks = [r for r in g.ranks if r in self.traced]
            if len(ranks) < 2:
                continue
            mask = np.logical_and.reduce([self.traced[r] for r in ranks])
            if mask.sum() >= _MIN_MATCHED:
                out[g] = (ranks, mask)
        return out


def _counted(options: Mapping[int, list[dict[tuple[int, str], ProcessGroup]]],
             paid: Mapping[int, list[float]], counts: _PerStep,
             groups: Mapping[int, tuple[ProcessGroup, ...]]
             ) -> dict[tuple[int, str], ProcessGroup]:
    """Each rank's assignment among its `options` (the timed one first, then its
    creation-order placements, with their timing costs in `paid`) such that every group's
    traced members run as many of its ops in each step, where they can.

    Why: on a loaded host the scheduler moves a collective's end by milliseconds, more than
    one group's copies scatter from another's; with few ops a thread's best fit is then
    another group, or a whole block of threads is the next group's (a TP pair's all-reduces
    placed on the DP pair, the DP's on a pipeline pair that runs none). Counts do not jitter.
    A rank moves off its timed assignment only when that makes fewer members disagree, to
    the cheapest such placement, rank by rank until nothing moves.
    """
    checked = counts.masks({g for gs in groups.values() for g in gs})

    def tally(assign: Mapping[tuple[int, str], ProcessGroup], g: ProcessGroup
              ) -> tuple[int, ...]:
        mask = checked[g][1]
        got = np.zeros(int(mask.sum()), dtype=np.int64)
        for k, h in assign.items():
            if h == g:
                got += counts.per[k][mask]
        return tuple(got.tolist())

    mine = {r: [g for g in groups.get(r, ()) if g in checked] for r in options}
    made: dict[tuple[int, int], dict[ProcessGroup, tuple[int, ...]]] = {}

    def tallies(r: int, i: int) -> dict[ProcessGroup, tuple[int, ...]]:
        """Option `i` of rank `r`: its count of each checked group, step by step (made
        when first asked: most ranks never look past their timed assignment)."""
        if (r, i) not in made:
            made[(r, i)] = {g: tally(options[r][i], g) for g in mine[r]}
        return made[(r, i)]

    def settled(choice: dict[int, int]) -> tuple[int, dict[int, int]]:
        """Rank by rank, the option that makes the fewest members disagree, from `choice`
        on until nothing moves; the members that still disagree, and the choice."""
        seen: dict[ProcessGroup, Counter[tuple[int, ...]]] = {g: Counter() for g in checked}
        for r, gs in mine.items():
            for g in gs:
                seen[g][tallies(r, choice[r])[g]] += 1

        def disagreeing(r: int, i: int) -> int:
            bad = 0
            for g in mine[r]:
                seen[g][tallies(r, i)[g]] += 1
                bad += len(checked[g][0]) - max(seen[g].values())
                seen[g][tallies(r, i)[g]] -= 1
            return bad

        for _ in range(len(options)):
            moved = False
            for r, opts in options.items():
                if len(opts) < 2 or not mine[r]:
                    continue
                for g in mine[r]:
                    seen[g][tallies(r, choice[r])[g]] -= 1
                best = choice[r]
                if disagreeing(r, best):
                    best = min(range(len(opts)), key=lambda i: (disagreeing(r, i),
                                                                i != choice[r], paid[r][i]))
                for g in mine[r]:
                    seen[g][tallies(r, best)[g]] += 1
                moved |= best != choice[r]
                choice[r] = best
            if not moved:
                break
        return sum(len(checked[g][0]) - max(c.values()) for g, c in seen.items()), choice

    # from the timed assignment, and from every rank's cheapest placement: when timing
    # misled every rank alike (a world group's threads all given pairs), no one rank's
    # move mends a count, and only the other start finds the agreeing assignment
    cheapest = {r: 1 + int(np.argmin(p[1:])) if len(p) > 1 else 0 for r, p in paid.items()}
    timed = settled(dict.fromkeys(options, 0))
    if timed[0]:
        other = settled(cheapest)
        timed = min(timed, other, key=lambda t: (t[0], sum(paid[r][i] for r, i in t[1].items())))
    choice = timed[1]
    return _earliest_alike({k: g for r, opts in options.items()
                            for k, g in opts[choice[r]].items()}, groups)


def _earliest_alike(out: dict[tuple[int, str], ProcessGroup],
                    groups: Mapping[int, tuple[ProcessGroup, ...]]
                    ) -> dict[tuple[int, str], ProcessGroup]:
    """A group some threads serve becomes the earliest-created group with the same members
    when no thread serves that one: no timing and no count tells two such groups apart
    (a DP pair and a pipeline pair on the same ranks), and every member must name the
    same one (`_order`)."""
    used = set(out.values())
    alike: dict[tuple[int, ...], ProcessGroup] = {}
    for g in sorted({g for gs in groups.values() for g in gs}, key=lambda g: -_order(g)):
        alike.setdefault(g.ranks, g)
    return {k: alike[g.ranks] if alike[g.ranks] not in used or alike[g.ranks] == g else g
            for k, g in out.items()}


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
