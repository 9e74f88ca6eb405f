"""Pipeline schedules: GPipe as it always was, and 1F1B with the dp reduce_scatter overlapped
with the last backward (program order, p2p pairing, no deadlock, overlap, faults)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import numpy as np
import pytest

from producers.simulator import FAMILIES, ClusterSimulator, Fault, Layout, Noise, Scenario
from producers.simulator.costs import CostModel
from producers.simulator.engine import stage_program
from schemas.frame import StepFrame
from schemas.rankstep import P2P
from tests.unit.producers.simulator.support import (
    BUSY_NOISE,
    SMALL,
    frames,
    heartbeats,
    scenario,
    true_ops,
)

QUIET_EVAL = replace(Noise.quiet(), eval_every=2, checkpoint_every=2)  # step 2: forward only


def _ops(f: StepFrame, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rank row i: op names, starts and ends (offsets in its window), in emitted order."""
    lo, hi = int(f.off[i]), int(f.off[i + 1])
    start = f.op_start_ns[lo:hi]
    return np.array(f.names)[f.op_name[lo:hi]], start, start + f.op_dur_ns[lo:hi]


def _phases(names: np.ndarray, start: np.ndarray, end: np.ndarray, chunks: int = 2) -> list:
    """A rank's forward / backward phases: (F or B, first chunk's start, last chunk's end)."""
    rows = np.flatnonzero(np.isin(names, ["fwd", "bwd"])).reshape(-1, chunks)
    return [("F" if names[r[0]] == "fwd" else "B", start[r[0]], end[r[-1]]) for r in rows]


def _pipeline(schedule: str, pp: int, microbatches: int, **kw) -> Scenario:
    lay = kw.pop("layout", Layout(tp=1, pp=pp, dp=2, gpus_per_node=2))
    return scenario(layout=lay, steps=kw.pop("steps", 2), noise=kw.pop("noise", Noise.quiet()),
                    microbatches=microbatches, schedule=schedule, **kw)  # fmt: skip


@pytest.mark.parametrize("microbatches", [2, 6])
def test_1f1b_warms_up_then_alternates_forward_and_backward_then_cools_down(microbatches):
    P, M = 4, microbatches
    one = frames(ClusterSimulator(_pipeline("1f1b", P, M)))[1]
    gpipe = frames(ClusterSimulator(_pipeline("gpipe", P, M)))[1]
    for i in range(one.n_ranks):
        s = int(one.coord("pp")[i])
        warm = min(P - s - 1, M)
        order = "".join(p for p, _, _ in _phases(*_ops(one, i)))
        assert order == "F" * warm + "FB" * (M - warm) + "B" * warm, (s, order)
        assert "".join(p for p, _, _ in _phases(*_ops(gpipe, i))) == "F" * M + "B" * M


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_p2p_pairs_a_send_with_the_neighbours_recv_of_the_same_microbatch(schedule):
    P, M = 4, 5
    sim = ClusterSimulator(_pipeline(schedule, P, M, steps=3))
    seqs: dict[str, list[int]] = {}
    for f in frames(sim):
        t = true_ops(sim, f)
        rank, start, end = t["rank"], t["start"], t["end"]
        name = np.array(f.names)[f.op_name]
        pp = dict(zip(f.rank.tolist(), f.coord("pp").tolist(), strict=True))
        phases = {(r, p): [x for x in _phases(name[rank == r], start[rank == r],
                                              end[rank == r]) if x[0] == p]
                  for r in f.rank.tolist() for p in "FB"}  # fmt: skip
        p2p = f.op_kind == P2P
        for g in np.unique(f.op_group[p2p]):
            sel = p2p & (f.op_group == g)
            up, down = sorted(set(rank[sel].tolist()))
            assert pp[down] == pp[up] + 1
            fwd, bwd = [], []  # per transfer in seq order: (send row, recv row)
            for sq in sorted(set(f.op_seq[sel].tolist())):
                rows = np.flatnonzero(sel & (f.op_seq == sq))
                (snd,) = rows[name[rows] == "send"]  # one send and one recv, no more
                (rcv,) = rows[name[rows] == "recv"]
                assert end[snd] == end[rcv]  # a rendezvous: both ends finish together
                (fwd if rank[snd] == up else bwd).append((snd, rcv))
                seqs.setdefault(f.groups[g], []).append(sq)
            assert len(fwd) == len(bwd) == M
            # the k-th forward transfer carries microbatch k: it leaves after the upstream
            # rank's k-th forward, and the downstream rank's k-th forward waits for it
            # (backward: the same the other way round)
            for (snd, rcv), f_up, f_down in zip(fwd, phases[up, "F"], phases[down, "F"],
                                                 strict=True):  # fmt: skip
                assert start[snd] >= f_up[2] and f_down[1] >= end[rcv]
            for (snd, rcv), b_down, b_up in zip(bwd, phases[down, "B"], phases[up, "B"],
                                                 strict=True):  # fmt: skip
                assert start[snd] >= b_down[2] and b_up[1] >= end[rcv]
    for g, s in seqs.items():  # both ends count the pair's transfers alike, over the job
        assert s == list(range(len(s))), g


