"""Compute suspects: a GPU (rank) or a whole node that computes slower than its peers.

Each rank's compute time is compared with its stage peers in the SAME step (`compute_ratio`),
so job-wide effects (GC, checkpoints, level shifts, data) cancel. In log space the node's
median ratio is split off first, so one slow GPU and a slow node (all its GPUs) are told
apart: a slow GPU stands out from the other GPUs of its node or tensor-parallel replica, a
slow node from the other nodes.

A 4-rank step, two ranks per node, where rank 2 computes 40 ms instead of 10 ms:

>>> from detectors.features import step_features
>>> from detectors.noise import NoiseMemory
>>> from detectors.peers import stage_keys
>>> from detectors.testing import frame_of, rank_step
>>> frame = frame_of([
...     rank_step(r, f"n{r // 2}", 0, [("compute", "fwd", "", 0, 0.0, 40.0 if r == 2 else 10.0, 0)])
...     for r in range(4)
... ])
>>> feats = step_features(frame)
>>> ratio = compute_ratio(frame, feats, stage_keys(frame))
>>> ratio.tolist()
[1.0, 1.0, 4.0, 1.0]
>>> out = Candidates()
>>> compute_suspects(frame, feats, ratio, NoiseMemory(), out)
>>> out.entity, out.kind, out.detail
(['rank:2'], ['gpu'], ['compute ×4.00 vs stage peers'])
"""

from __future__ import annotations

import numpy as np

from detectors.candidates import Z_REPORT, Candidates
from detectors.features import StepFeatures
from detectors.noise import NoiseMemory
from detectors.peers import replica_keys
from detectors.segments import grouped_majority, grouped_median
from schemas.frame import StepFrame

# σ floors of log compute ratios (0.4% for a rank, 0.6% for a node's median): identical
# ranks (a noiseless calibration run, a deterministic kernel) give σ = 0, and a difference of
# a few microseconds would then be infinitely significant. Set with the detection core and
# kept by every `flare eval` run since (ACCURACY.md).
_GPU_SIGMA_FLOOR = 0.004
_NODE_SIGMA_FLOOR = 0.006


def _basis(feats: StepFeatures) -> np.ndarray:
    """(R,) the time a rank's speed is judged by: its compute less the expert kernels whose
    amount MoE routing sets (a slow GPU slows the rest alike), or, without compute ops, its
    idle gaps."""
    return feats.compute_s - feats.routed_s if feats.has_compute else feats.gap_s


def compute_ratio(
    frame: StepFrame, feats: StepFeatures, stages: tuple[np.ndarray, int]
) -> np.ndarray:
    """(R,) compute time vs the median of the rank's stage peers (1.0 = like its peers).

    Communication-only recordings have no compute ops: the idle gaps between their
    collectives are then the compute, and serve as its basis."""
    basis = _basis(feats)
    keys, n_keys = stages
    ref = grouped_median(basis, keys, n_keys)[keys]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ref > 0, basis / ref, np.nan)


