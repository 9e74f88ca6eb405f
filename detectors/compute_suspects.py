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

from collections import deque

import numpy as np

from detectors.base import Stateful
from detectors.candidates import Z_REPORT, Candidates
from detectors.evidence import WINDOW
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
_MIN_GAPS = 5  # remembered steps before the stages' usual gap is a reference
_MIN_LEANS = 40  # replicas' pairs of leans seen before the stages' data link is read


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
    stages: tuple[np.ndarray, int] | None = None, two_stages: TwoStages | None = None,
) -> None:
    """Add the step's `gpu` (rank) and `node` suspects to `out`; `two_stages`, the job's
    memory of its two stages, learns this step."""
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
    data, node_data, gap_now = _data_share(frame, x, basis, two_stages)
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
        # and a pair's residual says that one of the two differs, not which: the member
        # whose node or stage says it computes no slower is not the one (a drill's rank
        # whose TP partner got a core to itself and ran 5x faster read +80% vs the pair)
        g = np.where(usable, np.where(size == 2, np.minimum(x - rep_x, g), x - rep_x), g)
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
    stood_out = False
    if multi.sum() >= 3:
        # a node is slow when most of its ranks are: one slow GPU of two is that GPU
        node_x = np.nan_to_num(grouped_majority(x - node_data, frame.node, n_nodes))
        sn = noise.sigma("node", node_x[multi], _NODE_SIGMA_FLOOR)
        zn = np.where(multi, node_x / sn, 0.0)
        node_basis = grouped_median(basis, frame.node, n_nodes)
        stood_out = bool((zn >= Z_REPORT).any())
        for n in np.flatnonzero(zn >= Z_REPORT):
            out.add(
                f"node:{frame.nodes[n]}",
                "node",
                zn[n],
                node_basis[n] * (1 - np.exp(-node_x[n])),
                f"compute ×{np.exp(node_x[n]):.2f} vs stage peers on "
                f"{'all' if counts[n] <= 2 else 'most'} of its {counts[n]} ranks",
            )
    if two_stages is not None:
        two_stages.add(gap_now, stood_out)


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


def _data_share(frame: StepFrame, x: np.ndarray, basis: np.ndarray,
                two_stages: TwoStages | None) -> tuple[np.ndarray, np.ndarray, float]:
    """(R,) the part of each rank's log compute ratio its data replica explains, for the
    rank itself and for its node's majority; and, in a job of two stages, the step's log
    compute gap between them (NaN otherwise).

    Sequence lengths differ between data-parallel replicas (and some replicas stay heavier):
    every pipeline stage of a replica then computes longer by the same factor, while a slow
    node slows only its own stage. With three stages or more, the median over a replica's
    ranks in all stages is that data factor. With two, a slow node would be half of that
    median: each rank is compared with its replica's ranks in the other stage instead, less
    the two stages' usual gap (`TwoStages`). Not this step's gap: when a slow node holds half
    of a stage's replicas, the median gap is half its slowness, and half would show as a
    healthy node's of the other stage. That pairing is for nodes only: a rank judged alone
    (one traced per tensor-parallel group) is a slow node's as much as its GPU's, and its
    node mates would each read as a slow GPU; the node view, or the node's own past, names
    the node. A rank loses only what its replica shows in both stages (`_shared`), as far as
    the job's replicas lean alike in both (`TwoStages.data_link`, which learns the step's
    leans here). Nothing is removed with one stage (nothing tells data from node), or when a
    node holds ranks of both stages (its slowness would cancel).
    """
    pp, dp = frame.coord("pp"), frame.coord("dp")
    none = np.zeros_like(x)
    if frame.n_ranks == 0 or (pp < 0).any() or (dp < 0).any():
        return none, none, np.nan
    stages, stage = np.unique(pp, return_inverse=True)
    uniq, inv = np.unique(dp, return_inverse=True)
    inv = inv.astype(np.int64)
    if stages.size >= 3:
        data = grouped_median(x, inv, int(uniq.size))[inv]
        return data, data, np.nan
    if stages.size < 2 or _spans_both(frame.node, stage, len(frame.nodes)):
        return none, none, np.nan
    with np.errstate(divide="ignore"):
        y = np.where(basis > 0, np.log(np.maximum(basis, 1e-12)), np.nan)
    cells = grouped_median(y, inv * 2 + stage, 2 * int(uniq.size)).reshape(-1, 2)
    if np.isnan(cells[inv, 1 - stage]).any():
        # a replica with no traced rank in the other stage (a node's agent down): its
        # ranks would keep the data's noise while the paired ones lose it, and judged
        # by the paired ones' spread, that noise reads as a slow node
        return none, none, np.nan
    diff = cells[:, 0] - cells[:, 1]
    now = float(np.median(diff[np.isfinite(diff)])) if np.isfinite(diff).any() else np.nan
    usual = two_stages.usual_gap() if two_stages is not None else np.nan
    c = usual if np.isfinite(usual) else now
    resid = y - cells[inv, 1 - stage] - np.where(stage == 0, c, -c)
    lean = grouped_median(x, inv * 2 + stage, 2 * int(uniq.size)).reshape(-1, 2)
    link = 0.0
    if two_stages is not None:
        two_stages.add_lean(lean)
        link = two_stages.data_link()
    rank_data = link * _shared(lean)[inv]
    return rank_data, np.where(np.isfinite(resid), x - resid, 0.0), now


