"""δ-irregularity and level shifts of a job's step time (Holmes' δ, Greyhound's 10% rule).

A step is irregular when it is δ× longer than the window's normal (the median of the last W
regular steps). Irregular steps are classed: a lone `spike` (GC, checkpoint, eval), a
`fluctuation` (irregular on and off), or `persistent` (several in a row). A persistent shift
is confirmed by Page-Hinkley (river) on the standardized log step time — clipped, so one
GC or checkpoint spike cannot fake a drift — and kept only if the level moved ≥10%
(Greyhound); then the baseline is rebuilt from the new level so δ stays meaningful as the
job changes (Holmes' drift problem).

Job-wide pauses (GC, checkpoint, eval) have no class of their own: they are `spike`s or
`fluctuation`s of the job's step time, with no device to blame (the suspects' peer
comparisons cancel them), so they never become device incidents.

>>> b = StepTimeBaseline(window=10)
>>> [b.update(t).irregular for t in (1.0, 1.02, 0.98, 1.0, 1.01)]
['warmup', 'warmup', 'warmup', 'warmup', 'warmup']
>>> r = b.update(2.0)  # a checkpoint: twice the normal step
>>> r.irregular, r.baseline_s, r.delta
('spike', 1.0, 2.0)
>>> b.update(1.0).irregular
'normal'
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from river import drift

from detectors.base import Stateful
from detectors.segments import robust_sigma
from schemas.report import IrregularClass

WARMUP = 5  # steps that only fill the window: a median of fewer is no baseline
PERSISTENT_RUN = 3  # irregular steps in a row that make a `persistent` slowdown
MIN_SHIFT = 0.10  # Greyhound keeps change points whose mean moved ≥10%
Z_CLIP = 10.0  # one step moves the Page-Hinkley sum by at most this many σ
PH_THRESHOLD = 30.0  # ≈3 steps of a 10σ shift
PH_DELTA = 0.5  # tolerated drift per step, in σ
LEVEL_STEPS = 5  # the new level is the median of this many latest steps: a periodic eval or
# checkpoint step among them (one in five or rarer) does not move it
REBASE_AFTER = 5  # steps with the level ≥ MIN_SHIFT off the baseline that re-baseline even if
# Page-Hinkley stays quiet (it restarts after each alarm, and interleaved short eval steps can
# keep an alarm from meeting a confirmation): the baseline is never stuck past ~10 steps
SIGMA_FLOOR = 0.01  # 1% step-to-step jitter at least



@dataclass(slots=True)
class Irregularity:
    """How one step compares with the job's normal step time."""

    baseline_s: float  # the window's normal step time (median of the last regular steps)
    delta: float  # step time / baseline_s
    irregular: IrregularClass
    level_shift: bool
    shift_ratio: float  # new level / old level when level_shift
    z: float = 0.0  # log(step / baseline_s) in σ of the window's step times (0 in warm-up)


class StepTimeBaseline(Stateful):
    """Robust running baseline of step time with change-point re-baselining."""

    def __init__(self, window: int = 50, delta: float = 1.1) -> None:
        self.window = window
        self.delta_thr = delta
        self._normal: deque[float] = deque(maxlen=window)
        self._recent: deque[float] = deque(maxlen=max(window // 5, 8))
        self._flags: deque[bool] = deque(maxlen=5)
        self._run = 0
        self._off = 0  # consecutive steps whose level is ≥ MIN_SHIFT off the baseline
        self._ph = self._new_ph()
        self._median: float | None = None  # of `_normal`; read on every heartbeat (hang timeout)

    @staticmethod
    def _new_ph() -> drift.PageHinkley:
        return drift.PageHinkley(
            min_instances=WARMUP, delta=PH_DELTA, threshold=PH_THRESHOLD, mode="both"
        )

    @property
    def sigma(self) -> float:
        """Robust σ of log step time over the window (relative jitter, scale-free)."""
        return robust_sigma(np.log(np.asarray(self._normal)), SIGMA_FLOOR)

    @property
    def baseline_s(self) -> float:
        if self._median is None:
            self._median = float(np.median(self._normal)) if self._normal else float("nan")
        return self._median

    def update(self, step_time_s: float) -> Irregularity:
        """Classify one step and learn from it."""
        t = max(step_time_s, 1e-9)
        self._recent.append(t)
        shift = False
        ratio = 1.0
        if len(self._normal) >= WARMUP:
            z = (np.log(t) - np.log(self.baseline_s)) / self.sigma
            self._ph.update(float(np.clip(z, -Z_CLIP, Z_CLIP)))
            latest = list(self._recent)[-LEVEL_STEPS:]
            new_level = float(np.median(latest))
            ratio = new_level / self.baseline_s
            moved = len(latest) == LEVEL_STEPS and abs(ratio - 1.0) >= MIN_SHIFT
            self._off = self._off + 1 if moved else 0
            if moved and (self._ph.drift_detected or self._off >= REBASE_AFTER):
                # the level moved and stays moved: re-baseline on the steps at the new level
                shift = True
                self._ph = self._new_ph()
                new = [x for x in latest if abs(x / new_level - 1.0) < MIN_SHIFT] or latest
                self._normal.clear()
                self._normal.extend(new)
                self._median = None
                self._run = 0
                self._off = 0
            elif not shift:
                ratio = 1.0
        if len(self._normal) < WARMUP:
            self._normal.append(t)
            self._median = None
            return Irregularity(self.baseline_s, 1.0, "warmup", shift, ratio)
        base = self.baseline_s
        d = t / base
        z = float(np.log(d)) / self.sigma
        irregular = d >= self.delta_thr
        self._flags.append(irregular)
        cls: IrregularClass
        if irregular:
            self._run += 1
            cls = (
                "persistent"
                if self._run >= PERSISTENT_RUN
                else ("fluctuation" if sum(self._flags) >= 2 and self._run == 1 else "spike")
            )
        else:
            self._run = 0
            cls = "normal"
            self._normal.append(t)
            self._median = None
        return Irregularity(base, d, cls, shift, ratio, z)
