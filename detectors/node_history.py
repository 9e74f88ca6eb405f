"""A node alone in its pipeline stage, judged against its own past.

The compute and host views compare a rank with the other ranks of its stage in the same
step, and a node with the other nodes of its stage. A small job often has one node per stage
(16 GPUs as TP4·PP2·DP2, two nodes; a two-node pipeline): then a node's ranks are all of
their stage, a slow node slows every peer it would be compared with, and a node whose GPUs
ran ×1.5 read as a job-wide shift with no device to blame.

What is left is time. Each rank's compute (its basis, as the compute view's: compute less
routed expert kernels, or its idle gaps without compute ops) and its idle share of the step
are kept for the last `depth` steps. A node's deviation is what most of its ranks moved from
their own medians; the other nodes' deviations are what the job as a whole moved (a model,
data or batch change moves every node alike), and what is left, in units of the spread of
such residuals over the job's nodes and last `depth` steps, is the score: `node` for
compute, `host` for idle gaps. The spread is pooled: each node's own, from a handful of
steps, was a third of what a loaded machine's nodes wobble by, and paged for a node ×1.16
for three steps before any fault.

A node's own past is a weaker reference than peers in the same step: when something else
changed the step (a NIC's transfers ×500), a node's compute moves with it (the transport's
retries on a shared CPU), and its own past cannot tell. So its score counts only when no
other view names something that costs the step more.

Only nodes with at least two traced ranks are judged (one rank alone is a GPU or its node,
which `untraced_suspects` tells apart by its waits), and only in a job of at least two nodes.

What the past holds stays healthy as in `transfer_history`: a step is remembered `delay`
steps late, not at all if a node stood out in it, and the steps still waiting are dropped
while a node or host incident is open (`drop_recent`).

Two nodes, one stage each; from step 20 the ranks of node n0 compute 15 ms instead of 10:

>>> from detectors.features import step_features
>>> from detectors.peers import stage_keys
>>> from detectors.testing import frame_of, rank_step
>>> def frame(step):
...     def ops(r):
...         ms = 15.0 if r < 2 and step >= 20 else 10.0 + 0.1 * ((r + step) % 3)
...         return [("compute", "fwd", "", 0, 0.0, ms, 0)]
...     return frame_of([rank_step(r, f"n{r // 2}", step, ops(r), coords={"pp": r // 2})
...                      for r in range(4)])
>>> history = NodeHistory(delay=2)
>>> for step in range(22):
...     f = frame(step)
...     out = Candidates()
...     pace = history.observe(f, step_features(f), stage_keys(f), out)
>>> out.entity, out.kind
(['node:n0'], ['node'])
>>> out.detail[0].split(", ")[0]
'compute ×1.50 vs its own past on most of its 2 ranks'
>>> pace[:, 0].round(2).tolist()  # what its what-if prices its ranks by
[1.5, 1.5, 1.0, 1.0]
"""

from __future__ import annotations

import warnings
from collections import deque

import numpy as np

from detectors.base import Stateful
from detectors.candidates import Z_REPORT, Candidates
from detectors.evidence import WINDOW
from detectors.features import StepFeatures
from detectors.segments import grouped_majority, robust_sigma
from schemas.frame import StepFrame

_MIN_PAST = 5  # steps of its own before a rank's past is a reference
_MIN_SPREAD = 10  # node residuals before their spread is a reference
# σ floors of a node's residual: its log compute and its idle share of the step; a node's
# compute against its own past drifts more than against peers in the same step
_FLOORS = np.array([0.01, 0.005])
_KINDS = ("node", "host")


