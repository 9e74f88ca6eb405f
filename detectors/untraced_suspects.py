"""Untraced suspects: the rank everyone waits on reports nothing, so name where it must be.

Production tracers often record one rank per tensor-parallel group. A slow GPU that is not
traced then leaves no compute of its own to compare; what it leaves is its traced group peer
waiting: that peer's collectives on the group (the only copy of each instance we see) take
longer than the same collectives of its stage peers, while its own compute is normal. The
narrowest entity the data supports is the node of the traced peer (tensor-parallel groups live
inside a node); the kind stays `gpu`, and the detail says the culprit is not traced.

Only groups with exactly one traced member are judged here: with two or more, the member
that arrives last is seen and the compute and network views name it.

Four traced ranks, one per `tp` group of size 4 (the layout says so); the untraced members of
`tp.2` are slow, so rank 8 waits 30 ms in its group's all-reduce where the others wait 1 ms:

>>> from detectors.features import step_features
>>> from detectors.noise import NoiseMemory
>>> from detectors.peers import stage_keys
>>> from detectors.testing import frame_of, rank_step
>>> frame = frame_of([
...     rank_step(r, f"n{r // 4}", 0, [
...         ("compute", "fwd", "", 0, 0.0, 10.0, 0),
...         ("coll", "all_reduce", f"tp.{r // 4}", 0, 10.0, 30.0 if r == 8 else 1.0, 1 << 20)])
...     for r in (0, 4, 8, 12)])
>>> out = Candidates()
>>> untraced_suspects(frame, step_features(frame), {"tp": 4}, stage_keys(frame),
...                   NoiseMemory(), out)
>>> out.entity, out.kind
(['node:n2'], ['gpu'])
"""

from __future__ import annotations

import numpy as np

from detectors.candidates import Z_REPORT, Candidates
from detectors.features import StepFeatures
from detectors.noise import NoiseMemory
from detectors.segments import grouped_median
from schemas.frame import StepFrame
from schemas.rankstep import COLL, P2P

# σ floor of the log ratio of a rank's single-member-group wait to its stage peers': the same
# 0.4% as a GPU's compute ratio (compute_suspects), for the same reason (identical ranks).
_SIGMA_FLOOR = 0.004


def single_member_groups(frame: StepFrame, group_size: dict[str, int]) -> np.ndarray:
    """(G,) bool over `frame.groups`: a collective group of which one rank is traced while
    the layout says it has more."""
    coll = frame.op_kind == COLL
    g = frame.op_group[coll]
    r = frame.op_rank_index()[coll]
    n_groups = len(frame.groups)
    pairs = np.unique(g.astype(np.int64) * max(frame.n_ranks, 1) + r)
    observed = np.bincount(pairs // max(frame.n_ranks, 1), minlength=n_groups)
    size = np.array([group_size.get(name.partition(".")[0], 0) for name in frame.groups])
    return (observed == 1) & (size > 1)


def untraced_suspects(
    frame: StepFrame,
    feats: StepFeatures,
    group_size: dict[str, int],
    stages: tuple[np.ndarray, int],
    noise: NoiseMemory,
    out: Candidates,
) -> None:
    """Add `gpu` suspects on nodes whose traced rank waits on an untraced group member."""
    if not group_size or frame.n_ops == 0:
        return
    lonely = single_member_groups(frame, group_size)
    if not lonely.any():
        return
    op_lonely = (frame.op_kind == COLL) & lonely[frame.op_group]
    ri = frame.op_rank_index()
    wait = np.bincount(ri[op_lonely], weights=frame.op_dur_ns[op_lonely] / 1e9,
                       minlength=frame.n_ranks)
    has = np.bincount(ri[op_lonely], minlength=frame.n_ranks) > 0
    keys, n_keys = stages
    ref = grouped_median(np.where(has, wait, np.nan), keys, n_keys)[keys]
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.log(wait / ref)
    x = np.where(has & np.isfinite(x), x, 0.0)
    if has.sum() < 3:
        return  # no peers to compare with
    z = x / noise.sigma("untraced", x[has], _SIGMA_FLOOR)
    # A rank that also waits longer in its p2p transfers is downstream of a slow stage: its
    # group members arrive late because they wait for the same upstream peer (propagation,
    # Holmes' upstream rule), not because one of them is slow.
    p2p = frame.op_kind == P2P
    p2p_s = np.bincount(ri[p2p], weights=frame.op_dur_ns[p2p] / 1e9, minlength=frame.n_ranks)
    p2p_ref = grouped_median(p2p_s, keys, n_keys)[keys]
    with np.errstate(divide="ignore", invalid="ignore"):
        xp = np.where(p2p_ref > 0, np.log(np.maximum(p2p_s, 1e-12) / p2p_ref), 0.0)
    zp = xp / noise.sigma("untraced_p2p", xp[p2p_ref > 0], _SIGMA_FLOOR)
    z = np.where(zp >= Z_REPORT, 0.0, z)
    best: dict[int, int] = {}  # node → rank with the strongest evidence
    for hit in np.flatnonzero(z >= Z_REPORT).tolist():
        n = int(frame.node[hit])
        if n not in best or z[hit] > z[best[n]]:
            best[n] = hit
    for n, i in best.items():
        groups = sorted({frame.groups[int(c)] for c in
                         np.unique(frame.op_group[op_lonely & (ri == i)])})
        out.add(
            f"node:{frame.nodes[n]}",
            "gpu",
            z[i],
            wait[i] - ref[i],
            f"rank {int(frame.rank[i])} waits ×{np.exp(x[i]):.2f} in {', '.join(groups[:2])} "
            "on a member that is not traced",
        )
