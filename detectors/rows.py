"""Storage rows of one step (RankRows, GroupRows) from its frame and features.

What each rank and each group did in the step, in the columns `schemas.report` defines; the
detectors compute these quantities anyway, so storing them costs no extra pass.

>>> from detectors.features import step_features
>>> from detectors.testing import frame_of, rank_step
>>> frame = frame_of([
...     rank_step(r, "n0", 0, [("coll", "all_reduce", "dp.0", 1, 0.0, 5.0 + r, 64)])
...     for r in range(2)
... ])
>>> feats = step_features(frame)
>>> g = group_rows(frame, feats, np.full(1, np.nan))
>>> g.group, g.n_members.tolist(), g.n_instances.tolist(), (g.transfer_s * 1e3).round(3).tolist()
(['dp.0'], [2], [1], [5.0])
>>> rank_rows(frame, feats, np.ones(2)).node
['n0', 'n0']
"""

from __future__ import annotations

import numpy as np

from detectors.features import StepFeatures
from schemas.frame import StepFrame
from schemas.report import GroupRows, RankRows


def rank_rows(frame: StepFrame, feats: StepFeatures, ratio: np.ndarray) -> RankRows:
    """Per-rank time budget; `ratio` is `compute_suspects.compute_ratio` (NaN stored as 1)."""
    return RankRows(
        rank=frame.rank,
        node=[frame.nodes[i] for i in frame.node.tolist()],
        step_s=feats.span_s,
        compute_s=feats.compute_s,
        comm_s=feats.comm_s,
        gap_s=feats.gap_s,
        wait_s=feats.wait_s,
        caused_wait_s=feats.caused_wait_s,
        compute_ratio=np.nan_to_num(ratio, nan=1.0),
        n_ops=feats.n_ops.astype(np.int64),
    )


def group_rows(frame: StepFrame, feats: StepFeatures, ref: np.ndarray) -> GroupRows:
    """Per-group aggregates; `ref` is each instance's comparable transfer (NaN: none)."""
    inst = feats.inst
    if inst.transfer_s.size == 0:
        z = np.zeros(0)
        return GroupRows([], z.astype(np.int64), z.astype(np.int64), z, z, z, z)
    n_codes = len(frame.groups)
    per_code = np.bincount(inst.group, minlength=n_codes)
    used = np.flatnonzero(per_code)
    dense = np.full(n_codes, -1)
    dense[used] = np.arange(used.size)
    g = dense[inst.group]
    G = used.size
    cg = g[inst.copy_inst]
    members = np.zeros(G, dtype=np.int64)
    np.maximum.at(members, g, inst.n_copies)  # an instance has every traced member
    has_ref = np.isfinite(ref)
    t_sum = np.bincount(g, weights=np.where(has_ref, inst.transfer_s, 0.0), minlength=G)
    r_sum = np.bincount(g, weights=np.where(has_ref, ref, 0.0), minlength=G)
    return GroupRows(
        group=[frame.groups[i] for i in used.tolist()],
        n_members=members.astype(np.int64),
        n_instances=np.bincount(g, minlength=G).astype(np.int64),
        comm_s=np.bincount(g, weights=inst.mean_s * inst.n_copies, minlength=G),
        transfer_s=np.bincount(g, weights=inst.transfer_s, minlength=G),
        wait_s=np.bincount(cg, weights=inst.copy_wait_s, minlength=G),
        transfer_ratio=np.where(r_sum > 0, t_sum / np.maximum(r_sum, 1e-12), 1.0),
    )
