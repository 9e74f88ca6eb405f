"""The simulator as a whole: same seed, same run; stream-time order; the job's end stamp."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from producers.simulator import ClusterSimulator, Fault, Noise
from schemas.decode import decode_job
from schemas.frame import StepFrame
from tests.unit.producers.simulator.support import BUSY_NOISE, scenario


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
