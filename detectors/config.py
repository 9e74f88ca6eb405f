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
    grace_s: float = 5.0  # wait this long for missing ranks of a step
    window: int = 50  # normal steps in the δ baseline
    delta: float = 1.1  # δ: a step this many times the normal is irregular (Holmes)
    hang_timeout_s: float = 10.0  # an op in flight longer than this is hung (floor)
    resolve_after: int = 10  # steps with the culprit not even a suspect before resolving
    ops_sample_every: int = 100  # keep raw ops of every Nth step
