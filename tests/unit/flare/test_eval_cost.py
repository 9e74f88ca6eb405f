"""An incident's cost is checked on its own evidence steps, against the run without the fault."""

from __future__ import annotations

import pytest

from flare.eval_cost import check_cost, cost_error, cost_metrics, cost_scored, evidence_steps
from schemas.wire import IncidentV1, Suspect


def _event(iid: str, last_step: int, evidence: int, lost: float, status: str = "open"
           ) -> IncidentV1:  # fmt: skip
    return IncidentV1(
        v=1, id=iid, job="j", status=status, kind="gpu", culprit="rank:5",  # type: ignore[arg-type]
        suspects=[Suspect(entity="rank:5", confidence=1.0)], onset_step=20, opened_step=22,
        opened_ts_ns=0, last_step=last_step, resolved_step=None, slowdown=1.2,
        lost_gpu_seconds=lost, evidence_steps=evidence, summary="",
    )  # fmt: skip


# Incident "a" took steps 22, 23 and 25 as evidence. Its second event at step 23 only
# re-states it (new suspects), and "b", another incident, took step 24.
EVENTS = [
    _event("a", 22, 1, 6.0),
    _event("a", 23, 2, 11.0),
    _event("b", 24, 1, 99.0),
    _event("a", 23, 2, 11.0),
    _event("a", 25, 3, 17.0),
    _event("a", 25, 3, 17.0, status="resolved"),
]
WITH_FAULT = {21: 2.0, 22: 2.5, 23: 2.5, 24: 9.0, 25: 2.7}
WITHOUT = {21: 2.0, 22: 2.0, 23: 2.0, 24: 2.0, 25: 2.0}


def test_an_incident_s_evidence_steps_are_those_whose_update_added_evidence():
    assert evidence_steps(EVENTS, "a") == [22, 23, 25]
    assert evidence_steps(EVENTS, "b") == [24]
    assert evidence_steps(EVENTS, "c") == []


def test_the_actual_cost_is_what_the_fault_added_to_those_steps_times_the_gpus():
    check = check_cost(EVENTS, "a", WITH_FAULT, WITHOUT, gpus=8)
    assert check is not None
    assert check.estimate == 17.0  # the final lost_gpu_seconds
    assert check.actual == pytest.approx((0.5 + 0.5 + 0.7) * 8)  # 13.6 GPU-s
    assert check.steps == 3
    assert check.job == pytest.approx(3 * 2.0 * 8)  # the job's GPU time without the fault
    assert cost_error(check.estimate, check.actual) == pytest.approx(17.0 / 13.6 - 1)
    assert check_cost(EVENTS, "c", WITH_FAULT, WITHOUT, gpus=8) is None


def test_a_step_missing_from_either_run_is_left_out():
    no_23 = {k: v for k, v in WITHOUT.items() if k != 23}
    check = check_cost(EVENTS, "a", {**WITH_FAULT, 25: float("nan")}, no_23, gpus=8)
    assert check is not None and check.steps == 1
    assert check.actual == pytest.approx(0.5 * 8)


def test_errors_are_summarized_and_a_fault_that_cost_nothing_is_counted_apart():
    assert cost_error(5.0, 0.0) is None and cost_error(5.0, -1.0) is None
    runs = [(11.0, 10.0, 100.0), (8.0, 10.0, 100.0), (13.0, 10.0, 100.0), (14.0, 10.0, 100.0),
            (15.0, 10.0, 5000.0), (3.0, 0.0, 100.0)]  # fmt: skip
    m = cost_metrics(runs, hangs_only=False)  # errors 0.1, 0.2, 0.3, 0.4, 0.5
    assert m["cost_err_median"] == pytest.approx(0.3)
    assert m["cost_err_p90"] == pytest.approx(0.46)  # numpy's linear quantile
    assert (m["cost_runs"], m["cost_skipped"], m["cost_na"]) == (5, 1, False)
    # the last costed 10 of the job's 5,000 GPU-s (0.2%): scored apart, by its share
    assert m["cost_material_runs"] == 4
    assert m["cost_material_median"] == pytest.approx(0.25)
    assert m["cost_small_share_p90"] == pytest.approx(5.0 / 5000.0)
    none = cost_metrics([], hangs_only=True)
    assert none["cost_err_median"] is None and none["cost_runs"] == 0 and none["cost_na"]


def test_only_a_named_single_fault_that_is_not_a_hang_is_scored_for_cost():
    assert cost_scored("gpu", two_faults=False, top1=True)
    assert not cost_scored("hang", two_faults=False, top1=True)  # the stopped job's time
    assert not cost_scored("gpu", two_faults=True, top1=True)  # the run without holds both
    assert not cost_scored("gpu", two_faults=False, top1=False)  # another culprit's cost
    assert not cost_scored(None, two_faults=False, top1=False)  # a clean run
