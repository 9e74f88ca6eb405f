"""The simulator as a whole: same seed, same run; stream-time order; the job's end stamp."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import orjson
import pytest

from producers.simulator import ClusterSimulator, Fault, Noise
from schemas.decode import decode_job
from schemas.frame import StepFrame
from tests.unit.producers.simulator.support import BUSY_NOISE, SMALL, frames, scenario


def _fingerprint(sim: ClusterSimulator) -> list:
    out: list[tuple] = []  # frames and heartbeats, each its own shape
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


# GC pauses, single-rank GC and checkpoints: every kind of clean draw is made, often
_COUNTERFACTUAL_NOISE = Noise(gc_every=4, rank_gc_prob=0.5, checkpoint_every=9)


def _per_rank(sim: ClusterSimulator) -> dict[int, StepFrame]:
    return {f.step: f for f in frames(sim)}


def _spans(f: StepFrame) -> np.ndarray:
    return f.t_end_ns - f.t_start_ns


def _compute(f: StepFrame, but: np.ndarray) -> np.ndarray:
    """The durations of the compute ops of every rank but `but`: noise times the model, so
    the same in two runs exactly when the noise draws are."""
    rank = f.rank[f.op_rank_index()]
    return f.op_dur_ns[(f.op_group == 0) & ~np.isin(rank, but)]


@pytest.mark.parametrize(
    ("fault", "fault2"),
    [
        (Fault("slow_gpu", 3.0, 8), None),
        (Fault("thermal", 3.0, 8), None),  # its on/off episodes draw from the fault's stream
        (Fault("host", 3.0, 8), None),  # its launch delays too
        (Fault("nic", 3.0, 8), None),
        (Fault("switch", 3.0, 8), None),
        (Fault("pp_link", 3.0, 8), None),
        (Fault("slow_node", 3.0, 8), Fault("slow_gpu", 3.0, 10)),
    ],
)
def test_the_run_without_its_fault_is_the_same_run_until_the_onset_then_faster(fault, fault2):
    """Issue #12's counterfactual: what a fault cost is the faulty run against the same seed
    without it, which only holds when no clean draw depends on the fault. Every step before
    the onset is the same, rank for rank and op for op; after it, the compute of the ranks
    the faults leave alone stays the same op for op. Where the fault acts, the job is
    behind from the onset on and its steps are slower, all but those where a GC pause or a
    checkpoint on the critical path gives the fault's delay slack."""
    sc = scenario(layout=SMALL, steps=24, noise=_COUNTERFACTUAL_NOISE, fault=fault,
                  fault2=fault2, heartbeats=True)  # fmt: skip
    faulty = ClusterSimulator(sc)
    with_fault = _per_rank(faulty)
    # heartbeats draw nothing: the counterfactual of `flare eval` leaves them out
    without = _per_rank(ClusterSimulator(replace(sc.without_faults(), heartbeats=False)))
    assert sorted(with_fault) == sorted(without) == list(range(24))
    for step in range(fault.onset_step):
        a, b = with_fault[step], without[step]
        assert np.array_equal(a.t_start_ns, b.t_start_ns), step
        assert np.array_equal(_spans(a), _spans(b)), step
        assert np.array_equal(a.op_dur_ns, b.op_dur_ns), step
    hit = np.concatenate([p.ranks for p in faulty.plans])
    for step in range(fault.onset_step, 24):  # the noise goes on the same after the onset
        a, b = _compute(with_fault[step], hit), _compute(without[step], hit)
        assert np.abs(a - b).max() <= 1, step  # 1 ns: ends and starts are rounded apart
    assert faulty.plan is not None
    acting = [s for s in range(fault.onset_step, 24) if faulty.plan.active(s)]
    slower = [s for s in acting
              if np.median(_spans(with_fault[s])) > np.median(_spans(without[s]))]  # fmt: skip
    assert all(with_fault[s].t_end_ns.max() > without[s].t_end_ns.max() for s in acting)
    assert len(slower) > len(acting) / 2, (acting, slower)


def test_the_run_without_a_hang_is_the_same_run_until_the_hang():
    sc = scenario(layout=SMALL, steps=12, noise=_COUNTERFACTUAL_NOISE,
                  fault=Fault("hang_rank", 1.0, 6))  # fmt: skip
    with_hang = _per_rank(ClusterSimulator(sc))
    without = _per_rank(ClusterSimulator(sc.without_faults()))
    for step in range(6):
        assert np.array_equal(_spans(with_hang[step]), _spans(without[step])), step
    assert 6 not in with_hang and 11 in without
