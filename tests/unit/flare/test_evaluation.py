"""Scoring of one scenario: the first incident after the onset counts; repeats are counted."""

from __future__ import annotations

from flare.evaluation import fault_scenarios, run_scenario, score
from producers.simulator import Fault, Scenario, layout_for_gpus
from producers.simulator.scenario import GroundTruth
from schemas.wire import IncidentV1, Suspect


def _inc(culprit: str, opened: int, status: str = "resolved") -> IncidentV1:
    return IncidentV1(
        v=1, id=f"{culprit}@{opened}", job="j", status=status,  # type: ignore[arg-type]
        kind="gpu", culprit=culprit,
        suspects=[Suspect(entity=culprit, confidence=1.0)], onset_step=opened,
        opened_step=opened, opened_ts_ns=opened, last_step=opened + 5, resolved_step=None,
        slowdown=1.5, lost_gpu_seconds=1.0, evidence_steps=3, summary="",
    )


def test_incidents_on_the_culprit_after_the_first_are_repeats_others_are_false():
    sc = Scenario(job="j", layout=layout_for_gpus(64), steps=40, seed=1,
                  fault=Fault("slow_gpu", 1.5, 20))
    truth = GroundTruth(job="j", family="slow_gpu", kind="gpu", culprit="rank:5",
                        onset_step=20, onset_ts_ns=None, severity=1.5, layout={}, gpus=64,
                        steps=40, seed=1, step_time_s=1.0)
    events = [_inc("rank:5", 22), _inc("rank:5", 30), _inc("rank:9", 31),
              _inc("rank:5", 36, "open")]
    r = score(sc, truth, events)
    assert r.top1 and r.kind_ok and r.latency_steps == 2
    assert r.repeats == 2 and r.false_device == 1
    once = score(sc, truth, [_inc("rank:5", 22)])
    assert once.repeats == 0 and once.false_device == 0


def test_a_single_node_layout_is_evaluated_on_the_faults_it_can_have():
    """`flare eval --gpus 8` used to stop on the first cross-node fault it could not build;
    one node has no NIC traffic, no pipeline link and no peer node or host."""
    families = {sc.fault.family for sc in fault_scenarios([8], 1) if sc.fault}
    assert families == {"slow_gpu", "thermal", "hang_rank", "comm_hang"}
    slow = next(sc for sc in fault_scenarios([8], 1)
                if sc.fault and sc.fault.family == "slow_gpu" and sc.fault.severity == 2.0)
    assert run_scenario(slow).top1
