"""Clean noise of one step: launch gaps, jitter, data and MoE imbalance, GC and checkpoints.

Everything here is job-wide or moves between ranks, so none of it should ever become a
device incident. Draws are made in whole (K, S) blocks per stage (one RNG call per stage and
kind of noise), in an order that depends only on the layout and the step, never on the fault:
a faulty run and the clean run of the same seed see exactly the same noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from producers.simulator.costs import CostModel
from producers.simulator.scenario import Noise
from producers.simulator.topology import Topology


@dataclass
class NoiseDraw:
    gaps: list[np.ndarray]  # per stage (K, S) ns
    jit: list[np.ndarray]  # per stage (K, S)
    net: list[np.ndarray]  # per stage (K, S)
    data: np.ndarray  # (W,) per-replica data factor, broadcast to the replica's ranks
    level: float  # job-wide compute level (level shift)
    moe: np.ndarray | None  # (W,) expert load, mean 1 within each ep group
    checkpoint_ns: float


def _dirichlet_alpha(k: int, cv: float) -> float:
    """Symmetric Dirichlet concentration whose components have coefficient of variation cv.

    Var(x_i)/E(x_i)^2 = (k-1)/(k·α+1) for a k-component symmetric Dirichlet.
    """
    return max(((k - 1) / (cv * cv) - 1.0) / k, 0.05)


class NoiseSource:
    """Per-step noise of one run; create a new one (same seed) to replay the same run."""

    def __init__(
        self, noise: Noise, topo: Topology, costs: CostModel, rng: np.random.Generator
    ) -> None:
        self.noise = noise
        self.topo = topo
        self.costs = costs
        self.rng = rng
        n = noise.gc_every
        self._next_gc = self._gc_interval() if n > 0 else -1

    def _gc_interval(self) -> int:
        n = self.noise.gc_every
        return int(self.rng.integers(max(1, n // 2), n + n // 2 + 1))

    def is_train(self, step: int) -> bool:
        e = self.noise.eval_every
        return not (e > 0 and step > 0 and step % e == 0)

    def has_checkpoint(self, step: int) -> bool:
        c = self.noise.checkpoint_every
        return c > 0 and step > 0 and step % c == 0

    def draw(self, step: int, K: list[int]) -> NoiseDraw:
        nz, rng, topo = self.noise, self.rng, self.topo
        lay, S, W = topo.layout, topo.stage_size, topo.world
        lo, hi = self.costs.gap_lo_s * 1e9, self.costs.gap_hi_s * 1e9
        gaps = [rng.uniform(lo, hi, (k, S)) for k in K]
        if nz.jitter > 0:
            jit = [np.exp(rng.normal(0.0, nz.jitter, (k, S))) for k in K]
        else:
            jit = [np.ones((k, S)) for k in K]
        if nz.net_jitter > 0:
            net = [np.exp(rng.normal(0.0, nz.net_jitter, (k, S))) for k in K]
        else:
            net = [np.ones((k, S)) for k in K]
        if nz.data_jitter > 0:
            data = np.exp(rng.normal(0.0, nz.data_jitter, lay.dp))[topo.dp_of]
        else:
            data = np.ones(W)
        moe = None
        if lay.ep > 1 and nz.moe_imbalance > 0:
            g = rng.gamma(_dirichlet_alpha(lay.ep, nz.moe_imbalance), 1.0, W)
            g4 = g.reshape(lay.pp, lay.dp // lay.ep, lay.ep, lay.tp)
            g4 /= g4.mean(axis=2, keepdims=True)
            moe = g
        if step == self._next_gc:  # job-wide GC: every rank pauses at the same program point
            pause = rng.uniform(0.1, 0.5) * 1e9
            where = rng.random()
            spread = rng.uniform(0.0, 0.01e9, W)
            for s, k in enumerate(K):
                gaps[s][int(where * k)] += pause + spread[s * S : (s + 1) * S]
            self._next_gc = step + self._gc_interval()
        if nz.rank_gc_prob > 0 and rng.random() < nz.rank_gc_prob:
            r = int(rng.integers(W))
            s = r // S
            gaps[s][int(rng.integers(K[s])), r % S] += rng.uniform(0.05, 0.15) * 1e9
        ckpt = rng.uniform(2.0, 5.0) * 1e9 if self.has_checkpoint(step) else 0.0
        shift = nz.level_shift_step is not None and step >= nz.level_shift_step
        return NoiseDraw(gaps, jit, net, data, nz.level_shift if shift else 1.0, moe, ckpt)