@pytest.mark.parametrize("pp", [1, 2, 4, 8])
@pytest.mark.parametrize(
    "layout", [Layout(tp=1, pp=1, dp=2, gpus_per_node=4),
               Layout(tp=2, pp=1, dp=4, ep=2, gpus_per_node=4)], ids=["dp", "tp_ep"],
)  # fmt: skip
def test_every_depth_and_microbatch_count_runs_without_deadlock(pp, layout):
    lay = replace(layout, pp=pp)
    for schedule in ("gpipe", "1f1b"):
        for m in range(1, 9):
            sim = ClusterSimulator(_pipeline(schedule, pp, m, layout=lay, steps=3,
                                             noise=QUIET_EVAL))  # fmt: skip
            fs = frames(sim)
            assert [f.step for f in fs] == [0, 1, 2]
            for f in fs:
                assert f.n_ranks == lay.world and f.missing.size == 0
                train, ckpt = f.step != 2, f.step == 2
                want = [sim.engine.n_ops(int(s), train, ckpt) for s in f.coord("pp")]
                assert np.diff(f.off).tolist() == want
                p2p = f.op_kind == P2P
                key = f.op_group[p2p].astype(np.int64) << 32 | f.op_seq[p2p]
                assert (np.unique(key, return_counts=True)[1] == 2).all()
                assert p2p.sum() == 2 * (pp - 1) * m * (1 + train) * lay.dp * lay.tp


def test_1f1b_programs_batch_a_send_with_the_next_recv_only_in_the_steady_state():
    # stage 1 of 4, 4 microbatches: warm-up of 2 forwards, 2 in the steady state, cool-down
    prog = stage_program("1f1b", 1, 4, 4, True)
    batches = [[(x.back, x.m, send) for x, send in it.ops] for it in prog if it.ops]
    assert batches == [
        [(False, 0, False)], [(False, 0, True)],  # warm-up: recv, send alone
        [(False, 1, False)], [(False, 1, True)],
        [(False, 2, False)],  # the recv before the steady state
        [(False, 2, True), (True, 0, False)],  # send_forward_recv_backward
        [(True, 0, True), (False, 3, False)],  # send_backward_recv_forward
        [(False, 3, True), (True, 1, False)],
        [(True, 1, True)],  # the last steady backward's send alone
        [(True, 2, False)], [(True, 2, True)],  # cool-down
        [(True, 3, False)], [(True, 3, True)],
    ]  # fmt: skip
    gpipe = stage_program("gpipe", 1, 4, 4, True)
    assert all(len(it.ops) <= 1 for it in gpipe)


def test_1f1b_reduce_scatters_in_buckets_during_the_last_backward_and_the_optimizer_waits():
    lay = Layout(tp=2, pp=2, dp=4, gpus_per_node=4)
    chunks = 3
    sim = ClusterSimulator(_pipeline("1f1b", 2, 4, layout=lay, chunks=chunks, steps=3))
    f = frames(sim)[2]
    for i in range(f.n_ranks):
        names, start, end = _ops(f, i)
        rs = np.flatnonzero(names == "reduce_scatter")
        bwd = np.flatnonzero(names == "bwd")
        (opt,) = np.flatnonzero(names == "optimizer")
        (ag,) = np.flatnonzero(names == "all_gather")
        lo = int(f.off[i])
        assert rs.size == chunks
        assert f.op_bytes[lo + rs].sum() == CostModel().grad_bytes
        assert start[rs[0]] < end[bwd[-1]]  # it overlaps the last backward
        assert start[rs[0]] >= end[bwd[-chunks]]  # launched once the first bucket is done
        assert start[opt] >= end[rs].max()  # the optimizer waits for every bucket
        assert start[ag] >= end[opt]
        if i == 0:  # ops overlap: the comm stream runs beside the compute stream
            assert (start[1:] < end[:-1]).any()
    gsim = ClusterSimulator(_pipeline("gpipe", 2, 4, layout=lay, chunks=chunks, steps=3))
    names, start, end = _ops(frames(gsim)[2], 0)
    (rs1,) = np.flatnonzero(names == "reduce_scatter")
    assert start[rs1] >= end[np.flatnonzero(names == "bwd")[-1]]  # GPipe: after the backward
    # the hidden reduce_scatter time shortens the step before calibration (both are then
    # stretched to step_time_s): a larger scale means a shorter uncalibrated step
    assert sim.engine.scale > gsim.engine.scale


