"""DetectorConfig: the knobs of the detection core, as one frozen value.

Detectors never read the environment: the CLI builds this from `FLARE_DETECT_*` settings
(`flare.settings.DetectorSettings.config()`) and passes it to every `JobDiagnoser`. The
defaults are the ones ACCURACY.md was measured with.

>>> DetectorConfig().hang_timeout_s
10.0
>>> DetectorConfig(resolve_after=3).resolve_after
3
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DetectorConfig:
    grace_s: float = 5.0  # wait at least this long for missing ranks of a step
    grace_steps: float = 0.5  # ... and at least this many of the job's recent step times
    window: int = 50  # normal steps in the δ baseline
    delta: float = 1.1  # δ: a step this many times the normal is irregular (Holmes)
    hang_timeout_s: float = 10.0  # floor of the hang timeout ...
    hang_timeout_steps: float = 3.0  # ... which is this many baseline step times
    resolve_after: int = 10  # steps with the culprit not even a suspect before resolving
    ops_sample_every: int = 100  # keep raw ops of every Nth step
    # ... of at most this many ops: past it, whole ranks, the named ones' nodes first
    # (detectors/kept_ops.py)
    keep_ops: int = 2_000_000
    # the what-if replays every evidence step of an incident up to this many ops per step;
    # a larger step every k-th (k = its ops / this), the steps between at its last estimate
    price_ops: int = 2_000_000
