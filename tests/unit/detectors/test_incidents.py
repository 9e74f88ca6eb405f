"""An incident's cost over its evidence steps: the steps' noise cancels, the figures shown
are never negative."""

from __future__ import annotations

import pytest

from detectors.incidents import IncidentBook


def _incident():
    return IncidentBook("j").open_incident("gpu", "rank:2", [], 10, 10, 0, "")


def test_a_step_that_ran_faster_than_its_what_if_takes_back_its_share():
    inc = _incident()
    inc.add_evidence(10, slowdown=1.25, step_time_s=2.0, world=8)  # +3.2 GPU-s
    inc.add_evidence(11, slowdown=0.9, step_time_s=2.0, world=8)  # 2 × (1 - 1/0.9) × 8
    assert inc.lost_gpu_seconds == pytest.approx(3.2 - 16 / 9)
    assert inc.lost_gpu_seconds_per_step == 0.0  # the latest step's, floored
    assert inc.slowdown == pytest.approx((1.25 + 0.9) / 2)


def test_the_figures_shown_are_never_negative():
    inc = _incident()
    inc.add_evidence(10, slowdown=0.95, step_time_s=2.0, world=8)
    assert inc.lost_gpu_seconds == 0.0 and inc.slowdown == 1.0
    inc.add_evidence(11, slowdown=1.5, step_time_s=3.0, world=8)  # +8 GPU-s, less the first
    assert inc.lost_gpu_seconds == pytest.approx(8.0 + 2.0 * (1 - 1 / 0.95) * 8)
    assert inc.lost_gpu_seconds_per_step == pytest.approx(8.0)
    v1 = inc.to_v1("j")
    assert v1.slowdown == pytest.approx(round((0.95 + 1.5) / 2, 4))
