"""Every fault family: who it hits, when, and the ground truth a perfect diagnosis gives;
hangs stop ranks and leave their peers blocked."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from producers.simulator import (
    FAMILIES,
    FAMILY_KIND,
    SEVERITIES,
    ClusterSimulator,
    Fault,
    Layout,
    Noise,
    layout_for_gpus,
)
from producers.simulator.simulator import EPOCH_NS, HANG_TAIL_NS
from schemas.decode import decode_heartbeat
from schemas.frame import StepFrame
from schemas.rankstep import COMPUTE
from schemas.wire import HeartbeatV1
from tests.unit.producers.simulator.support import frames, heartbeats, scenario


def test_slow_node_slows_every_rank_of_the_node():
    fault = Fault("slow_node", 1.3, 1, "node:node-0002")
    sc = scenario(layout=Layout(tp=2, pp=2, dp=4, gpus_per_node=4), steps=3, fault=fault,
                  noise=Noise.quiet())  # fmt: skip
    f = frames(ClusterSimulator(sc))[2]
    ri = f.op_rank_index()
    bwd = np.array(f.names)[f.op_name] == "bwd"
    per_rank = np.array([f.op_dur_ns[bwd & (ri == i)].sum() for i in range(16)])
    assert np.allclose(per_rank[8:12] / per_rank[12:16], 1.3, rtol=1e-3)
    assert np.allclose(per_rank[:4] / per_rank[4:8], 1.0, rtol=1e-3)


def test_a_rank_stall_idles_one_rank_and_leaves_its_compute_alone():
    fault = Fault("rank_stall", 1.3, 1, "rank:5")
    sc = scenario(layout=Layout(tp=2, pp=2, dp=4, gpus_per_node=4), steps=3, fault=fault,
                  noise=Noise.quiet())  # fmt: skip
    before, during = frames(ClusterSimulator(sc))[0], frames(ClusterSimulator(sc))[2]

    def compute_and_idle(f: StepFrame) -> tuple[np.ndarray, np.ndarray]:
        ri = f.op_rank_index()
        comp = f.op_kind == 0
        compute = np.bincount(ri[comp], weights=f.op_dur_ns[comp], minlength=16)
        # idle: the rank's span less what its ops covered (ops of one rank do not overlap
        # in a quiet GPipe step, apart from waits inside collectives, which count as ops)
        ends = f.op_start_ns + f.op_dur_ns
        covered = np.bincount(ri, weights=f.op_dur_ns, minlength=16)
        span = np.array([ends[ri == i].max() for i in range(16)])
        return compute, span - covered

    c0, idle0 = compute_and_idle(before)
    c1, idle1 = compute_and_idle(during)
    assert np.allclose(c1, c0, rtol=1e-6)  # no GPU is slower
    grew = idle1 - idle0
    step_ns = sc.step_time_s * 1e9
    assert 0.2 * step_ns < grew[5] < 0.4 * step_ns  # about (1.3 − 1) of a step, one lump
    assert np.all(np.abs(np.delete(grew, 5)) < 0.05 * step_ns)  # its peers wait, not idle


@pytest.mark.parametrize("family", FAMILIES)
def test_ground_truth_of_every_family(family):
    sev = SEVERITIES[family][-1]
    sim = ClusterSimulator(scenario(layout=layout_for_gpus(256), steps=4,
                                    fault=Fault(family, sev, 2)))  # fmt: skip
    t = sim.truth
    prefix = {"gpu": "rank:", "node": "node:node-", "switch": "switch:leaf-",
              "host": "rank:" if family == "rank_stall" else "node:node-",
              "hang": "group:dp." if family == "comm_hang" else "rank:",
              "link": "link:node-" if family == "pp_link" else "node:node-"}  # fmt: skip
    assert t.family == family and t.kind == FAMILY_KIND[family]
    assert t.culprit is not None and t.culprit.startswith(prefix[t.kind])
    assert t.onset_step == 2 and t.severity == sev and t.gpus == 256
    assert t.onset_ts_ns is not None and t.onset_ts_ns > EPOCH_NS + 3e9
    if family == "pp_link":
        a, b = t.culprit[5:].split("~")
        assert a < b


def test_clean_truth_and_explicit_targets():
    t = ClusterSimulator(scenario()).truth
    assert (t.family, t.kind, t.culprit, t.onset_step, t.onset_ts_ns) == (None,) * 5
    lay = layout_for_gpus(256)
    for family, target in [
        ("thermal", "rank:77"),
        ("slow_node", "node-0003"),
        ("pp_link", "link:node-0009~node-0001"),
        ("comm_hang", "dp.2-5"),
    ]:
        culprit = ClusterSimulator(scenario(layout=lay, fault=Fault(family, 1.0, 1, target)))
        expect = {"slow_node": "node:node-0003", "pp_link": "link:node-0001~node-0009",
                  "comm_hang": "group:dp.2-5"}.get(family, target)  # fmt: skip
        assert culprit.truth.culprit == expect


def test_thermal_throttles_in_episodes_starting_at_onset():
    sc = scenario(layout=Layout(tp=2, pp=2, dp=2, gpus_per_node=8), steps=30,
                  fault=Fault("thermal", 2.0, 3, "rank:2"), noise=Noise.quiet())  # fmt: skip
    ratios = []
    for f in frames(ClusterSimulator(sc)):
        fwd = np.array(f.names)[f.op_name] == "fwd"
        ri = f.op_rank_index()
        ratios.append(f.op_dur_ns[fwd & (ri == 2)].sum() / f.op_dur_ns[fwd & (ri == 3)].sum())
    on = np.isclose(ratios, 2.0, rtol=1e-3)
    assert not on[:3].any() and on[3:9].all()  # "on" at onset for at least 6 steps
    assert (~on[3:]).any()  # and it comes and goes
    assert np.isclose(np.array(ratios)[~on], 1.0, rtol=1e-3).all()


def test_hung_rank_stops_reporting_steps_and_peers_block():
    sc = scenario(layout=layout_for_gpus(64), steps=6, seed=3,
                  fault=Fault("hang_rank", 1.0, 3, "rank:56"), heartbeats=False)  # fmt: skip
    sim = ClusterSimulator(sc)
    out = list(sim.run())
    fs = [x for x in out if isinstance(x, StepFrame)]
    assert all(56 not in f.rank for f in fs if f.step >= 3)
    assert [f.step for f in fs][:3] == [0, 1, 2]
    assert all(f.n_ranks == 64 for f in fs[:3])
    assert all(f.missing.size == 64 - f.n_ranks for f in fs)
    hbs = [x for x in out if isinstance(x, HeartbeatV1)]  # hang scenarios always beat
    onset = sim.truth.onset_ts_ns
    after = [h for h in hbs if h.ts_ns > onset + 1e9]
    assert {h.rank for h in after} == set(range(64))
    own = [h for h in after if h.rank == 56]
    assert all(h.step == 3 and h.inflight == [] for h in own)
    late = [h for h in after if h.ts_ns > onset + 10e9 and h.rank != 56]
    assert late and all(len(h.inflight) == 1 for h in late)
    for r in range(64):  # a blocked rank reports the same op, in flight since the same time
        mine = {(h.step, h.inflight[0].group, h.inflight[0].seq, h.inflight[0].start_ns)
                for h in late if h.rank == r}  # fmt: skip
        assert len(mine) <= 1
    last = max(h.ts_ns for h in hbs)
    assert onset + HANG_TAIL_NS - 2e9 < last < onset + HANG_TAIL_NS + 1e9
    evs = list(sim.events())
    assert evs[-1][2]["event"] == "end"
    for topic, _, value, _ in evs:  # hang heartbeats (with ops in flight) are valid v1 too
        if topic == "flare.heartbeats.v1":
            decode_heartbeat(orjson.dumps(value))
    assert not any(e[0] == "flare.steps.v1" and e[2]["rank"] == 56 and e[2]["step"] >= 3
                   for e in evs)  # fmt: skip


def test_comm_hang_blocks_the_dp_group_in_its_collective():
    sc = scenario(layout=layout_for_gpus(64), steps=6, seed=3,
                  fault=Fault("comm_hang", 1.0, 3, "group:dp.1-0"))  # fmt: skip
    sim = ClusterSimulator(sc)
    assert sim.truth.culprit == "group:dp.1-0" and sim.truth.kind == "hang"
    hbs = heartbeats(sim)
    onset = sim.truth.onset_ts_ns
    late = {h.rank: h for h in hbs if h.ts_ns > onset + 5e9}
    members = [32 + 8 * d for d in range(4)]  # pp 1, tp 0
    for r in members:
        (op,) = late[r].inflight
        assert (late[r].step, op.group, op.name) == (3, "dp.1-0", "reduce_scatter")
    assert all(late[r].inflight for r in range(64))
    fs = frames(sim)
    assert all(f.step <= 4 for f in fs)
    assert not any(set(members) & set(f.rank.tolist()) for f in fs if f.step >= 3)


def test_a_straggler_is_severely_slow_but_alive():
    sc = scenario(layout=Layout(tp=2, pp=2, dp=2, gpus_per_node=4), steps=6,
                  fault=Fault("straggler", 10.0, 2, "rank:3"), noise=Noise.quiet())  # fmt: skip
    sim = ClusterSimulator(sc)
    assert (sim.truth.kind, sim.truth.culprit) == ("gpu", "rank:3")
    fs = frames(sim)
    assert [f.step for f in fs] == list(range(6))  # every rank finishes every step
    assert all(f.missing.size == 0 and f.n_ranks == 8 for f in fs)
    step_s = [float(np.median(f.t_end_ns - f.t_start_ns)) / 1e9 for f in fs]
    assert step_s[3] > 5 * step_s[1]  # the whole job crawls with it
    f = fs[3]
    fwd = np.array(f.names)[f.op_name] == "fwd"
    ri = f.op_rank_index()
    ratio = f.op_dur_ns[fwd & (ri == 3)].sum() / f.op_dur_ns[fwd & (ri == 2)].sum()
    assert np.isclose(ratio, 10.0, rtol=1e-3)


def test_flapping_nic_toggles_its_link_fault_in_steady_bursts():
    lay = Layout(tp=2, pp=2, dp=4, gpus_per_node=4, nodes_per_switch=2)
    sc = scenario(layout=lay, steps=24, noise=Noise.quiet(),
                  fault=Fault("flapping_nic", 4.0, 3, "node:node-0001"))  # fmt: skip
    sim = ClusterSimulator(sc)
    assert (sim.truth.kind, sim.truth.culprit) == ("link", "node:node-0001")
    on = np.array([sim.plan.active(s) for s in range(24)])
    assert not on[:3].any() and on[3]
    flips = np.flatnonzero(np.diff(on[3:].astype(int))) + 1
    runs = np.diff(np.concatenate([[0], flips]))  # lengths of the on, off, on, ... runs
    assert len(runs) >= 3
    assert len(set(runs[0::2].tolist())) == 1 and len(set(runs[1::2].tolist())) == 1  # steady
    assert 1 <= runs[0] <= 2 and 3 <= runs[1] <= 7  # bursts, as drills on real training show

    def transfer(f: StepFrame, group: str) -> int:
        """Last arrival to end of the group's first instance."""
        mine = f.op_group == f.groups.index(group)
        sel = mine & (f.op_seq == f.op_seq[np.flatnonzero(mine)[0]])
        start = f.t_start_ns[f.op_rank_index()] - sim.clocks.skew_ns[f.node[f.op_rank_index()]]
        start = start + f.op_start_ns
        return int((start + f.op_dur_ns)[sel].max() - start[sel].max())

    xfer = np.array([transfer(f, "dp.0-1") for f in frames(sim)])  # crosses node-0001
    slow = xfer > 2.0 * xfer[0]
    assert np.array_equal(slow, on)  # the evidence comes and goes with the fault