def test_1f1b_ops_are_emitted_in_start_order_inside_the_window():
    sim = ClusterSimulator(scenario(steps=6, noise=BUSY_NOISE, schedule="1f1b"))
    fs = frames(sim)
    assert len(fs) == 6
    overlapping = 0
    for f in fs:
        for i in range(f.n_ranks):
            lo, hi = f.off[i], f.off[i + 1]
            s, d = f.op_start_ns[lo:hi], f.op_dur_ns[lo:hi]
            assert (s[1:] >= s[:-1]).all() and (s >= 0).all() and (d >= 0).all()
            assert f.t_end_ns[i] - f.t_start_ns[i] == (s + d).max()
            overlapping += int((s[1:] < s[:-1] + d[:-1]).any())
    assert overlapping > 0
    for a, b in zip(fs, fs[1:], strict=False):
        assert np.array_equal(a.t_end_ns, b.t_start_ns)
    by_step = {f.step: f for f in fs}
    for topic, _, value, _ in sim.events():  # the wire carries the same, sorted, ops
        if topic == "flare.steps.v1":
            f = by_step[value["step"]]
            i = int(np.searchsorted(f.rank, value["rank"]))
            assert value["ops"]["start_ns"] == f.op_start_ns[f.off[i] : f.off[i + 1]].tolist()


def test_a_slow_gpu_under_1f1b_lengthens_every_ranks_step():
    base = _pipeline("1f1b", 2, 4, layout=Layout(tp=2, pp=2, dp=4, gpus_per_node=4), steps=3)
    clean = frames(ClusterSimulator(base))[2]
    slow = frames(ClusterSimulator(replace(base, fault=Fault("slow_gpu", 2.0, 1, "rank:5"))))[2]
    ratio = (slow.t_end_ns - slow.t_start_ns) / (clean.t_end_ns - clean.t_start_ns)
    assert (ratio > 1.3).all()  # its tp, dp and pipeline peers all wait for it


@pytest.mark.parametrize("family", FAMILIES)
def test_every_fault_family_runs_under_1f1b_and_hangs_still_hang(family):
    sc = _pipeline("1f1b", 2, 4, layout=SMALL, steps=6, noise=Noise(),
                   fault=Fault(family, 1.0 if "hang" in family else 3.0, 3))  # fmt: skip
    sim = ClusterSimulator(sc)
    fs = frames(sim)
    truth = sim.truth
    assert truth.onset_ts_ns is not None and truth.family == family
    if family in ("hang_rank", "comm_hang"):
        assert all(f.step <= 3 + 1 for f in fs)  # nobody completes a step after the next one
        assert not any(f.step == 4 and f.missing.size == 0 for f in fs)
        late = [h for h in heartbeats(sim) if h.ts_ns > truth.onset_ts_ns + 5e9]
        assert late and any(h.inflight for h in late)
    else:
        assert [f.step for f in fs] == list(range(6))
        assert all(f.missing.size == 0 for f in fs)


def test_comm_hang_under_1f1b_hangs_the_first_reduce_scatter_bucket():
    sc = _pipeline("1f1b", 2, 4, layout=Layout(tp=2, pp=2, dp=4, gpus_per_node=4), steps=6,
                   noise=Noise(), fault=Fault("comm_hang", 1.0, 3, "group:dp.1-0"))  # fmt: skip
    sim = ClusterSimulator(sc)
    onset = sim.truth.onset_ts_ns
    members = [8 + 2 * d for d in range(4)]  # pp 1, tp 0
    late = {h.rank: h for h in heartbeats(sim) if h.ts_ns > onset + 5e9}
    first = 3 * (sc.chunks + 1)  # seq of step 3's first bucket: chunks + 1 dp ops a step
    for r in members:
        (op,) = late[r].inflight
        assert (late[r].step, op.group, op.name, op.seq) == (3, "dp.1-0", "reduce_scatter", first)
    assert all(late[r].inflight for r in late)


# sha256 of the frames of two GPipe runs, taken before 1F1B existed: the default schedule
# must keep producing them byte for byte (quiet noise: no transcendental functions, so the
# digest does not depend on the CPU's vector math)
GPIPE_DIGESTS = {
    "slow_gpu": "f2dc5224d90cfc8c39a437ede19d393bc7f553c166a1938d4225e2d6d2896b15",
    "comm_hang": "a722095ed83eab768a846d52079cff8a65a4175727c86f7db5d437a120ffcd76",
}


def test_gpipe_is_the_default_and_its_frames_are_unchanged():
    quiet = replace(Noise.quiet(), checkpoint_every=4, eval_every=5)
    runs = {
        "slow_gpu": scenario(steps=6, noise=quiet, fault=Fault("slow_gpu", 1.5, 2, "rank:5")),
        "comm_hang": scenario(layout=Layout(tp=1, pp=4, dp=2, gpus_per_node=4), steps=6,
                              noise=quiet, microbatches=6, chunks=3,
                              fault=Fault("comm_hang", 1.0, 3, "group:dp.2-0")),
    }  # fmt: skip
    for name, sc in runs.items():
        assert sc.schedule == "gpipe"
        h = hashlib.sha256()
        for f in frames(ClusterSimulator(sc)):
            for col in (f.rank, f.t_start_ns, f.t_end_ns, f.off, f.op_kind, f.op_name,
                        f.op_group, f.op_seq, f.op_start_ns, f.op_dur_ns, f.op_bytes):  # fmt: skip
                h.update(col.tobytes())
        assert h.hexdigest() == GPIPE_DIGESTS[name], name
