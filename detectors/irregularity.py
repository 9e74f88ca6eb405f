"""δ-irregularity and level shifts of a job's step time (Holmes' δ, Greyhound's 10% rule).

A step is irregular when it is δ× longer than the window's normal (the median of the last W
regular steps). Irregular steps are classed: a lone `spike` (GC, checkpoint, eval), a
`fluctuation` (irregular on and off), or `persistent` (several in a row). A persistent shift
is confirmed by Page-Hinkley (river) on the standardized log step time — clipped, so one
GC or checkpoint spike cannot fake a drift — and kept only if the level moved ≥10%
(Greyhound); then the baseline is rebuilt from the new level so δ stays meaningful as the
job changes (Holmes' drift problem).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
from river import drift

WARMUP = 5
PERSISTENT_RUN = 3
MIN_SHIFT = 0.10  # Greyhound keeps change points whose mean moved ≥10%
Z_CLIP = 10.0  # one step moves the Page-Hinkley sum by at most this many σ
PH_THRESHOLD = 30.0  # ≈3 steps of a 10σ shift
PH_DELTA = 0.5  # tolerated drift per step, in σ
SIGMA_FLOOR = 0.01  # 1% step-to-step jitter at least


@dataclass(slots=True)
class Irregularity:
    baseline_s: float
    delta: float
    irregular: str  # warmup | normal | spike | fluctuation | persistent
    level_shift: bool
    shift_ratio: float  # new level / old level when level_shift


class StepTimeBaseline:
    """Robust running baseline of step time with change-point re-baselining."""

    def __init__(self, window: int = 50, delta: float = 1.1) -> None:
        self.window = window
        self.delta_thr = delta
        self._normal: deque[float] = deque(maxlen=window)
        self._recent: deque[float] = deque(maxlen=max(window // 5, 8))
        self._flags: deque[bool] = deque(maxlen=5)
        self._run = 0
        self._ph = self._new_ph()
        self._median: float | None = None  # of `_normal`; read on every heartbeat (hang timeout)

    @staticmethod
    def _new_ph() -> drift.PageHinkley:
        return drift.PageHinkley(
            min_instances=WARMUP, delta=PH_DELTA, threshold=PH_THRESHOLD, mode="both"
        )

    def _sigma(self) -> float:
        logs = np.log(np.asarray(self._normal))
        mad = float(np.median(np.abs(logs - np.median(logs)))) if logs.size else 0.0
        return max(1.4826 * mad, SIGMA_FLOOR)

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
            z = (np.log(t) - np.log(self.baseline_s)) / self._sigma()
            self._ph.update(float(np.clip(z, -Z_CLIP, Z_CLIP)))
        if self._ph.drift_detected and len(self._normal) >= WARMUP:
            new_level = float(np.median(list(self._recent)[-PERSISTENT_RUN:]))
            ratio = new_level / self.baseline_s
            if abs(ratio - 1.0) >= MIN_SHIFT and self._run >= PERSISTENT_RUN - 1:
                shift = True
                self._ph = self._new_ph()
                self._normal.clear()
                self._normal.extend(list(self._recent)[-PERSISTENT_RUN:])
                self._median = None
                self._run = 0
        if len(self._normal) < WARMUP:
            self._normal.append(t)
            self._median = None
            return Irregularity(self.baseline_s, 1.0, "warmup", shift, ratio)
        base = self.baseline_s
        d = t / base
        irregular = d >= self.delta_thr
        self._flags.append(irregular)
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
        return Irregularity(base, d, cls, shift, ratio)
