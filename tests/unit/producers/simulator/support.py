"""Small scenarios and views of a run shared by the simulator tests (not a test module)."""

from __future__ import annotations

import numpy as np

from producers.simulator import ClusterSimulator, Layout, Noise, Scenario
from producers.simulator.simulator import EPOCH_NS
from schemas.frame import StepFrame
from schemas.wire import HeartbeatV1

# 16 ranks, 4 per node, 2 nodes per leaf: tp groups inside a node, dp / ep / pp across nodes
SMALL = Layout(tp=2, pp=2, dp=4, ep=2, gpus_per_node=4, nodes_per_switch=2)

BUSY_NOISE = Noise(gc_every=3, rank_gc_prob=0.5, checkpoint_every=4, eval_every=5,
                   level_shift_step=3)  # fmt: skip


def scenario(layout=SMALL, steps=4, seed=7, fault=None, noise=None, **kw) -> Scenario:
    return Scenario(job="job-a", layout=layout, steps=steps, seed=seed, fault=fault,
                    noise=noise if noise is not None else Noise(), **kw)  # fmt: skip


def frames(sim: ClusterSimulator) -> list[StepFrame]:
    return [x for x in sim.run() if isinstance(x, StepFrame)]


def heartbeats(sim: ClusterSimulator) -> list[HeartbeatV1]:
    return [x for x in sim.run() if isinstance(x, HeartbeatV1)]


def true_ops(sim: ClusterSimulator, f: StepFrame) -> dict[str, np.ndarray]:
    """Per op: rank, true start and end (node clock offsets removed)."""
    ri = f.op_rank_index()
    base = f.t_start_ns - EPOCH_NS - sim.clocks.skew_ns[f.node]
    start = base[ri] + f.op_start_ns
    return {"rank": f.rank[ri], "start": start, "end": start + f.op_dur_ns}