def _shared(lean: np.ndarray) -> np.ndarray:
    """(N,) the part of each data replica's log compute ratio (`lean`: (N, 2), its ranks'
    median in each of two stages) that it shows in both: the smaller of the two when they
    lean the same way, else nothing.

    A slow GPU or node slows one stage of its replica, and its partner in the other stage
    keeps its peers' pace, so next to it nothing is shared; a heavier replica computes
    longer in both. Only what both stages show is taken off, so a rank judged alone keeps
    its own excess (unlike the node's pairing, which would read a slow node's every traced
    rank as a slow GPU).

    >>> _shared(np.array([[0.04, 0.04], [0.5, 0.01], [0.3, -0.2]])).tolist()
    [0.04, 0.01, 0.0]
    """
    sign = np.sign(lean[:, 0])
    both = (sign == np.sign(lean[:, 1])) & np.isfinite(lean).all(axis=1)
    return np.where(both, sign * np.abs(lean).min(axis=1), 0.0)


def _spans_both(node: np.ndarray, stage: np.ndarray, n_nodes: int) -> bool:
    """Whether some node holds ranks of both of two stages (`stage` 0 or 1)."""
    seen = np.zeros((n_nodes, 2), dtype=bool)
    seen[node, stage] = True
    return bool(seen.all(axis=1).any())


class TwoStages(Stateful):
    """A two-stage job's memory of its stages' compute: their usual log gap, and how far a
    data replica's lean (its ranks' log compute ratio against their stage) in one stage
    goes with its lean in the other.

    The gap (stage 0 less stage 1, per data replica, the median) is the stages' work by
    design, which the data and a job-wide change move alike in both. It is the median of the
    last `depth` steps in which no node stood out, each remembered `delay` steps late and not
    at all while any incident is open (`drop_recent`: a NIC's retries can move one stage's
    compute), as `NodeHistory` keeps its past.

    >>> two = TwoStages(delay=1)
    >>> for g in (0.40, 0.41, 0.39, 0.40, 0.42, 0.40, 0.90):
    ...     two.add(g, stood_out=False)
    >>> round(two.usual_gap(), 2)  # the last step is not remembered yet
    0.4

    The link is what sets a replica's data apart from a slow device: under sequence lengths
    a heavier replica leans the same way in both stages, step after step. A job whose
    replicas' stages lean independently (each rank's own jitter, a real batch whose cost
    falls on one stage) has nothing shared to take off, and taking off whichever part of
    its noise happened to agree would leave the rest judged by a spread too narrow for it
    (a drill's healthy rank 0 paged). The link is the correlation of the two leans read from
    how often their signs agree (for Gaussian leans, P(agree) = 1/2 + arcsin(ρ)/π), which one
    stalled rank cannot sway; 0 when they agree no more often than chance.

    >>> rng = np.random.default_rng(0)
    >>> data = rng.normal(0, 0.05, (40, 4))
    >>> alike, apart = TwoStages(), TwoStages()
    >>> for d in data:
    ...     alike.add_lean(np.stack([d, d + rng.normal(0, 0.01, 4)], axis=1))
    ...     apart.add_lean(rng.normal(0, 0.05, (4, 2)))
    >>> round(alike.data_link(), 1), apart.data_link() < 0.3
    (1.0, True)
    """

    def __init__(self, depth: int = 20, delay: int = WINDOW, link_depth: int = 50) -> None:
        self.delay = delay
        self._past: deque[float] = deque(maxlen=depth)
        self._recent: deque[float] = deque()
        self._agree: deque[tuple[int, int]] = deque(maxlen=link_depth)  # per step: agreed, pairs

    def usual_gap(self) -> float:
        """The remembered steps' median gap; NaN with fewer than `_MIN_GAPS`."""
        return float(np.median(self._past)) if len(self._past) >= _MIN_GAPS else np.nan

    def add(self, gap: float, stood_out: bool) -> None:
        """This step's gap, unless a node stood out in it (it may be the node's)."""
        if np.isfinite(gap) and not stood_out:
            self._recent.append(gap)
        while len(self._recent) > self.delay:
            self._past.append(self._recent.popleft())

    def drop_recent(self) -> None:
        """Forget the steps not yet remembered (they may be an open incident's)."""
        self._recent.clear()

    def add_lean(self, lean: np.ndarray) -> None:
        """This step's (N, 2) leans of each data replica in the two stages."""
        both = np.isfinite(lean).all(axis=1) & (lean != 0).all(axis=1)
        sign = np.sign(lean[both])
        self._agree.append((int((sign[:, 0] == sign[:, 1]).sum()), int(both.sum())))

    def data_link(self) -> float:
        """The leans' correlation in [0, 1]; 0 with fewer than `_MIN_LEANS` pairs seen."""
        agreed = sum(a for a, _ in self._agree)
        pairs = sum(n for _, n in self._agree)
        if pairs < _MIN_LEANS:
            return 0.0
        return max(0.0, float(np.sin(np.pi * (agreed / pairs - 0.5))))
