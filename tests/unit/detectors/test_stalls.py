"""Named host stalls: out of the compute, into the incident's words."""

from __future__ import annotations

import re

import numpy as np
import pytest

from detectors.diagnoser import JobDiagnoser
from detectors.stalls import split_stalls, stall_seconds
from detectors.testing import frame_of, rank_step
from schemas.wire import IncidentV1

RANKS, PER_NODE = 16, 4


def _job(stalled: list[int], stall_s: float, name: str = "host:gc", steps: int = 60,
         onset: int = 30) -> list[IncidentV1]:
    """16 data-parallel ranks on 4 nodes: forward, backward, one all-reduce per step; from
    `onset` the ranks `stalled` spend `stall_s` in the named stall between fwd and bwd."""
    rng = np.random.default_rng(7)
    diag = JobDiagnoser("j")
    events: list[IncidentV1] = []
    for step in range(steps):
        fwd, bwd = 200 + rng.normal(0, 3, RANKS), 400 + rng.normal(0, 5, RANKS)
        stall = np.zeros(RANKS)
        if step >= onset:
            stall[stalled] = stall_s * 1e3 * (1 + rng.normal(0, 0.05, len(stalled)))
        end = (fwd + bwd + stall).max() + 20
        msgs = []
        for r in range(RANKS):
            ops = [("compute", "fwd", "", 0, 0.0, fwd[r], 0)]
            if stall[r] > 0:
                ops.append(("compute", name, "", 1, fwd[r], stall[r], 0))
            t = fwd[r] + stall[r]
            ops += [("compute", "bwd", "", 2, t, bwd[r], 0),
                    ("coll", "all_reduce", "dp.0", step, t + bwd[r], end - t - bwd[r], 1 << 20)]
            msgs.append(rank_step(r, f"n{r // PER_NODE}", step, ops, t0_ns=10**18 + step * 10**9,
                                  coords={"tp": 0, "pp": 0, "dp": r}))
        events += diag.on_frame(frame_of(msgs)).incidents
    return events


def _seconds(pattern: str, summary: str) -> float:
    found = re.search(pattern, summary)
    assert found is not None, summary
    return float(found.group(1))


def test_a_stall_leaves_the_compute_ops_and_keeps_its_name_and_time():
    ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0), ("compute", "host:data", "", 1, 10.0, 5.0, 0),
           ("coll", "all_reduce", "dp.0", 3, 15.0, 2.0, 64)]
    frame = frame_of([rank_step(0, "n0", 1, ops), rank_step(1, "n0", 1, [ops[0], ops[2]])])
    assert [frame.names[n] for n in frame.op_name] == ["fwd", "all_reduce"] * 2
    assert frame.off.tolist() == [0, 2, 4]
    names, table = stall_seconds(frame)
    assert names == ["data"] and table[:, 0] == pytest.approx([0.005, 0.0])
    plain = frame_of([rank_step(0, "n0", 1, [ops[0]]), rank_step(1, "n0", 1, [ops[0]])])
    assert split_stalls(plain) is plain and plain.stall_ns.size == 0


def test_one_rank_in_gc_is_named_with_what_it_stalls_in_and_who_waits():
    events = _job([5], 0.4)
    device = {(e.kind, e.culprit) for e in events if e.kind != "job"}
    assert device == {("host", "rank:5")}
    first = next(e for e in events if e.culprit == "rank:5")
    assert first.opened_step - 30 <= 3
    assert _seconds(r"; in gc ([\d.]+) s per step \(the other ranks 0.00 s\)", first.summary) == (
        pytest.approx(0.4, abs=0.03))
    assert "15 ranks wait on it in dp.0 all_reduce" in first.summary, first.summary
    assert 1.4 < first.slowdown < 1.9  # the job's 1.0 s step becomes ~1.6 s


def test_a_whole_node_loading_data_is_its_host_by_name():
    events = _job([4, 5, 6, 7], 0.3, name="host:data")
    device = {(e.kind, e.culprit) for e in events if e.kind != "job"}
    assert device == {("host", "node:n1")}
    assert _seconds(r"its ranks stall in data ([\d.]+) s per step", events[0].summary) == (
        pytest.approx(0.3, abs=0.03))


def test_gc_on_every_rank_blames_no_device_and_says_it_was_gc():
    events = _job(list(range(RANKS)), 0.4)
    assert {e.kind for e in events} == {"job"}
    assert _seconds(r"in gc \+([\d.]+) s per step", events[0].summary) == (
        pytest.approx(0.4, abs=0.03))


def test_a_rank_of_a_healthy_job_is_not_blamed_for_its_noise():
    assert [e for e in _job([], 0.0) if e.kind != "job"] == []
