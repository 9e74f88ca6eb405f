"""What the outside sees: wire-v1 steps that match the frames, heartbeats with the op in
flight, and the agent's heartbeat cadence (`producers.agent.cadence`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import numpy as np
import orjson

from producers.simulator import ClusterSimulator
from producers.simulator.emit import build_frame, rank_step, steps_value
from schemas.decode import decode_heartbeat, decode_job, decode_steps
from schemas.wire import HeartbeatV1
from tests.unit.producers.simulator.support import BUSY_NOISE, frames, heartbeats, scenario


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


def test_steps_values_are_built_in_the_contract_key_order():
    f = frames(ClusterSimulator(scenario(steps=1)))[0]
    value = steps_value(f, 3)
    assert list(value) == ["v", "job", "rank", "node", "local_rank", "step", "t_start_ns",
                           "t_end_ns", "coords", "ops"]
    assert value == rank_step(f, 3).to_wire()  # the wire form and the decoded form agree


def _by_rank(sim: ClusterSimulator) -> dict[tuple[int, int], dict]:
    """(step, rank) → its flare.steps.v1 value."""
    return {(v["step"], v["rank"]): v for t, _, v, _ in sim.events() if t == "flare.steps.v1"}


def test_tp0_emits_only_tp0_ranks_steps_frames_and_heartbeats():
    sc = scenario(steps=4, noise=BUSY_NOISE, keepalive_s=1.0)
    full = ClusterSimulator(sc)
    sim = ClusterSimulator(replace(sc, traced="tp0"))
    tp0 = set(range(0, 16, 2))  # SMALL has tp=2, tp the fastest index
    fs = frames(sim)
    assert [f.step for f in fs] == [0, 1, 2, 3]
    assert all(set(f.rank.tolist()) == tp0 and f.missing.size == 0 for f in fs)
    assert {h.rank for h in heartbeats(sim)} == tp0
    msgs = _by_rank(sim)
    assert {r for _, r in msgs} == tp0 and all(m["coords"]["tp"] == 0 for m in msgs.values())
    # nothing else changes: the traced ranks report exactly what they report in a full run
    everyone = _by_rank(full)
    assert all(everyone[k] == m for k, m in msgs.items())
    full_hb = {(h.rank, h.ts_ns): h for h in heartbeats(full)}
    assert all(full_hb[(h.rank, h.ts_ns)] == h for h in heartbeats(sim))


def test_node_dark_and_half_emit_their_subsets_and_only_traced_ranks_go_missing():
    from producers.simulator import Fault

    sc = scenario(steps=5, fault=Fault("hang_rank", 1.0, 2, "rank:1"))
    dark = ClusterSimulator(replace(sc, traced="node_dark"))
    ranks = set(np.flatnonzero(dark.traced).tolist())
    assert len(ranks) == 12
    fs = frames(dark)
    assert all(set(f.rank.tolist()) | set(f.missing.tolist()) <= ranks for f in fs)
    assert {r for _, r in _by_rank(dark)} <= ranks
    assert {h.rank for h in heartbeats(dark)} == ranks
    rec = next(iter(dark._records()))
    rec.t_end[[0, 5, 9]] = np.inf  # three ranks never finish step 0
    f, _ = build_frame(dark.topology, rec, "job-a", dark.clocks, dark.traced)
    assert 5 not in ranks and set(f.missing.tolist()) == {0, 9}  # nobody expects rank 5
    assert set(f.rank.tolist()) == ranks - {0, 5, 9}
    half = ClusterSimulator(replace(sc, traced="half"))
    assert {h.rank for h in heartbeats(half)} == set(np.flatnonzero(half.traced).tolist())
    assert half.traced.sum() == 8


def test_comm_only_has_no_compute_ops_and_the_same_communication():
    from schemas.rankstep import COMPUTE

    sc = scenario(steps=6, noise=BUSY_NOISE)
    sim = ClusterSimulator(replace(sc, comm_only=True))
    fs, full = frames(sim), frames(ClusterSimulator(sc))
    assert all((f.op_kind != COMPUTE).all() and f.n_ops > 0 for f in fs)
    msgs = _by_rank(sim)
    assert all("compute" not in m["ops"]["kind"] for m in msgs.values())
    everyone = _by_rank(ClusterSimulator(sc))
    for key, m in msgs.items():
        ops, all_ops = m["ops"], everyone[key]["ops"]
        comm = [i for i, k in enumerate(all_ops["kind"]) if k != "compute"]
        for col in ("name", "group", "seq", "start_ns", "dur_ns", "bytes"):
            assert ops[col] == [all_ops[col][i] for i in comm], col
        assert (m["t_start_ns"], m["t_end_ns"]) == (everyone[key]["t_start_ns"],
                                                    everyone[key]["t_end_ns"])  # fmt: skip
    assert all(np.array_equal(a.t_end_ns, b.t_end_ns) for a, b in zip(fs, full, strict=True))
