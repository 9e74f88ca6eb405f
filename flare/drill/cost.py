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

`flare drill --cpu-share` (`DrillSpec.cpu_share`) takes most of that away: each rank is held
to a steady 0.8 × cores / ranks CPUs, so it computes at one rate whoever waits. On this
project's 2 cores, shared with other work, 20 steps before the fault and 15 after, six seeds
each, the peers' compute during the fault against before went from 0.31-1.08 to 0.85-1.34,
and |estimate / measured - 1| over the drills that passed (median, p90) from 45%, 70% to
9%, 12% under a NIC's limit, from 17%, 45% to 6%, 14% for a flapping NIC, and from 32%, 72%
to 10%, 13% beside a slowed rank (4 of 6 passed with shares). Two things remain. A share is
a ceiling, not a floor: other work on the machine slows the ranks below it, and the error
still follows the peers' compute (NIC faults: -10% to -18% where it ran 1.20-1.34× slower,
+1% to +11% at 0.85-0.93×, -3% to +6% within 3%). And beside a slowed rank the what-if's
step without it is still 1.09-1.20× the healthy step, so it prices the rank 7-14% under the
measure. Likely why: its collectives slow with it (as the last to arrive, its copies took
1.7-2.3× as long, its peers' did not), and the what-if of a GPU culprit keeps transfers as
they ran.

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