def compute_suspects(
    frame: StepFrame, feats: StepFeatures, ratio: np.ndarray, noise: NoiseMemory, out: Candidates,
    stages: tuple[np.ndarray, int] | None = None,
) -> None:
    """Add the step's `gpu` (rank) and `node` suspects to `out`."""
    basis = _basis(feats)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.log(ratio)
    x = np.where(np.isfinite(x), x, 0.0)
    n_nodes = len(frame.nodes)
    counts = np.bincount(frame.node, minlength=n_nodes)
    node_x = np.nan_to_num(grouped_median(x, frame.node, n_nodes))
    per_node = counts[frame.node]
    # a rank with neither a replica nor a node to compare with is measured against its stage,
    # less the part its data replica shows in every stage (sequence lengths), as the node is
    data = _data_share(frame, x)
    g = np.where(per_node >= 3, x - node_x[frame.node], x - data)
    reference = np.where(per_node >= 3, 1, 2)  # what each residual is measured from
    rep = replica_keys(frame)
    if rep is not None:
        keys, n_rep = rep
        size = np.bincount(keys, minlength=n_rep)[keys]
        rep_x = grouped_median(x, keys, n_rep)[keys]
        # a pair's median is its mean: the slow member's residual is +d/2 and its partner's
        # -d/2, so with fewer than three pairs half of all residuals carry the fault and the
        # spread estimate breaks down; then the node is the better reference
        usable = (size >= 3) | ((size == 2) & (n_rep >= 3))
        g = np.where(usable, x - rep_x, g)
        reference = np.where(usable, 0, reference)
    # Each reference has its own noise: a replica cancels data-dependent jitter, a node or
    # the stage does not. With partial tracing some ranks lose their replica; judged by the
    # replicas' tight spread, their ordinary data jitter would look like a slow GPU.
    zg = np.zeros_like(g)
    partner = _pair_partners(frame, stages)  # a stage of two: each is the other's mirror
    for ref_kind in np.unique(reference).tolist():
        m = reference == ref_kind
        family = ("gpu", "gpu_vs_node", "gpu_vs_stage")[ref_kind]
        zg[m] = g[m] / noise.sigma_each(family, g[m], frame.rank[m], _GPU_SIGMA_FLOOR,
                                        partner[m] if ref_kind == 2 else None)
    for i in np.flatnonzero(zg >= Z_REPORT):
        out.add(
            f"rank:{int(frame.rank[i])}",
            "gpu",
            zg[i],
            basis[i] * (1 - np.exp(-g[i])),
            f"compute ×{np.exp(x[i]):.2f} vs stage peers",
        )
    multi = counts >= 2
    if multi.sum() >= 3:
        # a node is slow when most of its ranks are: one slow GPU of two is that GPU
        node_x = np.nan_to_num(grouped_majority(x - data, frame.node, n_nodes))
        sn = noise.sigma("node", node_x[multi], _NODE_SIGMA_FLOOR)
        zn = np.where(multi, node_x / sn, 0.0)
        node_basis = grouped_median(basis, frame.node, n_nodes)
        for n in np.flatnonzero(zn >= Z_REPORT):
            out.add(
                f"node:{frame.nodes[n]}",
                "node",
                zn[n],
                node_basis[n] * (1 - np.exp(-node_x[n])),
                f"compute ×{np.exp(node_x[n]):.2f} vs stage peers on "
                f"{'all' if counts[n] <= 2 else 'most'} of its {counts[n]} ranks",
            )


def _pair_partners(frame: StepFrame, stages: tuple[np.ndarray, int] | None) -> np.ndarray:
    """(R,) the rank id of each rank's only stage peer, -1 when its stage has more or fewer.

    Two traced ranks a stage is what tracing one rank per node gives a small job (a drill
    of four nodes in two stages): a throttled rank's evidence faded within six steps as its
    peer's mirrored residuals filled the noise memory.
    """
    partner = np.full(frame.n_ranks, -1, dtype=np.int64)
    if stages is None:
        return partner
    keys, n_keys = stages
    size = np.bincount(keys, minlength=n_keys)
    for k in np.flatnonzero(size == 2).tolist():
        a, b = np.flatnonzero(keys == k).tolist()
        partner[a], partner[b] = frame.rank[b], frame.rank[a]
    return partner


def _data_share(frame: StepFrame, x: np.ndarray) -> np.ndarray:
    """(R,) the part of each rank's log compute ratio its data replica explains.

    Sequence lengths differ between data-parallel replicas (and some replicas stay heavier):
    every pipeline stage of a replica then computes longer by the same factor, while a slow
    node slows only its own stage. The median over a replica's ranks in all stages is that
    data factor; with fewer than three stages a slow node would be too much of that median,
    so nothing is removed.
    """
    pp, dp = frame.coord("pp"), frame.coord("dp")
    if frame.n_ranks == 0 or (pp < 0).any() or (dp < 0).any() or np.unique(pp).size < 3:
        return np.zeros_like(x)
    uniq, inv = np.unique(dp, return_inverse=True)
    return grouped_median(x, inv.astype(np.int64), int(uniq.size))[inv]
