"""Real-training conditions that are not faults: who is traced, and workload imbalance.

Production recordings differ from a kind simulation in ways that must not look like faults
(DESIGN §4.8): only some ranks report, and the work itself is uneven (sequence lengths that
move between DP replicas every step, a last pipeline stage that is heavier by design). Both
are drawn from their own random streams, so turning a condition on changes nothing else about
the run: the same seed keeps the same noise, fault target and fault randomness.
"""

from __future__ import annotations

import numpy as np

from producers.simulator.scenario import Scenario
from producers.simulator.topology import Topology

HEAVY_REPLICA_SHARE = 8  # one replica in this many (at least one) is persistently heavier


def traced_mask(traced: str, topo: Topology, rng: np.random.Generator) -> np.ndarray | None:
    """(world,) bool: the ranks that report, or None when every rank does.

    A ValueError says why a subset cannot exist on the layout (one node cannot go dark: no
    rank would be left to report).
    """
    if traced == "all":
        return None
    if traced == "tp0":
        return topo.tp_of == 0
    if traced == "half":
        mask = np.zeros(topo.world, dtype=bool)
        mask[rng.permutation(topo.world)[: max(1, topo.world // 2)]] = True
        return mask
    if traced == "node_dark":
        if topo.n_nodes < 2:
            raise ValueError("traced='node_dark' needs at least 2 nodes (one goes dark)")
        return topo.node_of != int(rng.integers(topo.n_nodes))
    raise ValueError(f"unknown traced subset {traced!r}")


def stage_factor(scenario: Scenario, topo: Topology) -> np.ndarray | None:
    """(world,) compute multiplier of the last pipeline stage's design imbalance, or None."""
    if scenario.stage_imbalance == 1.0:
        return None
    f = np.ones(topo.world)
    f[topo.pp_of == topo.layout.pp - 1] = scenario.stage_imbalance
    return f


class Workload:
    """Per-step compute multipliers of workload imbalance (None when there is none).

    Sequence-length imbalance acts on whole DP replicas (every rank of a replica, on every
    pipeline stage, processes the same samples): a lognormal factor of mean 1 drawn anew
    every step, times a persistent factor of the heavier replicas. Create a new one (same
    rng seed) to replay the same run.
    """

    def __init__(self, scenario: Scenario, topo: Topology, rng: np.random.Generator) -> None:
        self.topo = topo
        self.rng = rng
        self.sigma = float(scenario.seq_imbalance)
        base = stage_factor(scenario, topo)
        dp = topo.layout.dp
        if self.sigma > 0 and dp > 1:
            n_heavy = max(1, dp // HEAVY_REPLICA_SHARE)
            heavy = rng.choice(dp, n_heavy, replace=False)
            rep = np.ones(dp)
            rep[heavy] = 1.0 + self.sigma * rng.uniform(0.5, 1.0, n_heavy)
            per_rank = rep[topo.dp_of]
            base = per_rank if base is None else base * per_rank
        else:
            self.sigma = 0.0  # one replica: nothing to be imbalanced against
        self.base = base

    def factor(self) -> np.ndarray | None:
        """The next step's (world,) multiplier of data-dependent compute."""
        if self.sigma == 0.0:
            return self.base
        s = self.sigma
        draw = np.exp(self.rng.normal(-0.5 * s * s, s, self.topo.layout.dp))[self.topo.dp_of]
        return draw if self.base is None else self.base * draw