def test_partial_bursts_of_a_flapping_nic_cross_step_ends_at_a_period_of_its_own():
    lay = Layout(tp=2, pp=2, dp=4, gpus_per_node=4, nodes_per_switch=2)
    sc = scenario(layout=lay, steps=24, noise=Noise.quiet(), partial_bursts=True,
                  fault=Fault("flapping_nic", 4.0, 3, "node:node-0001"))  # fmt: skip
    sim = ClusterSimulator(sc)
    assert (sim.truth.kind, sim.truth.culprit) == ("link", "node:node-0001")
    on = np.array([sim.plan.active(s) for s in range(24)])
    assert not on[:3].any() and on[3]
    window = np.array([sim.plan.covered(s) for s in range(24)])
    starts = np.flatnonzero(on & ~np.roll(on, 1))
    gaps = np.diff(starts)
    assert len(starts) >= 3 and gaps.max() - gaps.min() <= 1  # a steady period of its own
    assert 4 <= gaps.min() and gaps.max() <= 9  # a burst in every 4-9 steps, as drills show
    length = np.diff(window, axis=1)[:, 0]
    assert all(0.5 <= length[a : a + 2].sum() <= 1.5 for a in starts)  # 0.5-1.5 steps long
    # a burst that spills into the next step runs to the end of its first: a toggle keeps
    # no step boundary
    assert all(window[a, 1] == 1.0 for a in starts if on[a + 1])

    def comm_ns(f: StepFrame) -> np.ndarray:
        """Each collective and transfer of node-0001's ranks in the step, in op order."""
        ri = f.op_rank_index()
        return f.op_dur_ns[(f.node[ri] == f.nodes.index("node-0001")) & (f.op_kind != COMPUTE)]

    comm = [comm_ns(f) for f in frames(sim)]
    stretched = np.array([(c > 2 * comm[0]).mean() for c in comm])
    assert np.array_equal(stretched > 0, on)  # the evidence comes and goes with the bursts
    assert (stretched[on] < 0.9).all()  # and in each, some of the step's transfers only


