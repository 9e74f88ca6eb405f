"""Which ranks do comparable work: the reference a rank's compute and gaps are judged against.

Pipeline stages differ in work (embedding, loss), so a rank is compared with the ranks of its
own stage: the `pp` coordinate when producers send coords, otherwise ranks with the same mix
of compute ops and transfers (same names, same counts, the same way first), which is what a
stage looks like from outside.

Without coords, ranks 0–1 run the first stage's kernels and ranks 2–3 the last stage's:

>>> from detectors.testing import frame_of, rank_step
>>> def ops(r):
...     names = ["embed", "layer"] if r < 2 else ["layer", "loss"]
...     return [("compute", n, "", i, 10.0 * i, 5.0, 0) for i, n in enumerate(names)]
>>> frame = frame_of([rank_step(r, "n0", 0, ops(r)) for r in range(4)])
>>> keys, n = stage_keys(frame)
>>> keys.tolist(), n
([1, 1, 0, 0], 2)
>>> replica_keys(frame) is None  # no coords, no tp groups: the node is the reference
True
"""

from __future__ import annotations

import numpy as np

from schemas.frame import StepFrame
from schemas.rankstep import COMPUTE, P2P


def stage_keys(frame: StepFrame) -> tuple[np.ndarray, int]:
    """(R,) int key of each rank's peer set and the number of distinct keys."""
    pp = frame.coord("pp")
    if frame.n_ranks and (pp >= 0).all():
        uniq, inv = np.unique(pp, return_inverse=True)
        return inv.astype(np.int64), int(uniq.size)
    ri = frame.op_rank_index()
    mix = (frame.op_kind == COMPUTE) | (frame.op_kind == P2P)
    n_names = max(len(frame.names), 1)
    cell = ri[mix] * n_names + frame.op_name[mix]
    counts = np.bincount(cell, minlength=frame.n_ranks * n_names).reshape(frame.n_ranks, n_names)
    if counts.size == 0:
        return np.zeros(frame.n_ranks, dtype=np.int64), 1
    uniq, inv = np.unique(np.column_stack([counts, _sends_first(frame, ri)]), axis=0,
                          return_inverse=True)
    return inv.reshape(-1).astype(np.int64), int(uniq.shape[0])


def _sends_first(frame: StepFrame, ri: np.ndarray) -> np.ndarray:
    """(R,) 1 where a rank's first transfer of the step is a send, 0 a receive, -1 none.

    A pipeline's first stage sends its activations before it receives anything; every
    later stage receives first. Where one compute op stands for all of a step's kernels (a
    GPU trace's `gpu_compute`) the compute mix is the same on every stage, and this (with
    the counts of sends and receives: a middle stage talks to two neighbours) is what tells
    the stages apart."""
    out = np.full(frame.n_ranks, -1, dtype=np.int64)
    p2p = np.flatnonzero(frame.op_kind == P2P)
    if p2p.size == 0:
        return out
    p2p = p2p[np.lexsort((frame.op_start_ns[p2p], ri[p2p]))]
    first = p2p[np.r_[True, ri[p2p][1:] != ri[p2p][:-1]]]
    send = np.fromiter((n == "send" for n in frame.names), dtype=bool, count=len(frame.names))
    out[ri[first]] = send[frame.op_name[first]]
    return out


def replica_keys(frame: StepFrame) -> tuple[np.ndarray, int] | None:
    """(R,) key of each rank's tensor-parallel group, or None when it cannot be told.

    Ranks of one TP group process the same data, so data-dependent jitter (sequence length,
    MoE routing of the replica) cancels when a rank is compared with them: a GPU that is
    10% slow stands out even when replicas differ by 5% from step to step. Known from the
    coords (same pp, dp, cp), else from the `tp.*` group a rank reports.
    """
    dims = [frame.coord(d) for d in ("pp", "dp", "cp")]
    if (
        frame.n_ranks
        and (frame.coord("tp") >= 0).all()
        and (dims[0] >= 0).all()
        and (dims[1] >= 0).all()
    ):
        key = (dims[0].astype(np.int64) << 40) | (dims[1].astype(np.int64) << 20)
        key |= np.maximum(dims[2], 0).astype(np.int64)
        _, inv = np.unique(key, return_inverse=True)
        return inv.reshape(-1).astype(np.int64), int(inv.max()) + 1
    is_tp = np.fromiter(
        (g.startswith("tp.") for g in frame.groups), dtype=bool, count=len(frame.groups)
    )
    if not is_tp.any():
        return None
    rows = np.flatnonzero(is_tp[frame.op_group])
    ri = frame.op_rank_index()[rows]
    first = np.r_[True, ri[1:] != ri[:-1]] if ri.size else np.zeros(0, bool)
    if int(first.sum()) != frame.n_ranks:
        return None  # some rank has no tp op: fall back to the node
    codes = frame.op_group[rows[first]]
    _, inv = np.unique(codes, return_inverse=True)
    return inv.reshape(-1).astype(np.int64), int(inv.max()) + 1
