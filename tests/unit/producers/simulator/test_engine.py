"""The physics of a step: collectives end together, ops never overlap, seqs count instances,
calibrated step times, and how host and link faults act."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest

from producers.simulator import FAMILY_KIND, ClusterSimulator, Fault, Layout, Noise
from schemas.frame import StepFrame
from schemas.rankstep import COLL, COMPUTE
from tests.unit.producers.simulator.support import BUSY_NOISE, frames, scenario, true_ops


def test_every_instance_ends_at_the_same_true_time_for_all_its_members():
    sim = ClusterSimulator(scenario(steps=3))
    for f in frames(sim):
        t = true_ops(sim, f)
        comm = np.flatnonzero(f.op_kind != COMPUTE)
        key = f.op_group[comm].astype(np.int64) * 10**9 + f.op_seq[comm]
        for k in np.unique(key):
            ends = t["end"][comm[key == k]]
            assert ends.min() == ends.max()


def test_slow_gpu_own_copies_are_short_and_its_compute_long():
    sc = scenario(layout=Layout(tp=4, pp=2, dp=2, gpus_per_node=4), steps=3,
                  fault=Fault("slow_gpu", 1.5, 1, "rank:5"), noise=Noise.quiet())  # fmt: skip
    sim = ClusterSimulator(sc)
    assert sim.truth.culprit == "rank:5" and sim.truth.kind == "gpu"
    f = frames(sim)[2]
    ri = f.op_rank_index()
    rank = f.rank[ri]
    fwd = (f.op_kind == COMPUTE) & (np.array(f.names)[f.op_name] == "fwd")
    peer_fwd = f.op_dur_ns[fwd & (rank == 4)]
    assert np.allclose(f.op_dur_ns[fwd & (rank == 5)] / peer_fwd, 1.5, rtol=1e-3)
    n_checked = 0
    for i in np.flatnonzero((rank == 5) & (f.op_kind == COLL)):
        same = (f.op_group == f.op_group[i]) & (f.op_seq == f.op_seq[i]) & (rank != 5)
        assert f.op_dur_ns[i] < f.op_dur_ns[same].min()
        n_checked += 1
    assert n_checked > 10


def test_ops_do_not_overlap_and_stay_inside_the_window():
    sim = ClusterSimulator(scenario(steps=6, noise=BUSY_NOISE))
    fs = frames(sim)
    assert len(fs) == 6
    for f in fs:
        assert (f.op_dur_ns >= 0).all() and (f.op_start_ns >= 0).all()
        for i in range(f.n_ranks):
            lo, hi = f.off[i], f.off[i + 1]
            s, d = f.op_start_ns[lo:hi], f.op_dur_ns[lo:hi]
            assert (s[1:] >= s[:-1] + d[:-1]).all()
            assert f.t_end_ns[i] - f.t_start_ns[i] == s[-1] + d[-1]
    # consecutive steps of a rank tile its clock: the next window starts where this one ends
    for a, b in zip(fs, fs[1:], strict=False):
        assert np.array_equal(a.t_end_ns, b.t_start_ns)


def test_seq_counts_instances_over_the_life_of_each_group():
    sim = ClusterSimulator(scenario(steps=5, noise=BUSY_NOISE))
    seqs: dict[str, list[int]] = defaultdict(list)
    for f in frames(sim):
        comm = f.op_kind != COMPUTE
        for g in np.unique(f.op_group[comm]):
            sel = comm & (f.op_group == g)
            per_rank = [f.op_seq[sel & (f.op_rank_index() == i)] for i in range(f.n_ranks)]
            per_rank = [s for s in per_rank if s.size]
            assert all(np.array_equal(per_rank[0], s) for s in per_rank)  # members agree
            seqs[f.groups[g]].extend(per_rank[0].tolist())
    for g, s in seqs.items():
        assert s == list(range(len(s))), g


def test_step_time_is_calibrated_and_checkpoint_eval_gc_show_up():
    sim = ClusterSimulator(scenario(steps=6, noise=BUSY_NOISE, step_time_s=1.5))
    fs = frames(sim)
    step_s = [float(np.median(f.t_end_ns - f.t_start_ns)) / 1e9 for f in fs]
    assert 1.35 < step_s[1] < 1.75
    names = [set(np.array(f.names)[f.op_name].tolist()) for f in fs]
    assert "checkpoint" in names[4]  # checkpoint_every=4
    assert "bwd" not in names[5] and "reduce_scatter" not in names[5]  # eval_every=5
    assert step_s[4] > step_s[1] + 2.0


def test_host_fault_grows_gaps_not_compute():
    quiet = Noise.quiet()
    base = scenario(layout=Layout(tp=2, pp=2, dp=4, gpus_per_node=4), steps=3, noise=quiet)
    clean = frames(ClusterSimulator(base))[2]
    sim = ClusterSimulator(replace(base, fault=Fault("host", 1.3, 1, "node:node-0001")))
    f = frames(sim)[2]
    assert sim.truth.kind == "host" and sim.truth.culprit == "node:node-0001"
    comp = f.op_kind == COMPUTE
    assert np.abs(f.op_dur_ns[comp] - clean.op_dur_ns[comp]).max() <= 1  # ns rounding
    on_node = np.isin(f.op_rank_index(), [4, 5, 6, 7])

    def gaps(fr: StepFrame) -> float:
        ends = fr.op_start_ns + fr.op_dur_ns
        g = fr.op_start_ns[1:] - ends[:-1]
        first = np.zeros(fr.n_ops, bool)
        first[fr.off[:-1]] = True
        return float(np.where(first[1:], 0, g)[on_node[1:]].sum() / 4)

    assert gaps(f) - gaps(clean) > 0.15 * 2.0e9  # ≈ 0.3 of a step per rank, lost in gaps


@pytest.mark.parametrize(
    "family,target,slowed,untouched",
    [("nic", "node:node-0001", "dp.0-1", "dp.1-0"),
     ("switch", "switch:leaf-01", "dp.1-0", "dp.0-1"),
     ("pp_link", "link:node-0001~node-0003", "pp.4-12", "pp.0-8")],
)  # fmt: skip
def test_link_faults_stretch_transfers_of_instances_through_the_culprit(
    family, target, slowed, untouched
):
    base = scenario(layout=Layout(tp=2, pp=2, dp=4, gpus_per_node=4, nodes_per_switch=2),
                    steps=3, noise=Noise.quiet())  # fmt: skip
    clean = ClusterSimulator(base)
    faulty = ClusterSimulator(replace(base, fault=Fault(family, 4.0, 1, target)))
    assert faulty.truth.culprit == target and faulty.truth.kind == FAMILY_KIND[family]

    def transfer(sim: ClusterSimulator, group: str) -> int:
        """Last arrival to end of the group's first instance in step 2."""
        f = frames(sim)[2]
        t = true_ops(sim, f)
        mine = f.op_group == f.groups.index(group)
        sel = mine & (f.op_seq == f.op_seq[np.flatnonzero(mine)[0]])
        return int(t["end"][sel].max() - t["start"][sel].max())

    assert transfer(faulty, slowed) > 3.0 * transfer(clean, slowed)
    assert transfer(faulty, untouched) == pytest.approx(transfer(clean, untouched), abs=2)
