"""Where a job-wide shift went: compute, transfers, waits or idle gaps, before and after.

A level shift with no device to blame still has a cause an SRE can act on. When every rank
computes slower, the model, data or configuration changed; when only the transfers grew, the
network every group crosses slowed (a NIC or switch all groups share, or the fabric); when
the gaps between ops grew on every node, the hosts did. `StepBudget` keeps the job's median
time per rank in each part for recent steps, and `explain` compares the steps at the new
level with those before them.

>>> b = StepBudget()
>>> for s in range(30):  # from step 20 the transfers take 10× longer
...     b.add(compute_s=0.20, transfer_s=0.02 * (10 if s >= 20 else 1), wait_s=0.01,
...           gap_s=0.01)
>>> b.explain(recent=5).split(":")[0]
'communication transfers ×10.0 (compute ×1.00, idle ×1.00)'

Named host stalls (`detectors.stalls`) say what the idle time was:

>>> b = StepBudget()
>>> for s in range(30):  # from step 20 every rank collects garbage for 0.4 s per step
...     gc = 0.4 if s >= 20 else 0.0
...     b.add(compute_s=0.60, transfer_s=0.02, wait_s=0.01, gap_s=0.001 + gc,
...           stalls={"gc": gc} if gc else {})
>>> b.explain(recent=5).split(": ")[0]
'idle gaps between ops +0.40 s on every node (compute ×1.00), in gc +0.40 s per step'
"""

from __future__ import annotations

from collections import deque

import numpy as np

from detectors.base import Stateful

_PARTS = ("compute", "transfer", "wait", "gap")


class StepBudget(Stateful):
    """Job medians of each part of the step for the last `depth` steps."""

    def __init__(self, depth: int = 60) -> None:
        self.rows: deque[tuple[float, float, float, float]] = deque(maxlen=depth)
        self.stalls: deque[dict[str, float]] = deque(maxlen=depth)

    def add(self, compute_s: float, transfer_s: float, wait_s: float, gap_s: float,
            stalls: dict[str, float] | None = None) -> None:
        """One step's job medians; `stalls`: seconds per rank in each named host stall."""
        self.rows.append((compute_s, transfer_s, wait_s, gap_s))
        self.stalls.append(stalls or {})

    def _stalls_grown(self, recent: int) -> str:
        """The named stalls that grew between the steps before `recent` and those after."""
        rows = list(self.stalls)
        names = sorted({n for r in rows for n in r})
        if not names:
            return ""
        a = np.array([[r.get(n, 0.0) for n in names] for r in rows])
        grew = np.median(a[-recent:], axis=0) - np.median(a[:-recent], axis=0)
        parts = [f"{names[k]} +{grew[k]:.2f} s" for k in np.argsort(-grew) if grew[k] > 0.0005]
        return f", in {', '.join(parts)} per step" if parts else ""

    def explain(self, recent: int) -> str:
        """What grew between the `recent` latest steps and the ones before them."""
        if len(self.rows) < recent + 3:
            return "data, model or configuration change"
        a = np.asarray(self.rows)
        before = np.median(a[:-recent], axis=0)
        now = np.median(a[-recent:], axis=0)
        grew = now - before  # seconds per step, per part
        ratio = now / np.maximum(before, 1e-9)
        part = _PARTS[int(np.argmax(grew))]
        compute, transfer, _wait, gap = ratio
        if part == "transfer":
            return (f"communication transfers ×{transfer:.1f} (compute ×{compute:.2f}, idle "
                    f"×{gap:.2f}): the network every group crosses slowed — a NIC or switch "
                    "they all share, or the fabric; no node stands out")
        if part == "gap":
            # from almost nothing (a job that never idled), a ratio says nothing: say seconds
            much = f"+{grew[3]:.2f} s" if before[3] < 0.01 else f"×{gap:.1f}"
            named = self._stalls_grown(recent)
            return (f"idle gaps between ops {much} on every node (compute ×{compute:.2f})"
                    + (f"{named}: host-side on all hosts alike" if named else
                       ": host-side (data loading, CPU, launch) on all hosts alike"))
        if part == "compute":
            return (f"compute ×{compute:.2f} on every rank: data, model or configuration "
                    "change")
        return "waits grew with no part of the work slower: data, model or configuration change"
