"""A kept step's raw ops stay under their bound: whole ranks, the named ones' nodes first,
each kept rank's ops and stalls exactly as they were; diagnosis does not change."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import numpy as np

from detectors.config import DetectorConfig
from detectors.diagnoser import JobDiagnoser
from detectors.kept_ops import kept_frame
from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus
from schemas.frame import StepFrame


@cache
def _frames() -> list[StepFrame]:
    sc = Scenario(job="keep", layout=layout_for_gpus(64), steps=4, seed=5, heartbeats=False,
                  fault=Fault("slow_gpu", 2.0, 1))
    frames = [f for f in ClusterSimulator(sc).run() if isinstance(f, StepFrame)]
    # named host stalls (GC) on a few ranks: index into the rank rows, as assembly splits them
    return [replace(f, stall_rank=np.array([2, 13, 40, 63]), stall_name=np.array([0, 0, 1, 0]),
                    stall_ns=np.array([5, 6, 7, 8]) * 10**6) for f in frames]


def _rank_view(f: StepFrame, i: int) -> tuple:
    rows = slice(int(f.off[i]), int(f.off[i + 1]))
    stalls = f.stall_rank == i
    return (int(f.rank[i]), f.nodes[int(f.node[i])], int(f.t_end_ns[i]),
            f.op_kind[rows].tolist(), [f.names[k] for k in f.op_name[rows]],
            [f.groups[k] for k in f.op_group[rows]], f.op_start_ns[rows].tolist(),
            f.op_dur_ns[rows].tolist(), f.coords[i].tolist(),
            sorted(zip([f.names[k] for k in f.stall_name[stalls]], f.stall_ns[stalls].tolist(),
                       strict=True)))


def test_a_step_under_the_bound_is_kept_whole():
    f = _frames()[0]
    assert kept_frame(f, ["rank:3"], max_ops=f.n_ops) is f


def test_past_the_bound_the_named_nodes_come_first_then_a_spread_each_rank_whole():
    f = _frames()[2]
    bound = f.n_ops // 2
    kept = kept_frame(f, ["rank:13", "node:" + f.nodes[int(f.node[40])], "link:x"], bound)
    assert kept.n_ops <= bound and kept.n_ranks < f.n_ranks
    assert (np.diff(kept.rank) > 0).all() and kept.off[-1] == kept.n_ops
    named_nodes = {f.nodes[int(f.node[13])], f.nodes[int(f.node[40])]}
    on_named = {int(r) for r, n in zip(f.rank, f.node, strict=True) if f.nodes[n] in named_nodes}
    assert on_named <= set(kept.rank.tolist())
    spread = sorted(set(kept.rank.tolist()) - on_named)
    assert len(spread) >= 4 and spread[-1] - spread[0] > f.n_ranks // 2  # across the job
    index = {int(r): i for i, r in enumerate(f.rank)}
    for j, r in enumerate(kept.rank.tolist()):
        assert _rank_view(kept, j) == _rank_view(f, index[r])
    assert kept.names is f.names and kept.groups is f.groups
    np.testing.assert_array_equal(kept.missing, f.missing)


def test_named_ranks_over_the_bound_are_all_kept_and_nothing_else():
    f = _frames()[1]
    kept = kept_frame(f, [f"rank:{r}" for r in f.rank.tolist()], max_ops=10)
    assert kept.n_ranks == f.n_ranks and kept.n_ops == f.n_ops


def test_the_bound_changes_what_is_stored_not_what_is_found():
    sc = Scenario(job="keep-d", layout=layout_for_gpus(64), steps=40, seed=2,
                  fault=Fault("slow_gpu", 1.5, 15), heartbeats=False)
    whole, bounded = JobDiagnoser("keep-d"), JobDiagnoser(
        "keep-d", config=replace(DetectorConfig(), keep_ops=1_000))
    kept_whole, kept_bounded = [], []
    for f in ClusterSimulator(sc).run():
        if not isinstance(f, StepFrame):
            continue
        a, b = whole.on_frame(f), bounded.on_frame(f)
        assert a.incidents == b.incidents
        kept_whole += [r.frame for r in a.reports if r.frame is not None]
        kept_bounded += [r.frame for r in b.reports if r.frame is not None]
    assert kept_whole and len(kept_whole) == len(kept_bounded)
    assert all(k.n_ops <= 1_000 < w.n_ops for w, k in zip(kept_whole, kept_bounded,
                                                         strict=True))
