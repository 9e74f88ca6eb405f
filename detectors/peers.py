"""Which ranks do comparable work: the reference a rank's compute and gaps are judged against.

Pipeline stages differ in work (embedding, loss), so a rank is compared with the ranks of its
own stage: the `pp` coordinate when producers send coords, otherwise ranks with the same mix
of compute ops (same names, same counts), which is what a stage looks like from outside.
"""

from __future__ import annotations

import numpy as np

from flare.detectors.frame import StepFrame
from flare.schemas.rankstep import COMPUTE


def stage_keys(frame: StepFrame) -> tuple[np.ndarray, int]:
    """(R,) int key of each rank's peer set and the number of distinct keys."""
    pp = frame.coord("pp")
    if frame.n_ranks and (pp >= 0).all():
        uniq, inv = np.unique(pp, return_inverse=True)
        return inv.astype(np.int64), int(uniq.size)
    ri = frame.op_rank_index()
    comp = frame.op_kind == COMPUTE
    n_names = max(len(frame.names), 1)
    cell = ri[comp] * n_names + frame.op_name[comp]
    counts = np.bincount(cell, minlength=frame.n_ranks * n_names).reshape(frame.n_ranks, n_names)
    if counts.size == 0:
        return np.zeros(frame.n_ranks, dtype=np.int64), 1
    uniq, inv = np.unique(counts, axis=0, return_inverse=True)
    return inv.reshape(-1).astype(np.int64), int(uniq.shape[0])
