"""NoiseMemory: the spread each per-step value is measured against, pooled over recent steps.

A suspect's significance is its deviation from its peers divided by the noise of such
deviations. One step alone gives too few values for a stable spread (8 nodes: 8 values), so
the last `depth` steps are pooled per family ("gpu", "node", "host"); the spread is the robust
σ (`segments.robust_sigma`), so a persistent outlier among many peers does not inflate it.

>>> mem = NoiseMemory(depth=3)
>>> ids = np.arange(8)
>>> for shift in (0.0, 0.1, -0.1):
...     s = mem.sigma_each("gpu", np.array([0.0, 0.1, -0.1, 0.05, -0.05, 0.0, 0.02, 2.0]) + shift,
...                        ids, floor=0.004)
>>> float(2.0 / s[7]) > 10  # the slow rank stands out against its peers' spread
True
"""

from __future__ import annotations

from collections import deque

import numpy as np

from detectors.base import Stateful
from detectors.segments import robust_sigma, robust_sigma_rows

SMALL_GROUP = 16  # up to this many values a step, each entity is left out of its own σ
_POOL_SAMPLE = 4096  # values kept per step and family: a stable MAD needs far fewer


class NoiseMemory(Stateful):
    """Spread of each family's per-step values pooled over recent steps.

    A job with 8 nodes gives 8 values per step: their MAD alone is noisy enough to turn a
    data-dependent wobble into z > 8. Pooling the last `depth` steps gives a stable σ while
    still following slow changes; MAD keeps a persistent outlier among many peers from
    inflating it.

    Among few peers it does not: one slow rank of four is a quarter of the pool, pulls its
    median and widens its MAD, and so hides behind a σ it inflated itself (a 7× slow rank
    measured z ≈ 3.5 on an oversubscribed CPU and was never confirmed). So in groups of up
    to `SMALL_GROUP` values an entity is measured against the σ of the others' values
    (leave one out), as a peer comparison means; larger groups use the whole pool, where one
    entity's share is too small to matter and the per-entity work would not be.

    A family of one pair only (one stage of two traced ranks, nothing else to compare) has
    nobody left to leave in: its entries are judged by the median of the pool's σ over the
    last `depth` steps, which a slow rank's own residuals widen only after half of them.

    Ranks use it; nodes and hosts do not yet. Node-level wobble (MoE imbalance, data) moves
    nodes in correlated pairs, and leaving only one of a pair out turned one false `node`
    incident of `flare eval --gpus 16,32,64` into two while gaining one slow node of 27.
    """

    def __init__(self, depth: int = 10) -> None:
        self.depth = depth
        self._hist: dict[str, deque[tuple[np.ndarray, np.ndarray | None]]] = {}
        self._past_sigma: dict[str, deque[float]] = {}  # each family's pool σ, step by step

    def _remember(
        self, family: str, values: np.ndarray, ids: np.ndarray | None
    ) -> deque[tuple[np.ndarray, np.ndarray | None]]:
        h = self._hist.setdefault(family, deque(maxlen=self.depth))
        ok = np.isfinite(values)
        v = values[ok]
        i = None if ids is None else ids[ok]
        if v.size > _POOL_SAMPLE:  # plenty this step; keep the memory light
            stride = v.size // _POOL_SAMPLE + 1
            v = v[::stride]
            i = None if i is None else i[::stride]
        # Centre each step on its own median (a job-wide wobble is not noise), except when
        # it has fewer than three values: one value minus its own median is always 0, and a
        # family of lone ranks (partial tracing) would then have no spread at all.
        h.append((v - np.median(v) if v.size >= 3 else v, i))
        return h

    def sigma(self, family: str, values: np.ndarray, floor: float) -> float:
        """σ of the whole pool (for scores of an entity made of all the values)."""
        h = self._remember(family, values, None)
        return robust_sigma(np.concatenate([v for v, _ in h]), floor)

    def sigma_each(
        self, family: str, values: np.ndarray, ids: np.ndarray, floor: float,
        partners: np.ndarray | None = None,
    ) -> np.ndarray:
        """(N,) σ to measure each value against: the pool's, or in a small group the pool
        without the entries of that value's entity (`ids`: one entity id per value), nor of
        its `partners` entity (-1: none), whose value is its mirror: measured against the
        median of two, a slow rank's residual is +d and its only peer's -d, so that peer's
        entries widen the σ the slow rank is judged by as much as its own would."""
        h = self._remember(family, values, ids)
        pool = np.concatenate([v for v, _ in h])
        out = np.full(values.shape, robust_sigma(pool, floor))
        if values.size > SMALL_GROUP or pool.size == 0:
            return out
        owner = np.concatenate([np.full(v.size, -1) if i is None else i for v, i in h])
        others = owner[None, :] != ids[:, None]  # (N, pool)
        if partners is not None:
            others &= owner[None, :] != partners[:, None]
        enough = others.sum(axis=1) >= 3
        others[~enough] = True  # too few others: the whole pool
        loo = robust_sigma_rows(np.where(others, pool[None, :], np.nan), floor)
        past = self._past_sigma.setdefault(family, deque(maxlen=self.depth))
        past.append(float(out[0]))
        # With too few others the pool is the entity's own and its mirror's: once it is
        # slow, its own residuals widen the σ it is judged by, step after step (a rank at a
        # tenth of a core went from z 6 to 3 in three steps). The median of the pool's σ
        # over the last `depth` steps lags that by half of them; a fault is confirmed in
        # fewer.
        return np.where(enough, loo, float(np.median(past)))
