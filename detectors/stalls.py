"""Named host stalls: GC, DataLoader waits, checkpoints and marked phases, by name.

The hook sends each as a compute op named `host:<what>` (schemas.rankstep.HOST_STALL_PREFIX).
The thread waited in them; it computed nothing. Left among the compute ops they would make a
rank that collects garbage look like a slow GPU. `split_stalls` moves them out of a frame's
ops into its `stall_*` columns, so every detector sees them as the idle time they are, and
the explanation can still say what the time was spent in.

>>> from detectors.testing import frame_of, rank_step
>>> ops = [("compute", "fwd", "", 0, 0.0, 100.0, 0), ("compute", "host:gc", "", 1, 100.0, 40.0, 0),
...        ("compute", "bwd", "", 2, 140.0, 200.0, 0)]
>>> f = frame_of([rank_step(0, "n0", 7, ops), rank_step(1, "n0", 7, ops[:1] + ops[2:])])
>>> [f.names[n] for n in f.op_name], f.off.tolist()
(['fwd', 'bwd', 'fwd', 'bwd'], [0, 2, 4])
>>> stall_seconds(f)
(['gc'], array([[0.04],
       [0.  ]]))
>>> describe_stalls(f, f.rank == 0)
'gc 0.04 s per step (the other ranks 0.00 s)'
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from schemas.frame import StepFrame
from schemas.rankstep import COMPUTE, HOST_STALL_PREFIX

_OP_COLUMNS = ("op_kind", "op_name", "op_group", "op_seq", "op_start_ns", "op_dur_ns",
               "op_bytes")  # fmt: skip
# A stall is worth naming in a sentence when it takes this share of the step or more.
NOTABLE_SHARE = 0.05


def _stall_names(names: list[str]) -> np.ndarray:
    return np.fromiter((n.startswith(HOST_STALL_PREFIX) for n in names), dtype=bool,
                       count=len(names))  # fmt: skip


def split_stalls(frame: StepFrame) -> StepFrame:
    """`frame` with its `host:` compute ops moved into the stall columns."""
    if frame.n_ops == 0:
        return frame
    named = _stall_names(frame.names)
    if not named.any():
        return frame
    is_stall = (frame.op_kind == COMPUTE) & named[frame.op_name]
    if not is_stall.any():
        return frame
    ri = frame.op_rank_index()
    keep = ~is_stall
    off = np.zeros(frame.n_ranks + 1, dtype=np.int64)
    np.cumsum(np.bincount(ri[keep], minlength=frame.n_ranks), out=off[1:])
    return replace(
        frame, off=off, **{c: getattr(frame, c)[keep] for c in _OP_COLUMNS},
        stall_rank=ri[is_stall], stall_name=frame.op_name[is_stall].astype(np.int32),
        stall_ns=frame.op_dur_ns[is_stall],
    )


def stall_seconds(frame: StepFrame) -> tuple[list[str], np.ndarray]:
    """The stall names of this step (prefix dropped) and an (R, K) matrix of each rank's
    seconds in each."""
    if frame.stall_ns.size == 0:
        return [], np.zeros((frame.n_ranks, 0))
    codes, col = np.unique(frame.stall_name, return_inverse=True)
    table = np.zeros((frame.n_ranks, codes.size))
    np.add.at(table, (frame.stall_rank, col), frame.stall_ns / 1e9)
    return [frame.names[c][len(HOST_STALL_PREFIX):] for c in codes.tolist()], table


def describe_stalls(frame: StepFrame, mask: np.ndarray, step_s: float = 0.0) -> str:
    """What the ranks of `mask` stalled in, by name, next to the other ranks: the names
    whose excess over the others is at least `NOTABLE_SHARE` of `step_s` (all with excess
    when `step_s` is 0), largest first; "" when none. Seconds are per rank and step."""
    names, table = stall_seconds(frame)
    if not names or not mask.any():
        return ""
    mine = table[mask].mean(axis=0)
    others = np.median(table[~mask], axis=0) if (~mask).any() else np.zeros(len(names))
    excess = mine - others
    parts = [f"{names[k]} {mine[k]:.2f} s per step (the other ranks {others[k]:.2f} s)"
             for k in np.argsort(-excess)
             if excess[k] > 0 and excess[k] >= NOTABLE_SHARE * step_s]  # fmt: skip
    return ", ".join(parts)
