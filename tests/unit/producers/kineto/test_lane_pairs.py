"""The pairs of lanes `streams` judges (`producers.kineto.lane_pairs`): few per lane, and
the same groups as judging every pair."""

from __future__ import annotations

import numpy as np
import orjson

from producers.kineto.groups import ThreadOps
from producers.kineto.lane_pairs import components, distinct
from producers.kineto.streams import Weighed, assign_streams
from producers.kineto.trace import parse_trace, stream_ops
from producers.simulator import ClusterSimulator
from producers.simulator.scenario import Scenario, layout_for_gpus
from tests.unit.producers.kineto.conftest import older_nccl_lanes, older_nccl_traces

MS = 1_000_000


def _lockstep(groups: int, size: int, spread: int, hop: int = 3_000, seed: int = 0
              ) -> tuple[dict[tuple[int, str], ThreadOps], dict[int, str], set[tuple[int, ...]]]:
    """Data-parallel-like groups of `size` members running the same all-reduces in lockstep
    (one bucket), each ending on its own members' arrival (its ends up to `spread` ns from
    the other groups'), each copy within a `hop` of its group's; 8 ranks a node, each on
    its node's clock (up to ±5 ms off), a group's members on different nodes."""
    rng = np.random.default_rng(seed)
    steps = np.repeat(np.arange(8), 4)
    base = np.arange(steps.size) * 20 * MS
    pattern = rng.integers(0, spread + 1, size=(groups, steps.size))
    lanes, nodes, clock = {}, {}, {}
    for g in range(groups):
        for s in range(size):
            r = s * groups + g
            nodes[r] = f"node-{r // 8}"
            off = clock.setdefault(nodes[r], int(rng.integers(-5 * MS, 5 * MS)))
            end = base + pattern[g] + rng.integers(0, hop + 1, size=steps.size) + off
            arrived = MS + rng.integers(0, 500_001, size=steps.size)  # early ones wait longer
            lanes[(r, "20")] = ThreadOps.of(["all_reduce"] * steps.size, end // 1000 * 1000,
                                            arrived, steps)
    truth = {tuple(range(g, groups * size, groups)) for g in range(groups)}
    return lanes, nodes, truth


def test_the_pairs_judged_grow_with_the_ranks_not_their_square():
    """One bucket of 256 to 2,048 lanes (a lane per rank): judging every pair of them is
    quadratic (32,640 to 2 million pairs, 127 to 1,023 a lane); at most
    `_PROBES` · `_CHAIN` + 2 · `_NEAREST` (32) a lane are judged at every size, and the
    pairs on each lane's node (7 a node's 8 lanes, 3.5 a lane), and the groups are the
    job's."""
    per_lane = []
    for ranks in (256, 512, 1024, 2048):
        lanes, nodes, truth = _lockstep(ranks // 8, 8, 300_000)
        weighed = Weighed()
        found = assign_streams(lanes, {}, nodes, weighed=weighed)
        assert {g.ranks for g in found.values()} == truth
        assert weighed.pairs == ranks * (ranks - 1) // 2
        assert weighed.judged <= (32 + 3.5) * ranks
        per_lane.append(weighed.judged / ranks)
    assert per_lane[-1] < 2 * per_lane[0]  # 8 times the ranks (a square: 8 times a lane)


def test_groups_whose_bands_are_close_come_out_as_when_every_pair_is_judged():
    """Groups that end a few hops apart: the pairs of two groups stray less than `_GAP`
    times one group's (16 groups: no group told; 4 groups: all four one), which only the
    pairs of two groups that end nearest show. Judging each lane's nearest alone, the 16
    and the 4 groups came out (the lower band looked apart)."""
    for groups, size, spread, hop, seed in ((16, 8, 100_000, 8_000, 0), (4, 16, 30_000, 3_000, 1)):
        lanes, nodes, _truth = _lockstep(groups, size, spread, hop, seed)
        found = assign_streams(lanes, {}, nodes)
        assert found == assign_streams(lanes, {}, nodes, exhaustive=True)
        assert len({g.ranks for g in found.values()}) == (0 if groups == 16 else 1)


def test_a_larger_job_gets_the_groups_that_judging_every_pair_gets():
    """A 256-GPU job (TP8, PP4, DP8: 896 lanes, one bucket of 384 pipeline lanes) from
    older NCCL traces: the groups found judging a tenth of the pairs are those found judging
    them all, and the job's own."""
    sc = Scenario(job="j", layout=layout_for_gpus(256), steps=6, seed=4, heartbeats=False)
    msgs = [v for _t, _k, v, _ts in ClusterSimulator(sc).events() if "ops" in v]
    lanes, nodes = older_nccl_lanes(msgs, seed=4)
    weighed = Weighed()
    found = assign_streams(lanes, {}, nodes, weighed=weighed)
    assert found == assign_streams(lanes, {}, nodes, exhaustive=True)
    truth: dict[str, set[int]] = {}
    for m in msgs:
        for g in m["ops"]["group"]:
            truth.setdefault(g, set()).add(m["rank"])
    assert {g.ranks for g in found.values()} == \
        {tuple(sorted(rs)) for g, rs in truth.items() if g and len(rs) > 1}
    assert weighed.judged < weighed.pairs / 10


def test_older_nccl_lanes_are_what_the_replay_reads_from_the_traces():
    sc = Scenario(job="j", layout=layout_for_gpus(16), steps=3, seed=5, heartbeats=False)
    msgs = [v for _t, _k, v, _ts in ClusterSimulator(sc).events() if "ops" in v]
    lanes, nodes = older_nccl_lanes(msgs, seed=5)
    read = {}
    for name, doc in older_nccl_traces(msgs, seed=5).items():
        trace = parse_trace(orjson.loads(orjson.dumps(doc)), "j", rank=None,
                            node=name.split("_")[0])
        assert nodes[trace.rank] == trace.node
        read.update({(trace.rank, s): ops for s, ops in stream_ops(trace).items()})
    assert lanes.keys() == read.keys()
    for k, ops in read.items():
        for column in ("names", "end_ns", "dur_ns", "step"):
            assert np.array_equal(getattr(lanes[k], column), getattr(ops, column)), (k, column)


def test_components_are_named_by_their_lowest_lane():
    i, j = np.array([4, 1, 2, 6]), np.array([3, 2, 0, 5])
    assert components(8, i, j).tolist() == [0, 0, 0, 3, 3, 5, 5, 7]
    assert components(3, np.array([], dtype=int), np.array([], dtype=int)).tolist() == [0, 1, 2]


def test_distinct_is_unique():
    x = np.random.default_rng(0).integers(0, 50, size=200)
    assert np.array_equal(distinct(x), np.unique(x))
    assert distinct(np.empty(0, dtype=np.int64)).size == 0