def test_a_nic_slow_one_way_ends_its_partners_copies_late_and_its_own_on_time():
    """`oneway_nic`: node-0001's NIC sends at a quarter speed (a rate limit on its egress).
    In each data-parallel all-reduce it is in, its own ranks' copies end with the healthy
    transfer and the others' when its data reaches them; a pipeline transfer is slow only
    from it. Without the option every copy ends late together, as before."""
    lay = Layout(tp=2, pp=2, dp=4, gpus_per_node=4, nodes_per_switch=2)
    fault = Fault("nic", 4.0, 1, "node:node-0001")

    def dp_ends(oneway: bool) -> tuple[np.ndarray, np.ndarray]:
        sim = ClusterSimulator(scenario(layout=lay, steps=3, noise=Noise.quiet(), fault=fault,
                                        oneway_nic=oneway))
        f = frames(sim)[2]
        ri = f.op_rank_index()
        start = f.t_start_ns[ri] - sim.clocks.skew_ns[f.node[ri]]  # one true clock
        end = start + f.op_start_ns + f.op_dur_ns
        mine = f.op_group == f.groups.index("dp.0-1")  # crosses node-0001
        sel = mine & (f.op_seq == f.op_seq[np.flatnonzero(mine)[0]])
        own = f.node[ri[sel]] == f.nodes.index("node-0001")
        return end[sel][own], end[sel][~own]

    own, others = dp_ends(True)
    both_own, both_others = dp_ends(False)
    assert own.size and others.size
    assert own.max() < others.min() - 1e6  # its own copies end first, by over a ms
    assert np.allclose(both_own, both_others[0]) and np.allclose(both_others, both_others[0])

    def pp_transfers(oneway: bool) -> tuple[float, float]:
        """The longest pipeline transfer (later post to end) out of node-0001, and into it."""
        sim = ClusterSimulator(scenario(layout=lay, steps=3, noise=Noise.quiet(), fault=fault,
                                        oneway_nic=oneway))
        g = frames(sim)[2]
        ri = g.op_rank_index()
        start = g.t_start_ns[ri] - sim.clocks.skew_ns[g.node[ri]] + g.op_start_ns
        end = start + g.op_dur_ns
        names = np.array(g.names)[g.op_name]
        p2p = np.flatnonzero(np.isin(names, ["send", "recv"]))
        key = g.op_group[p2p].astype(np.int64) * (1 << 32) + g.op_seq[p2p]
        out = into = 0.0
        for k in np.unique(key):
            pair = p2p[key == k]
            if pair.size != 2:
                continue
            took = float(end[pair].max() - start[pair].max())
            here = g.node[ri[pair]] == g.nodes.index("node-0001")
            if here.sum() != 1:
                continue
            if names[pair[here][0]] == "send":
                out = max(out, took)
            else:
                into = max(into, took)
        return out, into

    out_one, into_one = pp_transfers(True)
    out_both, into_both = pp_transfers(False)
    assert out_one == pytest.approx(out_both, rel=0.05)  # out of it: slow either way
    assert into_one < 0.5 * into_both  # into it: healthy one way
    assert into_one < 0.5 * out_one