class NodeHistory(Stateful):
    """Each rank's compute and idle share, and the nodes' residuals, for the last `depth`
    steps (module docstring)."""

    def __init__(self, depth: int = 20, delay: int = WINDOW) -> None:
        self.depth = depth
        self.delay = delay
        self._ranks = _Ring(depth, 2)  # per rank id: log basis, idle share
        self._spread: deque[np.ndarray] = deque(maxlen=depth)  # per step: nodes' residuals
        self._recent: deque[tuple[np.ndarray, np.ndarray, np.ndarray]] = deque()

    def observe(self, frame: StepFrame, feats: StepFeatures, stages: tuple[np.ndarray, int],
                out: Candidates, learn: bool = True) -> np.ndarray:
        """Add this step's `node` and `host` suspects among nodes alone in their stage to
        `out`; when `learn`, remember the step once `delay` more steps have come.

        Returns (R, 2) each rank's pace against its own past for the what-if of a judged
        node: its compute ratio (as `compute_ratio` is against peers; at least 1), and the
        factor that brings its idle gaps back to their usual share of the step (at most 1);
        NaN for ranks of nodes not judged."""
        pace = np.full((frame.n_ranks, 2), np.nan)
        n_nodes = len(frame.nodes)
        alone = _alone(frame, stages) if n_nodes >= 2 else np.zeros(n_nodes, dtype=bool)
        if not alone.any():
            return pace
        value = np.column_stack([_log_basis(feats), _idle_share(feats)])
        moved = value - self._ranks.median(frame.rank)  # (R, 2) each rank from its past
        resid, job = _against_others(frame, moved)
        z = resid / self._sigma()
        if not feats.has_compute:
            z[:, 1] = np.nan  # gaps then are the compute: the basis already holds them
        judged = alone & (np.bincount(frame.node, minlength=n_nodes) >= 2)
        z[~judged] = np.nan
        flagged = np.nan_to_num(z, nan=0.0) >= Z_REPORT
        _report(frame, feats, resid, z, flagged, out)
        if learn:
            if not flagged.any():
                # a step where a node stood out is remembered for none: the others' pasts
                # would move on without it, and a job-wide shift would then show as its
                # residual, growing as it is kept out (two nodes mirror each other: a clean
                # 16-GPU run paged)
                self._recent.append((frame.rank, value, resid))
            while len(self._recent) > self.delay:
                ranks, values, resids = self._recent.popleft()
                self._ranks.add(ranks, values)
                self._spread.append(resids)
        mine = judged[frame.node]
        rank_resid = moved - job
        pace[mine, 0] = np.exp(np.maximum(rank_resid[mine, 0], 0.0))  # never faster
        usual_gap = (value[:, 1] - rank_resid[:, 1]) * feats.span_s
        with np.errstate(divide="ignore", invalid="ignore"):
            factor = np.clip(usual_gap / feats.gap_s, 0.0, 1.0)
        pace[mine, 1] = np.where(feats.gap_s[mine] > 0, factor[mine], 1.0)
        return pace

    def drop_recent(self) -> None:
        """Forget the steps not yet remembered (a node or host incident is open: they may be
        its fault's)."""
        self._recent.clear()

    def _sigma(self) -> np.ndarray:
        """(2,) the robust σ of the remembered node residuals, per feature (NaN with too
        few)."""
        pool = np.concatenate([*self._spread, np.zeros((0, 2))])
        out = np.full(2, np.nan)
        for k in range(2):
            v = pool[np.isfinite(pool[:, k]), k]
            if v.size >= _MIN_SPREAD:
                out[k] = robust_sigma(v, float(_FLOORS[k]))
        return out


