"""The δ baseline: irregular steps classed, level shifts re-baselined within a few steps."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.irregularity import StepTimeBaseline


def _steps(n: int, shift_at: int, shift: float, eval_every: int, seed: int) -> list[float]:
    """1 s training steps with 1% jitter; every `eval_every`-th is a 0.6× forward-only eval
    step; from `shift_at` on everything is `shift`× longer."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(n):
        t = 1.0 * (1 + 0.01 * rng.standard_normal())
        if eval_every and s % eval_every == eval_every - 1:
            t *= 0.6
        out.append(t * (shift if s >= shift_at else 1.0))
    return out


@pytest.mark.parametrize("eval_every", [0, 5, 7])
@pytest.mark.parametrize("shift", [1.15, 1.5, 0.8])
@pytest.mark.parametrize("seed", range(5))
def test_a_level_shift_re_baselines_within_ten_steps_even_between_eval_steps(
        eval_every: int, shift: float, seed: int) -> None:
    b = StepTimeBaseline(window=50)
    results = [b.update(t) for t in _steps(160, 60, shift, eval_every, seed)]
    shifts = [i for i, r in enumerate(results) if r.level_shift]
    assert shifts and 60 <= shifts[0] <= 70, shifts
    assert len(shifts) == 1, f"one shift, re-baselined once: {shifts}"
    tail = [r.irregular for r in results[80:]]
    assert "persistent" not in tail, "the baseline stayed stuck at the old level"
    assert b.baseline_s == pytest.approx(shift, rel=0.03)


def test_lone_pauses_are_spikes_and_no_shift() -> None:
    b = StepTimeBaseline(window=50)
    ts = _steps(200, 10**6, 1.0, 0, 1)
    for s in range(40, 200, 40):
        ts[s] *= 3.0  # a checkpoint
    results = [b.update(t) for t in ts]
    assert not any(r.level_shift for r in results)
    assert {results[s].irregular for s in range(40, 200, 40)} == {"spike"}


def test_a_steps_significance_is_its_log_excess_in_the_windows_jitter() -> None:
    """1% jitter: a step ×1.02 is about 2σ, a checkpoint ×3 about a hundred; warm-up none."""
    b = StepTimeBaseline(window=50)
    ts = _steps(60, 10**6, 1.0, 0, 2)
    assert [b.update(t).z for t in ts[:5]] == [0.0] * 5
    for t in ts[5:]:
        b.update(t)
    assert 1.0 < b.update(b.baseline_s * 1.02).z < 4.0
    assert b.update(b.baseline_s * 3.0).z > 50.0