def test_a_slow_ranks_cross_node_transfers_slow_with_it_under_cpu_transfers():
    """`cpu_transfers`: rank 1 computes ×4 and its process drives its transfers, so those of
    its all-reduces and pipeline transfers that cross nodes take ×4 too, while its node
    partner's through the same NIC keep their time. Without the option only its compute
    slows, as before."""
    lay = Layout(tp=2, pp=2, dp=4, gpus_per_node=4, nodes_per_switch=2)
    fault = Fault("slow_gpu", 4.0, 1, "rank:1")

    def transfers(cpu: bool) -> dict[int, float]:
        """Each rank of node-0000's longest cross-node transfer (the shortest copy of its
        instance) in a quiet step under the fault."""
        sim = ClusterSimulator(scenario(layout=lay, steps=3, noise=Noise.quiet(), fault=fault,
                                        cpu_transfers=cpu))
        f = frames(sim)[2]
        ri = f.op_rank_index()
        comm = f.op_kind != COMPUTE
        key = f.op_group.astype(np.int64) * (1 << 32) + f.op_seq
        out: dict[int, float] = {}
        for k in np.unique(key[comm]):
            ops = np.flatnonzero(comm & (key == k))
            if np.unique(f.node[ri[ops]]).size < 2:
                continue  # within a node: no network to drive
            took = float(f.op_dur_ns[ops].min())
            for i in ops[f.node[ri[ops]] == f.nodes.index("node-0000")]:
                r = int(f.rank[ri[i]])
                out[r] = max(out.get(r, 0.0), took)
        return out

    slowed, plain = transfers(True), transfers(False)
    assert set(slowed) >= {0, 1}  # rank 1 and its node partner both cross nodes
    assert slowed[1] > 3.0 * plain[1]
    assert slowed[0] == pytest.approx(plain[0], rel=0.05)


