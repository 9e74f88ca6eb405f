"""How a drill judges what it recorded: the fault's onset, the incident that answers it, and
the recording as a communication-only tracer would have logged it.

The onset counts from the rank furthest behind, not from one node's newest step: a CI run
killed rank 3 while node 0's ranks had finished step 25 and rank 3 (a later pipeline stage,
on node 1) was still in it; the onset taken from node 0 alone was 27, so the correct
incident, opened in step 25, was judged to come before the fault.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from flare.drill.run import (
    Truth,
    fault_onset,
    hang_wait_s,
    judge,
    newest_steps,
    without_compute,
)
from producers.recording import recording_line
from schemas.wire import IncidentV1, Suspect


def _published(path: Path, steps: dict[int, list[int]], node: str) -> Path:
    with open(path, "wb") as f:
        for rank, done in steps.items():
            for step in done:
                f.write(recording_line("flare.steps.v1", "j", {
                    "v": 1, "job": "j", "rank": rank, "node": node, "step": step,
                    "t_start_ns": 0, "t_end_ns": 1, "ops": []}))
                f.write(recording_line("flare.heartbeats.v1", "j", {"rank": rank, "step": 99}))
        f.write(b'{"topic": "flare.steps.v1", "key": "j", "value": {"rank": 0, "st')  # cut off
    return path


def _incident(opened: int, culprit: str = "rank:3") -> IncidentV1:
    return IncidentV1(v=1, id=f"i{opened}", job="j", status="open", kind="hang",
                      culprit=culprit, suspects=[Suspect(entity=culprit, confidence=1.0)],
                      onset_step=opened, opened_step=opened, opened_ts_ns=0, last_step=opened,
                      resolved_step=None, slowdown=1.0, lost_gpu_seconds=0.0, evidence_steps=1,
                      summary="")


def test_the_onset_follows_the_rank_furthest_behind_on_any_node(tmp_path: Path) -> None:
    node0 = _published(tmp_path / "n0.jsonl", {0: [23, 24, 25], 1: [24, 25]}, "node-0")
    node1 = _published(tmp_path / "n1.jsonl", {2: [24, 25], 3: [23, 24]}, "node-1")
    newest = newest_steps([node0, node1, tmp_path / "not-yet-written.jsonl"])
    assert newest == {0: 25, 1: 25, 2: 25, 3: 24}
    assert fault_onset(newest) == 26
    assert fault_onset(newest_steps([node0])) == 27  # what one node alone would have said
    assert fault_onset({}) == 1


def test_an_incident_in_the_step_the_fault_lands_in_answers_it(tmp_path: Path) -> None:
    truth = Truth("kill", "hang", "rank:3", fault_onset({0: 25, 3: 24}))
    found, false = judge(truth, [_incident(25)])
    assert found is not None and found.opened_step == 25 and false == []
    # one opened in a step finished before the fault is false
    found, false = judge(truth, [_incident(24)])
    assert found is None and [i.opened_step for i in false] == [24]


def test_a_communication_only_recording_keeps_every_transfer_and_no_compute(tmp_path: Path) -> None:
    src = tmp_path / "r.jsonl"
    with open(src, "wb") as f:
        f.write(recording_line("flare.jobs.v1", "j", {"v": 1, "job": "j", "event": "start",
                                                      "ts_ns": 1, "world_size": 2}))
        f.write(recording_line("flare.steps.v1", "j", {
            "v": 1, "job": "j", "rank": 0, "node": "n", "step": 0, "t_start_ns": 0,
            "t_end_ns": 9, "ops": {"kind": ["compute", "coll", "compute", "p2p"],
                                   "name": ["fwd", "all_reduce", "bwd", "send"],
                                   "group": ["", "tp.0", "", "pp.0.0-1"], "seq": [-1, 0, -1, 0],
                                   "start_ns": [0, 2, 4, 7], "dur_ns": [2, 2, 3, 1],
                                   "bytes": [0, 8, 0, 4], "issue_ns": [-1, 5, -1, 6]}}))
    lines = [orjson.loads(x) for x in open(without_compute(src, tmp_path / "c.jsonl"), "rb")]
    assert lines[0] == orjson.loads(open(src, "rb").readline())
    assert lines[1]["value"]["ops"] == {
        "kind": ["coll", "p2p"], "name": ["all_reduce", "send"], "group": ["tp.0", "pp.0.0-1"],
        "seq": [0, 0], "start_ns": [2, 7], "dur_ns": [2, 1], "bytes": [8, 4],
        "issue_ns": [5, 6]}


@pytest.mark.parametrize("step_s", [0.4, 10.0, 60.0])
def test_a_frozen_rank_is_left_frozen_past_the_hang_timeout_of_its_own_steps(step_s):
    """Flare's hang timeout is the longer of a floor and a few of the job's step times: a
    drill of 10 s steps that thawed its rank after a fixed 30 s judged Flare before it could
    have seen a hang."""
    from detectors.config import DetectorConfig

    cfg = DetectorConfig()
    timeout = max(cfg.hang_timeout_s, cfg.hang_timeout_steps * step_s)
    assert hang_wait_s(step_s) >= timeout + step_s


def test_a_nic_of_two_nodes_is_named_right_by_the_link_between_them() -> None:
    truth = Truth("nic", "link", "node:node-0", 27, only_link="link:node-0~node-1")
    found, false = judge(truth, [_incident(28, "link:node-0~node-1")])
    assert found is not None and truth.named(found.culprit) and not false
    four = Truth("nic", "link", "node:node-0", 27)  # more nodes: the NIC's own node only
    assert not four.named("link:node-0~node-1")


def test_the_profiler_traces_verdict_counts_in_the_drill(tmp_path: Path) -> None:
    """A drill with profiler traces passes only when they name the fault too."""
    from flare.drill.run import DrillResult, KinetoVerdict

    truth = Truth("freeze", "hang", "rank:3", 27)
    right = _incident(27)
    res = DrillResult(truth, [right], 40, False, tmp_path, found=right)
    assert res.passed
    res.kineto = KinetoVerdict([], 40, tmp_path)  # the traces named nothing
    assert not res.passed
    res.kineto = KinetoVerdict([right], 40, tmp_path, found=right)
    assert res.passed
    res.kineto = KinetoVerdict([], 0, tmp_path, error="no ProfilerStep#N spans")
    assert not res.passed


def test_the_cost_is_measured_against_the_healthy_steps_before_the_fault(tmp_path: Path) -> None:
    """The job's step time is the median rank span; the fault's steps are measured against
    the median of the twelve before it, not its warm-up."""
    from flare.drill.cost import measured_slowdown, step_times

    path = tmp_path / "rec.jsonl"
    with open(path, "wb") as f:
        for step in range(40):
            ms = 5000 if step < 3 else (400 if step < 27 else 1200)  # warm-up, healthy, fault
            for rank, extra in ((0, 0), (1, 10), (2, 500)):  # rank 2 an outlier: the median
                f.write(recording_line("flare.steps.v1", "j", {
                    "v": 1, "job": "j", "rank": rank, "node": "n", "step": step,
                    "t_start_ns": step * 10**10, "t_end_ns": step * 10**10 + (ms + extra) * 10**6,
                    "ops": []}))
    times = step_times(path)
    assert times[10] == 0.41 and times[30] == 1.21
    assert round(measured_slowdown(times, 27, range(29, 40)) or 0, 3) == round(1.21 / 0.41, 3)
    # an intermittent fault's evidence steps only: its quiet steps between are not its cost
    assert round(measured_slowdown(times, 27, [25, 30]) or 0, 3) == round(0.81 / 0.41, 3)
    assert measured_slowdown(times, 4, range(5, 10)) is None  # too few healthy steps before it