class _Ring(Stateful):
    """The last `depth` values of `width` features for entities known by a row number."""

    def __init__(self, depth: int, width: int) -> None:
        self.depth = depth
        self.values = np.full((0, depth, width), np.nan)
        self.count = np.zeros(0, dtype=np.int64)

    def add(self, rows: np.ndarray, values: np.ndarray) -> None:
        if rows.size and rows.max() >= self.count.size:
            grow = int(rows.max()) + 1 - self.count.size
            self.values = np.concatenate(
                [self.values, np.full((grow, *self.values.shape[1:]), np.nan)])
            self.count = np.concatenate([self.count, np.zeros(grow, dtype=np.int64)])
        self.values[rows, self.count[rows] % self.depth] = values
        self.count[rows] += 1

    def _past(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(len(rows), depth, width) the rows' values, NaN for a feature with fewer than
        `_MIN_PAST` finite values, and a (len(rows), width) mask of the features that have."""
        past = np.full((rows.size, *self.values.shape[1:]), np.nan)
        inside = rows < self.count.size
        past[inside] = self.values[rows[inside]]
        enough = np.isfinite(past).sum(axis=1) >= _MIN_PAST
        return np.where(enough[:, None, :], past, np.nan), enough

    def median(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), width) each row's median, NaN with too little past."""
        past, enough = self._past(rows)
        out = np.full(enough.shape, np.nan)
        out[enough] = np.nanmedian(past.transpose(0, 2, 1)[enough], axis=1)
        return out


def _alone(frame: StepFrame, stages: tuple[np.ndarray, int]) -> np.ndarray:
    """(nodes,) whether each node is the only node of every stage its ranks are in."""
    keys, n_keys = stages
    pairs = np.unique(keys * len(frame.nodes) + frame.node)
    nodes_per_stage = np.bincount(pairs // len(frame.nodes), minlength=n_keys)
    shared = np.bincount(frame.node, weights=nodes_per_stage[keys] > 1,
                         minlength=len(frame.nodes))
    return shared == 0


def _against_others(frame: StepFrame, moved: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nodes, 2) each node's residual: what most of its ranks moved from their own past,
    less what the other nodes' ranks of the same data replica moved (the job's change as
    that replica's data saw it), the median over its replicas; and (R, 2) that change for
    each rank.

    Paired by replica because sequence lengths differ by replica and step: a node's traced
    ranks and the others' hold the replicas in other proportions (partial tracing), and
    their majorities then differ by the data alone (a half-traced 16-GPU job's nodes by ±5%
    for steps in a row)."""
    dp = frame.coord("dp")
    _, replica = np.unique(np.where(dp >= 0, dp, 0), return_inverse=True)
    replica = replica.reshape(-1)
    n_nodes, n_rep = len(frame.nodes), int(replica.max()) + 1 if replica.size else 1
    cell = frame.node * n_rep + replica
    resid = np.full((n_nodes, 2), np.nan)
    job = np.full(moved.shape, np.nan)
    not_me = np.eye(n_nodes, dtype=bool)[:, :, None]
    for k in range(2):
        ok = np.isfinite(moved[:, k])
        c = grouped_majority(moved[ok, k], cell[ok], n_nodes * n_rep).reshape(n_nodes, n_rep)
        with warnings.catch_warnings():  # a replica no other node holds: NaN, said here
            warnings.simplefilter("ignore", RuntimeWarning)
            others = np.nanmedian(np.where(not_me, np.nan, c[None, :, :]), axis=1)
            resid[:, k] = np.nanmedian(c - others, axis=1)
        job[:, k] = others[frame.node, replica]
    return resid, job


def _log_basis(feats: StepFeatures) -> np.ndarray:
    """(R,) log of the time a rank's speed is judged by (the compute view's basis)."""
    basis = feats.compute_s - feats.routed_s if feats.has_compute else feats.gap_s
    with np.errstate(divide="ignore"):
        return np.where(basis > 0, np.log(np.maximum(basis, 1e-12)), np.nan)


def _idle_share(feats: StepFeatures) -> np.ndarray:
    """(R,) a rank's idle gaps as a share of its step span."""
    return np.where(feats.span_s > 0, feats.gap_s / np.maximum(feats.span_s, 1e-12), np.nan)


def _report(frame: StepFrame, feats: StepFeatures, resid: np.ndarray, z: np.ndarray,
            flagged: np.ndarray, out: Candidates) -> None:
    """Add the flagged nodes to `out`, but for those whose excess another view's suspect in
    the same step exceeds (module docstring: then the step changed under them)."""
    span = np.nanmedian(feats.span_s) if feats.span_s.size else 0.0
    others = max((x for x, zz in zip(out.excess_s, out.z, strict=True) if zz >= Z_REPORT),
                 default=0.0)
    basis = np.exp(np.nan_to_num(_log_basis(feats), nan=-np.inf))
    for n, k in zip(*np.nonzero(flagged), strict=True):
        mine = frame.node == n
        if k == 0:
            excess = float(np.median(basis[mine])) * (1 - np.exp(-resid[n, 0]))
            detail = (f"compute ×{np.exp(resid[n, 0]):.2f} vs its own past on most of its "
                      f"{int(mine.sum())} ranks, the other nodes' unchanged; it is its "
                      "stage's only node")
        else:
            excess = float(resid[n, 1] * span)
            detail = (f"idle gaps +{excess * 1e3:.0f} ms per rank (vs its own past: it is its "
                      "stage's only node; the other nodes' unchanged)")
        if excess > others:
            out.add(f"node:{frame.nodes[n]}", _KINDS[k], float(z[n, k]), excess, detail)
