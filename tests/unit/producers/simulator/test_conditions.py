"""Conditions that are not faults: which ranks are traced, and workload imbalance (sequence
lengths that move between DP replicas, a last pipeline stage heavier by design)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from producers.simulator import ClusterSimulator, Layout, Noise
from producers.simulator.conditions import Workload, traced_mask
from producers.simulator.topology import Topology
from tests.unit.producers.simulator.support import SMALL, frames, scenario

LAYOUT = Layout(tp=2, pp=2, dp=4, gpus_per_node=4)  # 16 ranks, 4 nodes, no MoE


def test_traced_subsets():
    topo = Topology(SMALL)
    rng = np.random.default_rng
    assert traced_mask("all", topo, rng(1)) is None
    tp0 = traced_mask("tp0", topo, rng(1))
    assert np.flatnonzero(tp0).tolist() == list(range(0, 16, 2))  # tp is the fastest index
    half = traced_mask("half", topo, rng(1))
    assert half.sum() == 8 and np.array_equal(half, traced_mask("half", topo, rng(1)))
    assert not np.array_equal(half, traced_mask("half", topo, rng(2)))
    dark = traced_mask("node_dark", topo, rng(1))
    off = np.flatnonzero(~dark)
    assert off.size == 4 and len(set(topo.node_of[off].tolist())) == 1
    assert dark[topo.node_of != topo.node_of[off[0]]].all()


def _compute_by_rank(f, name: str) -> np.ndarray:
    sel = np.array(f.names)[f.op_name] == name
    return np.bincount(f.op_rank_index()[sel], f.op_dur_ns[sel], minlength=f.n_ranks)


def test_stage_imbalance_makes_the_last_stage_compute_longer_and_keeps_the_step_time():
    base = scenario(layout=LAYOUT, steps=3, noise=Noise.quiet(), step_time_s=2.0)
    plain = frames(ClusterSimulator(base))[2]
    sim = ClusterSimulator(replace(base, stage_imbalance=1.4))
    f = frames(sim)[2]
    fwd = _compute_by_rank(f, "fwd")
    assert np.allclose(fwd[8:] / fwd[:8], 1.4, rtol=1e-3)  # ranks 8-15: the last stage
    assert np.allclose(_compute_by_rank(plain, "fwd")[8:] / _compute_by_rank(plain, "fwd")[:8],
                       1.0, rtol=1e-3)  # fmt: skip
    step_s = float(np.median(f.t_end_ns - f.t_start_ns)) / 1e9
    assert 1.9 < step_s < 2.1  # calibrated with the imbalance: it is the healthy job
    assert sim.truth.culprit is None


def test_seq_imbalance_moves_between_replicas_and_some_stay_heavier():
    lay = Layout(tp=2, pp=2, dp=16, gpus_per_node=4)
    sc = scenario(layout=lay, steps=12, noise=Noise.quiet(), seq_imbalance=0.3)
    topo = Topology(lay)
    per_step = []
    for f in frames(ClusterSimulator(sc)):
        fwd = _compute_by_rank(f, "fwd")
        per_replica = np.bincount(topo.dp_of[f.rank], fwd) / np.bincount(topo.dp_of[f.rank])
        per_step.append(per_replica / np.median(per_replica))
    ratios = np.array(per_step)  # (steps, dp)
    assert (ratios.std(axis=1) > 0.1).all()  # replicas differ in every step
    assert len({int(np.argmax(r)) for r in ratios}) > 2  # and the heaviest one moves
    heavy = np.flatnonzero(np.median(ratios, axis=0) > 1.12)  # 16 // 8 = 2 replicas, +15–30%
    assert 1 <= heavy.size <= 3
    wl = Workload(sc, topo, np.random.default_rng(0))
    draws = np.array([wl.factor() for _ in range(400)])
    assert abs(np.mean(draws / wl.base) - 1.0) < 0.02  # the moving part has mean 1


def test_no_workload_imbalance_draws_nothing():
    topo = Topology(LAYOUT)
    rng = np.random.default_rng(5)
    wl = Workload(scenario(layout=LAYOUT), topo, rng)
    assert wl.factor() is None
    assert rng.integers(1 << 30) == np.random.default_rng(5).integers(1 << 30)
