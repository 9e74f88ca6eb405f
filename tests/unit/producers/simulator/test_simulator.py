"""The cluster simulator: layout, groups, collective physics, faults, determinism, wire."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

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
    Scenario,
    layout_for_gpus,
)
from producers.simulator.simulator import EPOCH_NS, HANG_TAIL_NS
from schemas.decode import decode_heartbeat, decode_job, decode_steps
from schemas.frame import StepFrame
from schemas.rankstep import COLL, COMPUTE
from schemas.wire import HeartbeatV1

# 16 ranks, 4 per node, 2 nodes per leaf: tp groups inside a node, dp / ep / pp across nodes
SMALL = Layout(tp=2, pp=2, dp=4, ep=2, gpus_per_node=4, nodes_per_switch=2)
BUSY_NOISE = Noise(gc_every=3, rank_gc_prob=0.5, checkpoint_every=4, eval_every=5,
                   level_shift_step=3)  # fmt: skip


def scenario(layout=SMALL, steps=4, seed=7, fault=None, noise=None, **kw) -> Scenario:
    return Scenario(job="job-a", layout=layout, steps=steps, seed=seed, fault=fault,
                    noise=noise if noise is not None else Noise(), **kw)  # fmt: skip


def frames(sim: ClusterSimulator) -> list[StepFrame]:
    return [x for x in sim.run() if isinstance(x, StepFrame)]


def heartbeats(sim: ClusterSimulator) -> list[HeartbeatV1]:
    return [x for x in sim.run() if isinstance(x, HeartbeatV1)]


def true_ops(sim: ClusterSimulator, f: StepFrame) -> dict[str, np.ndarray]:
    """Per op: rank, true start and end (node clock offsets removed)."""
    ri = f.op_rank_index()
    base = f.t_start_ns - EPOCH_NS - sim.clocks.skew_ns[f.node]
    start = base[ri] + f.op_start_ns
    return {"rank": f.rank[ri], "start": start, "end": start + f.op_dur_ns}


# ------------------------------------------------------------------ layout and mapping
def test_layout_presets_and_generic_powers_of_two():
    assert (layout_for_gpus(8).tp, layout_for_gpus(8).pp, layout_for_gpus(8).dp) == (2, 2, 2)
    assert (layout_for_gpus(64).tp, layout_for_gpus(64).pp, layout_for_gpus(64).dp) == (8, 2, 4)
    assert (layout_for_gpus(1024).pp, layout_for_gpus(1024).dp) == (8, 16)
    assert (layout_for_gpus(8192).pp, layout_for_gpus(8192).dp) == (8, 128)
    assert (layout_for_gpus(16384).pp, layout_for_gpus(16384).dp) == (16, 128)
    for k in range(3, 17):
        lay = layout_for_gpus(2**k)
        assert lay.world == 2**k
        assert lay.pp > 1 or 2**k < 32
    assert layout_for_gpus(256).n_switches == 2


@pytest.mark.parametrize("bad", [4, 100, 0, -8])
def test_layout_for_gpus_rejects_non_powers_of_two(bad):
    with pytest.raises(ValueError, match="power of two"):
        layout_for_gpus(bad)


def test_invalid_layout_fault_and_scenario_say_why():
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        Layout(tp=2, pp=2, dp=4, ep=3)
    with pytest.raises(ValueError, match="family"):
        Fault("melted", 1.5, 1)
    with pytest.raises(ValueError, match="onset_step"):
        scenario(steps=3, fault=Fault("slow_gpu", 1.5, 3))
    with pytest.raises(ValueError, match="2 leaf switches"):
        ClusterSimulator(scenario(layout=layout_for_gpus(8), fault=Fault("switch", 3.0, 1)))
    with pytest.raises(ValueError, match="not a node"):
        ClusterSimulator(scenario(fault=Fault("slow_node", 1.5, 1, "node:node-9999")))
    with pytest.raises(ValueError, match="outside the world"):
        ClusterSimulator(scenario(fault=Fault("slow_gpu", 1.5, 1, "rank:16")))


def test_rank_coords_nodes_and_group_membership():
    sim = ClusterSimulator(scenario(steps=2))
    f = frames(sim)[-1]
    lay = SMALL
    tp, pp, dp = f.coord("tp"), f.coord("pp"), f.coord("dp")
    assert np.array_equal(f.rank, np.arange(16))
    assert np.array_equal(f.rank, pp * (lay.dp * lay.tp) + dp * lay.tp + tp)
    assert np.array_equal(f.coord("ep"), dp % lay.ep)
    assert [f.nodes[n] for n in f.node] == [f"node-{r // 4:04d}" for r in range(16)]
    assert np.array_equal(f.local_rank, f.rank % 4)
    ri = f.op_rank_index()
    members: dict[tuple[int, int], list[int]] = defaultdict(list)
    names: dict[tuple[int, int], list[str]] = defaultdict(list)
    for i in np.flatnonzero(f.op_kind != COMPUTE):
        r = int(ri[i])
        g = f.groups[f.op_group[i]]
        kind, ident = g.split(".")
        if kind == "tp":
            assert ident == f"{pp[r]}-{dp[r]}"
        elif kind == "dp":
            assert ident == f"{pp[r]}-{tp[r]}"
        elif kind == "ep":
            assert ident == f"{pp[r]}-{tp[r]}-{dp[r] // lay.ep}"
        else:
            a, b = map(int, ident.split("-"))
            assert int(f.rank[r]) in (a, b) and b - a == lay.dp * lay.tp
        members[(int(f.op_group[i]), int(f.op_seq[i]))].append(int(f.rank[r]))
        names[(int(f.op_group[i]), int(f.op_seq[i]))].append(f.names[f.op_name[i]])
    size = {"tp": lay.tp, "dp": lay.dp, "ep": lay.ep, "pp": 2}
    for (g, _), ranks in members.items():
        assert len(ranks) == len(set(ranks)) == size[f.groups[g].split(".")[0]]
        if f.groups[g].startswith("pp."):
            assert sorted(names[(g, _)]) == ["recv", "send"]
        else:
            assert len(set(names[(g, _)])) == 1


def test_every_instance_ends_at_the_same_true_time_for_all_its_members():
    sim = ClusterSimulator(scenario(steps=3))
    for f in frames(sim):
        t = true_ops(sim, f)
        comm = np.flatnonzero(f.op_kind != COMPUTE)
        key = f.op_group[comm].astype(np.int64) * 10**9 + f.op_seq[comm]
        for k in np.unique(key):
            ends = t["end"][comm[key == k]]
            assert ends.min() == ends.max()


# ------------------------------------------------------------------------------ physics
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


# dp.0-1 = ranks 1, 3, 5, 7 on node-0000 and node-0001 (leaf-00);
# dp.1-0 = ranks 8, 10, 12, 14 on node-0002 and node-0003 (leaf-01);
# pp.4-12 links node-0001 and node-0003, pp.0-8 node-0000 and node-0002
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


# ------------------------------------------------------------------------ ground truth
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


@pytest.mark.parametrize("family", FAMILIES)
def test_ground_truth_of_every_family(family):
    sev = SEVERITIES[family][-1]
    sim = ClusterSimulator(scenario(layout=layout_for_gpus(256), steps=4,
                                    fault=Fault(family, sev, 2)))  # fmt: skip
    t = sim.truth
    prefix = {"gpu": "rank:", "node": "node:node-", "host": "node:node-", "switch": "switch:leaf-",
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


# --------------------------------------------------------------------------- determinism
def _fingerprint(sim: ClusterSimulator) -> list:
    out = []
    for x in sim.run():
        if isinstance(x, StepFrame):
            out.append((x.step, x.rank.tobytes(), x.t_start_ns.tobytes(), x.op_dur_ns.tobytes(),
                        x.op_start_ns.tobytes(), x.op_bytes.tobytes()))  # fmt: skip
        else:
            out.append((x.rank, x.ts_ns, x.step, tuple((i.group, i.seq) for i in x.inflight)))
    return out


def test_same_seed_same_run_and_fault_shares_the_clean_noise():
    sc = scenario(steps=4, noise=BUSY_NOISE)
    a = _fingerprint(ClusterSimulator(sc))
    sim = ClusterSimulator(sc)
    assert a == _fingerprint(sim) == _fingerprint(sim)  # also re-runnable
    assert a != _fingerprint(ClusterSimulator(replace(sc, seed=8)))
    faulty = ClusterSimulator(replace(sc, fault=Fault("slow_gpu", 1.5, 2)))
    clean_frames = [x for x in a if len(x) == 6]
    faulty_frames = [x for x in _fingerprint(faulty) if len(x) == 6]
    assert clean_frames[:2] == faulty_frames[:2] and clean_frames[2] != faulty_frames[2]


# ------------------------------------------------------------------------ wire messages
def test_every_event_decodes_and_events_match_frames():
    sim = ClusterSimulator(scenario(steps=6, noise=BUSY_NOISE))
    evs = list(sim.events())
    assert evs[0][0] == "flare.jobs.v1" and evs[0][2]["event"] == "start"
    assert evs[-1][0] == "flare.jobs.v1" and evs[-1][2]["event"] == "end"
    assert all(e[1] == "job-a" for e in evs)
    ts = [e[3] for e in evs]
    assert ts == sorted(ts)
    start = decode_job(orjson.dumps(evs[0][2]))
    assert start.world_size == 16 and start.layout.ep == 2
    assert [n.switch for n in start.nodes] == ["leaf-00", "leaf-00", "leaf-01", "leaf-01"]
    decode_job(orjson.dumps(evs[-1][2]))
    steps = defaultdict(dict)
    n_hb, hb_ranks = 0, set()
    for topic, _, value, _ in evs[1:-1]:
        raw = orjson.dumps(value)
        if topic == "flare.steps.v1":
            m = decode_steps(raw)
            steps[m.step][m.rank] = m
        else:
            assert topic == "flare.heartbeats.v1"
            n_hb += 1
            hb_ranks.add(decode_heartbeat(raw).rank)
    assert n_hb >= 16 and hb_ranks == set(range(16))
    fs = frames(sim)
    assert [f.step for f in fs] == sorted(steps)
    for f in fs:
        mine = sim.rank_steps(f)
        assert [m.rank for m in mine] == sorted(steps[f.step])
        for m in mine:
            d = steps[f.step][m.rank]
            assert (d.node, d.t_start_ns, d.t_end_ns, d.local_rank, dict(d.coords)) == (
                m.node, m.t_start_ns, m.t_end_ns, m.local_rank, dict(m.coords))  # fmt: skip
            assert d.name == m.name and d.group == m.group
            for col in ("kind", "seq", "start_ns", "dur_ns", "bytes"):
                assert np.array_equal(getattr(d, col), getattr(m, col)), col
    a2a = [m for m in sim.rank_steps(fs[1]) if "all_to_all" in m.name]
    sizes = {int(b) for m in a2a for b, n in zip(m.bytes, m.name, strict=True) if n == "all_to_all"}
    assert len(sizes) > 2  # MoE imbalance: all_to_all buffers differ between members


def test_run_yields_in_stream_time_order():
    sim = ClusterSimulator(scenario(steps=4, noise=BUSY_NOISE))
    skew = sim.clocks.skew_ns
    node_of = {n: i for i, n in enumerate(sim.topology.node_names)}
    times = []
    for x in sim.run():
        if isinstance(x, StepFrame):
            times.append(int((x.t_end_ns - skew[x.node]).max()))
        else:
            times.append(x.ts_ns - int(skew[node_of[x.node]]))
    assert times == sorted(times)


def test_heartbeats_report_the_op_in_flight():
    sim = ClusterSimulator(scenario(steps=3, keepalive_s=1.0))  # every 1 Hz sample
    hbs = heartbeats(sim)
    assert len(hbs) > 16 * 4
    busy = [h for h in hbs if h.inflight]
    assert busy and len(busy) < len(hbs)
    by_key = {}
    for f in frames(sim):
        for m in sim.rank_steps(f):
            for i, g in enumerate(m.group):
                if g:
                    lo = m.t_start_ns + int(m.start_ns[i])
                    by_key[(m.rank, g, int(m.seq[i]))] = (lo, lo + int(m.dur_ns[i]))
    for h in busy:
        op = h.inflight[0]
        lo, hi = by_key[(h.rank, op.group, op.seq)]
        assert op.start_ns == lo and lo <= h.ts_ns <= hi


# ---------------------------------------------------------------------- heartbeat cadence
def _hb_tuple(h: HeartbeatV1) -> tuple:
    ops = tuple((o.group, o.name, o.seq, o.start_ns) for o in h.inflight)
    return (h.rank, h.ts_ns, h.step, ops)


def _long_key(h: HeartbeatV1, long_ns: float = 1e9) -> tuple | None:
    """(group, seq) of the op in flight if it has been in flight >= long_ns, else None."""
    long = [(o.group, o.seq) for o in h.inflight if h.ts_ns - o.start_ns >= long_ns]
    return tuple(long) or None


def test_heartbeat_cadence_first_sample_long_op_changes_and_keepalives():
    # 20 s steps: pipeline recvs and dp collectives stay in flight for several seconds
    sc = scenario(steps=3, step_time_s=20.0)
    every = heartbeats(ClusterSimulator(replace(sc, keepalive_s=1.0)))  # all 1 Hz samples
    pub = heartbeats(ClusterSimulator(sc))  # keepalive 5 s, long op 3 s (the defaults)
    long_ns = sc.long_op_s * 1e9
    # a published heartbeat is a sample unchanged: same stamp, step, full in-flight list
    assert {_hb_tuple(h) for h in pub} <= {_hb_tuple(h) for h in every}
    published = {(h.rank, h.ts_ns) for h in pub}
    by_rank = defaultdict(list)
    for h in every:
        by_rank[h.rank].append(h)
    assert sorted(by_rank) == list(range(16))
    changes = became_long = ended = 0
    for r, hs in by_rank.items():
        hs.sort(key=lambda h: h.ts_ns)
        assert (r, hs[0].ts_ns) in published  # (a) the rank's first sample
        keepalives = []
        last_pub = hs[0].ts_ns
        for prev, h in zip(hs, hs[1:], strict=False):
            is_pub = (r, h.ts_ns) in published
            key, prev_key = _long_key(h, long_ns), _long_key(prev, long_ns)
            if key != prev_key:  # (b) within one sample, start and end
                assert is_pub, (r, h)
                changes += 1
                became_long += key is not None
                ended += prev_key is not None
            elif is_pub:
                keepalives.append(h.ts_ns)
            if is_pub:  # (c) never silent for longer than the keepalive
                assert h.ts_ns - last_pub <= 5e9 + 1
                last_pub = h.ts_ns
        # unchanged (short or still-long) samples are not re-published within the keepalive:
        # the published ones without a change sit exactly on the rank's 5-sample keepalive grid
        gaps = np.diff(keepalives) / 1e9
        assert np.allclose(gaps, np.rint(gaps / 5) * 5, atol=1e-8) and (gaps >= 5 - 1e-8).all()
    assert became_long > 10 and ended > 10
    assert len(pub) < len(every) / 5 + 16 + changes


def test_clean_heartbeat_rate_is_about_one_per_keepalive():
    sc = scenario(steps=6, keepalive_s=5.0)
    hbs = heartbeats(ClusterSimulator(sc))
    span_s = (max(h.ts_ns for h in hbs) - min(h.ts_ns for h in hbs)) / 1e9
    assert not any(_long_key(h) for h in hbs)  # 2 s steps: no op is ever long
    per_rank = len(hbs) / 16
    assert span_s / 5 <= per_rank <= span_s / 5 + 2  # keepalives + the first sample


@pytest.mark.parametrize("fault", [None, Fault("hang_rank", 1.0, 2)])
def test_job_end_is_stamped_after_every_emitted_node_clock_time(fault):
    sc = scenario(steps=4, fault=fault, noise=Noise(clock_skew_ms=80.0))
    evs = list(ClusterSimulator(sc).events())
    stamps = [v["t_end_ns"] if t == "flare.steps.v1" else v["ts_ns"] for t, _, v, _ in evs[1:-1]]
    # node clocks run ahead of true time here: an end stamped from true time came too early
    assert max(stamps) > evs[-2][3] + 1_000_000
    end = decode_job(orjson.dumps(evs[-1][2]))
    assert end.event == "end" and end.ts_ns > max(stamps)
    assert evs[-1][3] == end.ts_ns >= max(e[3] for e in evs[:-1])


def test_cadence_fields_are_validated():
    with pytest.raises(ValueError, match="keepalive_s must be a finite number"):
        scenario(keepalive_s=-1.0)
    with pytest.raises(ValueError, match="long_op_s must be a finite number"):
        scenario(long_op_s=float("inf"))


# --------------------------------------------------------------------------------- hangs
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


# ---------------------------------------------------------------------- recording + CLI
def test_write_recording_and_cli(tmp_path):
    import typer
    from typer.testing import CliRunner

    from flare.commands import simulate
    from producers.simulator import read_truth, write_recording

    sc = scenario(steps=3, fault=Fault("slow_node", 1.3, 1))
    truth = write_recording(sc, tmp_path / "a" / "run.jsonl")
    lines = (tmp_path / "a" / "run.jsonl").read_bytes().splitlines()
    assert {orjson.loads(x)["topic"] for x in lines} == {
        "flare.jobs.v1", "flare.steps.v1", "flare.heartbeats.v1"}  # fmt: skip
    assert read_truth(tmp_path / "a" / "run.jsonl") == truth
    assert truth == ClusterSimulator(sc).truth

    app = typer.Typer()
    simulate.register(app)
    app.command("noop")(lambda: None)
    out = tmp_path / "cli.jsonl"
    res = CliRunner().invoke(app, ["simulate", "--gpus", "16", "--steps", "3", "--fault",
                                   "slow_gpu", "--onset", "1", "--target", "rank:3",
                                   "--no-heartbeats", "--out", str(out)])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert read_truth(out).culprit == "rank:3"
    assert '"culprit": "rank:3"' in res.output
    assert not any(b"heartbeats" in x for x in out.read_bytes().splitlines())
    res = CliRunner().invoke(app, ["simulate", "--gpus", "8", "--fault", "switch",
                                   "--out", str(tmp_path / "x.jsonl")])  # fmt: skip
    assert res.exit_code == 2 and "2 leaf switches" in res.output
