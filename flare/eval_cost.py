"""What an incident says it cost, checked against the same run without its fault (issue #12).

The simulator draws noise, clocks and workload from streams of their own, so a scenario re-run
without its fault (`Scenario.without_faults`) is the same job draw for draw, only without the
fault. What the fault cost is then measured, not modelled: over the steps the incident took as
evidence, the job's step time with the fault less its step time without it, times the job's
GPUs. The estimator under test (the incident's `lost_gpu_seconds`) is read, never imitated, so
this scoring stays valid whatever the estimator does.

A fault that cost under 1% of the job's GPU time over those steps (`MATERIAL`) is scored apart:
the relative error of a loss that small is mostly the noise of two step-time medians, not the
estimator. Such runs report their error as a share of the job's GPU time instead, and the
ratio's median and p90 are given both over every run (the issue's figure) and over the
material runs.

A hang is not scored: its cost is the stopped job's GPU time by definition, so there is
nothing to estimate. Two simultaneous faults are not either: the run without both holds the
cost of both, which no single incident should claim.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from producers.simulator import ClusterSimulator, Scenario
from schemas.frame import StepFrame
from schemas.wire import IncidentV1

HANG_KIND = "hang"
MATERIAL = 0.01  # a fault costing less than this share of the job's GPU time is scored apart


@dataclass(frozen=True, slots=True)
class CostCheck:
    """One incident's cost: its own estimate and what the fault actually cost (GPU-s)."""

    estimate: float
    actual: float
    steps: int  # evidence steps present in both runs, over which `actual` is summed
    job: float = 0.0  # the job's GPU time over those steps without the fault (GPU-s)


def job_step_time(frame: StepFrame) -> float:
    """The job's step time (s) as the detectors measure it: the median rank span, so that
    the truth and the estimate speak of the same quantity. NaN for a frame without ranks."""
    if frame.n_ranks == 0:
        return float("nan")
    return float(np.median(frame.t_end_ns - frame.t_start_ns)) / 1e9


def counterfactual_step_times(sc: Scenario) -> dict[int, float]:
    """Step → job step time of `sc` run without its faults. Heartbeats are left out: they
    draw nothing and change no frame (tests/unit/producers/simulator/test_simulator.py), and
    with long steps they are most of the simulation (×6 its time at 30 s steps)."""
    plain = replace(sc.without_faults(), heartbeats=False)
    frames = (x for x in ClusterSimulator(plain).run() if isinstance(x, StepFrame))
    return {f.step: job_step_time(f) for f in frames}


def evidence_steps(events: Iterable[IncidentV1], incident_id: str) -> list[int]:
    """The steps incident `incident_id` took as evidence: the `last_step` of each of its
    updates that raised `evidence_steps` (other updates re-state it: suspects, resolution)."""
    steps: list[int] = []
    seen = 0
    for ev in events:
        if ev.id == incident_id and ev.evidence_steps > seen:
            steps.append(ev.last_step)
            seen = ev.evidence_steps
    return steps


def check_cost(
    events: list[IncidentV1],
    incident_id: str,
    fault_times: dict[int, float],
    clean_times: dict[int, float],
    gpus: int,
) -> CostCheck | None:
    """The incident's final `lost_gpu_seconds` next to Σ over its evidence steps of (step
    time with the fault − without it) × GPUs; None when no event has that id. A step missing
    from either run (no rank reported it) is left out of the sum."""
    mine = [ev for ev in events if ev.id == incident_id]
    if not mine:
        return None
    actual, job, used = 0.0, 0.0, 0
    for step in evidence_steps(mine, incident_id):
        with_fault, without = fault_times.get(step), clean_times.get(step)
        if with_fault is None or without is None:
            continue
        if not (np.isfinite(with_fault) and np.isfinite(without)):
            continue
        actual += (with_fault - without) * gpus
        job += without * gpus
        used += 1
    return CostCheck(estimate=mine[-1].lost_gpu_seconds, actual=actual, steps=used, job=job)


def cost_error(estimate: float, actual: float) -> float | None:
    """|estimate / actual − 1|; None when the fault cost nothing (actual ≤ 0), where a
    ratio has no meaning (such runs are counted apart)."""
    if actual <= 0:
        return None
    return abs(estimate / actual - 1.0)


def material(actual: float, job: float) -> bool:
    """Whether a fault's actual cost is at least `MATERIAL` of the job's GPU time."""
    return job > 0 and actual >= MATERIAL * job


def _q(values: list[float], q: float) -> float | None:
    return float(np.quantile(values, q)) if values else None


def cost_metrics(
    checks: list[tuple[float, float, float]], hangs_only: bool
) -> dict[str, object]:
    """Cost error over (estimate, actual, job) triples: median and p90 of |estimate/actual −
    1| over every run that cost something, the same over the material runs, and for the
    runs below `MATERIAL` the p90 of |estimate − actual| as a share of the job's GPU time.
    Runs whose fault cost nothing are counted as skipped. `cost_na` marks results whose
    fault runs are all hangs: not scored for cost, rather than scored badly."""
    scored = [(est, act, job) for est, act, job in checks if act > 0]
    errors = [abs(est / act - 1.0) for est, act, _ in scored]
    big = [abs(est / act - 1.0) for est, act, job in scored if material(act, job)]
    small = [abs(est - act) / job for est, act, job in scored
             if not material(act, job) and job > 0]  # fmt: skip
    return {
        "cost_na": hangs_only,
        "cost_err_median": _q(errors, 0.5),
        "cost_err_p90": _q(errors, 0.9),
        "cost_runs": len(errors),
        "cost_skipped": len(checks) - len(scored),
        "cost_material_median": _q(big, 0.5),
        "cost_material_p90": _q(big, 0.9),
        "cost_material_runs": len(big),
        "cost_small_share_p90": _q(small, 0.9),
    }


def cost_scored(truth_kind: str | None, two_faults: bool, top1: bool) -> bool:
    """Whether a fault run's scored incident is checked for cost: it names the true culprit
    (another culprit's cost is not this fault's), the fault is not a hang, and it is alone."""
    return top1 and truth_kind is not None and truth_kind != HANG_KIND and not two_faults
