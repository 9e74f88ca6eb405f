"""What a drill's incident said its fault costs, against what the job's own steps show.

The steps a drill trains before its fault are the same job without it: the same model, batch
and machine. The slowdown the fault caused is then measured, not modelled: the job's step time
over the incident's evidence steps against the median healthy step before the fault. The
incident's own estimate (`slowdown`, the mean of its what-if over the same steps) is read,
never imitated, so the check stays valid whatever the estimator does. Both are over the steps
that showed the fault: a flapping NIC's incident prices its bursts, not the quiet steps
between them. A hang's or a killed rank's cost is the stopped job by definition, so only
faults that slow the job are checked.

One thing makes the steps before the fault a counterfactual of the drill's machine, not of
a GPU job: a drill's ranks share its cores, so a fault that leaves ranks waiting lets the
others compute faster (21-28% under a NIC's limit, 35-57% beside a throttled rank, in the
kept recordings). A GPU computes as fast whoever waits, and the what-if keeps each step's
compute as it ran, so it prices the fault above what a drill measures (the kept NIC
recordings: +11% to +46%; less each step's saved compute taken from the healthy step,
-0.4% to +27%).

>>> times = {s: 0.4 for s in range(10, 27)} | {s: 1.2 for s in range(27, 40)}
>>> round(measured_slowdown(times, onset=27, steps=range(29, 40)), 3)
3.0
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import orjson

_HEALTHY = 12  # steps before the fault the healthy step time is the median of
SLOWING = ("slow-rank", "nic", "flapping-nic")  # faults whose cost a drill checks


def step_times(recording: Path) -> dict[int, float]:
    """Step → the job's step time (s) as the detectors measure it: the median rank span."""
    spans: dict[int, list[int]] = {}
    with open(recording, "rb") as f:
        for line in f:
            m = orjson.loads(line)
            if m["topic"] == "flare.steps.v1":
                v = m["value"]
                spans.setdefault(int(v["step"]), []).append(v["t_end_ns"] - v["t_start_ns"])
    return {s: float(np.median(x)) / 1e9 for s, x in spans.items()}


def measured_slowdown(times: dict[int, float], onset: int, steps: Iterable[int]
                      ) -> float | None:
    """The mean, over `steps` (an incident's evidence steps), of the step time against the
    median healthy step (the `_HEALTHY` steps that end one before the fault's first whole
    step, which it may already touch); None with too few of either."""
    healthy = [times[s] for s in range(onset - 1 - _HEALTHY, onset - 1) if s in times]
    during = [times[s] for s in steps if s in times]
    if len(healthy) < _HEALTHY // 2 or not during:
        return None
    return float(np.mean(during) / np.median(healthy))