def test_hang_heartbeats_outlast_a_timeout_of_three_long_steps():
    sc = scenario(layout=layout_for_gpus(64), steps=6, seed=3, step_time_s=30.0,
                  fault=Fault("hang_rank", 1.0, 3, "rank:56"), heartbeats=False)  # fmt: skip
    sim = ClusterSimulator(sc)
    assert sim.hang_tail_ns == 6 * 30e9 > HANG_TAIL_NS  # 6 step times, not 40 s
    hbs = heartbeats(sim)
    onset = sim.truth.onset_ts_ns
    last = max(h.ts_ns for h in hbs)
    assert onset + 3 * 30e9 + 30e9 < last  # a 90 s timeout has its heartbeats to fire on
    assert last < onset + 6 * 30e9 + 1e9
    late = [h for h in hbs if h.ts_ns > onset + 150e9]
    assert {h.rank for h in late} == set(range(64))  # every rank keeps beating, stuck


@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_fault_is_drawn_in_another_group_and_both_act(family):
    from producers.simulator.faults import fault_nodes

    lay = layout_for_gpus(256)
    sc = scenario(layout=lay, steps=6, seed=4, fault=Fault(family, SEVERITIES[family][-1], 2),
                  fault2=Fault("slow_gpu", 2.0, 2))  # fmt: skip
    sim = ClusterSimulator(sc)
    first, second = sim.plans
    assert not fault_nodes(first, sim.topology) & fault_nodes(second, sim.topology)
    t = sim.truth
    assert t.culprit == first.culprit and t.family == family
    assert t.second["culprit"] == second.culprit and t.second["kind"] == "gpu"
    assert t.second["onset_step"] == 2 and t.second["onset_ts_ns"] > EPOCH_NS
    assert t.to_dict()["conditions"]["fault2"]["family"] == "slow_gpu"
    r = int(second.culprit[5:])
    f = [x for x in frames(sim) if x.step == 2][0]
    if r in f.rank.tolist():  # (a hang may have stopped the job before the rank finished)
        fwd = np.array(f.names)[f.op_name] == "fwd"
        ri = f.op_rank_index()
        peer = r + 1 if r % 8 != 7 else r - 1
        i, j = f.rank.tolist().index(r), f.rank.tolist().index(peer)
        ratio = f.op_dur_ns[fwd & (ri == i)].sum() / f.op_dur_ns[fwd & (ri == j)].sum()
        assert ratio > 1.8


def test_an_explicit_second_fault_in_the_same_group_is_refused():
    lay = layout_for_gpus(64)
    with pytest.raises(ValueError, match="must not share a node or DP group"):
        ClusterSimulator(scenario(layout=lay, fault=Fault("slow_gpu", 1.5, 1, "rank:3"),
                                  fault2=Fault("slow_gpu", 1.5, 1, "rank:11")))  # fmt: skip
    ok = ClusterSimulator(scenario(layout=lay, fault=Fault("slow_gpu", 1.5, 1, "rank:3"),
                                   fault2=Fault("nic", 3.0, 1, "node:node-0005")))  # fmt: skip
    assert [p.culprit for p in ok.plans] == ["rank:3", "node:node-0005"]


def test_a_live_job_starts_at_the_epoch_it_is_given_and_a_recording_at_the_fixed_one():
    lay = layout_for_gpus(64)
    fixed = ClusterSimulator(scenario(layout=lay, steps=3))
    assert fixed.job_start().ts_ns == EPOCH_NS
    now = 1_800_000_000 * 10**9
    live = ClusterSimulator(scenario(layout=lay, steps=3, epoch_ns=now))
    assert live.job_start().ts_ns == now
    first_steps = [ts for topic, _k, _v, ts in live.events() if topic == "flare.steps.v1"][:4]
    assert all(now <= ts < now + 60 * 10**9 for ts in first_steps)
