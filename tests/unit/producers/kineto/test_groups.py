"""A gloo trace's unlabelled ops get their groups: threads by their ends, sends by their pairs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from producers.kineto.groups import (
    ProcessGroup,
    ThreadOps,
    _earliest_alike,
    _repaired,
    assign_threads,
    process_groups,
)

MS = 1_000_000
WORLD = ProcessGroup("0", "default_pg", (0, 1, 2, 3))
TP = (ProcessGroup("1", "undefined", (0, 1)), ProcessGroup("2", "undefined", (2, 3)))
DP = (ProcessGroup("3", "undefined", (0, 2)), ProcessGroup("4", "undefined", (1, 3)))


def test_pg_config_keeps_groups_of_two_or_more_and_skips_what_is_malformed():
    dist = {"pg_config": [
        {"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1, 2, 3]},
        {"pg_name": "5", "pg_desc": "undefined", "ranks": [2]},  # a lone rank waits on nobody
        {"pg_name": "6", "ranks": "0,1"},
        "junk",
        {"pg_name": "7", "pg_desc": "mesh_tp", "ranks": [3, 1, 1]},
    ]}
    assert process_groups(dist) == (WORLD, ProcessGroup("7", "mesh_tp", (1, 3)))
    assert process_groups({}) == ()


def _job(rng, world_turns=(0, 1)):
    """4 ranks × 30 steps: each TP pair's all-reduce at its own pace (ms of lag, step by
    step), each DP pair's at another, one world all-reduce that ends on all four together;
    every group's two threads take turns, threads numbered in the groups' creation order."""
    steps = np.arange(30)
    tp_lag = rng.integers(0, 5 * MS, size=(2, 30))
    dp_lag = rng.integers(0, 5 * MS, size=(2, 30))
    threads = {}
    for r in range(4):
        base = 100 * r
        for k, (at_ms, lag) in enumerate(((90, None), (40, tp_lag[r // 2]),
                                          (70, dp_lag[r % 2]))):
            for turn in (0, 1):
                at = steps[turn::2]
                ends = at * 100 * MS + at_ms * MS + (0 if lag is None else lag[at])
                ends = ends + rng.integers(0, 20_000, size=at.size)  # µs-scale wake-up jitter
                threads[(r, str(base + 2 * k + turn))] = ThreadOps.of(
                    ["all_reduce"] * at.size, ends, MS, at)
    groups = {r: (WORLD, TP[r // 2], DP[r % 2]) for r in range(4)}
    return threads, groups


def test_each_thread_gets_the_group_whose_members_end_with_it():
    threads, groups = _job(np.random.default_rng(1))
    found = {k: g.name for k, g in assign_threads(threads, groups).items()}
    for r in range(4):
        base = 100 * r
        assert [found[(r, str(base + i))] for i in range(6)] == \
            ["0", "0", TP[r // 2].name, TP[r // 2].name, DP[r % 2].name, DP[r % 2].name]


def test_a_thread_whose_group_is_traced_nowhere_else_is_not_given_a_lockstep_group():
    """Ranks 0 and 2 traced only, and no world collective in the window: rank 0's TP
    partner is not traced, so its TP all-reduces end with nobody's, and rank 2's (its own
    pair's, in lockstep) end milliseconds off them, longer than either op lasts. They are
    no world ops: the threads keep their place in the creation order, the TP pair."""
    threads, groups = _job(np.random.default_rng(3))
    traced = {k: t for k, t in threads.items()
              if k[0] in (0, 2) and int(k[1]) % 100 >= 2}  # the world's threads ran nothing
    found = {k: g.name for k, g in assign_threads(traced, groups).items()}
    assert [found[(0, str(i))] for i in range(2, 6)] == ["1", "1", "3", "3"]
    assert [found[(2, str(200 + i))] for i in range(2, 6)] == ["2", "2", "3", "3"]


def test_a_thread_put_in_the_wrong_group_is_moved_by_the_counts():
    """Rank 1's two world threads were given its TP pair (with few ops, a world all-reduce
    can end closer to one member than the job's noise): the pair then runs one op a step
    too many on rank 1 and the world one too few, in exactly those threads' steps."""
    threads, groups = _job(np.random.default_rng(2))
    right = assign_threads(threads, groups)
    wrong = dict(right)
    wrong[(1, "100")] = wrong[(1, "101")] = TP[0]
    fits = {k: [right[k], *[g for g in groups[k[0]] if g != right[k]]] for k in threads}
    assert _repaired(wrong, fits, threads) == right
    # a count that agrees with nothing stays as it is: no majority to repair towards
    half = {k: g for k, g in right.items() if k[0] in (0, 1)}
    half[(1, "100")] = half[(1, "101")] = TP[0]
    assert _repaired(dict(half), fits, {k: t for k, t in threads.items() if k[0] < 2}) == half


def test_a_loaded_hosts_gloo_threads_are_read_by_their_counts():
    """Recorded from torch.profiler on 4 gloo ranks sharing 2 loaded cores (world, TP pairs,
    DP pairs, and pipeline pairs that run only sends): the scheduler held some collectives'
    ends by milliseconds, so with 3 ops a thread no world thread fit the world by timing and
    the creation order cost too much to keep. The pairs' counts then disagree, and the
    placement in creation order whose counts all agree is the job's: per rank, by thread
    id, the world's two threads, the TP pair's, the DP pair's."""
    data = json.loads((Path(__file__).parents[3] / "data" / "kineto"
                       / "gloo-loaded-host-threads.json").read_text())
    groups = {int(r): tuple(ProcessGroup(n, d, tuple(rs)) for n, d, rs in gs)
              for r, gs in data["groups"].items()}
    threads = {(t["rank"], t["tid"]): ThreadOps.of(t["names"], t["end_ns"], t["dur_ns"],
                                                   t["step"]) for t in data["threads"]}
    found = assign_threads(threads, groups)
    for r in range(4):
        tids = sorted((k for k in threads if k[0] == r), key=lambda k: int(k[1]))
        assert [found[k].name for k in tids] == \
            ["0", "0", TP[r // 2].name, TP[r // 2].name, DP[r % 2].name, DP[r % 2].name]


def test_of_two_groups_on_the_same_ranks_the_earlier_is_named():
    """A DP pair and a pipeline pair on ranks 0 and 2: nothing tells their collectives
    apart, so every member names the one made first, unless threads serve both."""
    pp = ProcessGroup("5", "undefined", (0, 2))
    groups = {0: (WORLD, TP[0], DP[0], pp), 2: (WORLD, TP[1], DP[0], pp)}
    out = {(0, "a"): pp, (2, "b"): pp, (0, "c"): TP[0]}
    assert _earliest_alike(out, groups) == {(0, "a"): DP[0], (2, "b"): DP[0], (0, "c"): TP[0]}
    both = {(0, "a"): pp, (2, "b"): DP[0]}
    assert _earliest_alike(both, groups) == both
