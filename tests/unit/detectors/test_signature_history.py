"""A kind of transfer slow as a whole: a fault its step's comparison cancels, or the job's own.

Four traced ranks of an eight-rank job (PP2·DP4, half the ranks not traced), one per node:
stage 0 on n0 and n1 under leaf switch a, stage 1 on n2 and n3 under b. Each step runs two
pipeline transfers per pair (n0 → n2, n1 → n3), whose both ends are traced, and each stage's
data-parallel all-reduces, of which half the members are traced.
"""

from __future__ import annotations

import numpy as np

from detectors.diagnoser import JobDiagnoser
from detectors.testing import frame_of, rank_step
from schemas.wire import JobV1, Layout, NodeInfo

NODES = ("n0", "n1", "n2", "n3")
SWITCH = {"n0": "a", "n1": "a", "n2": "b", "n3": "b"}
PP = {0: (0, 2), 1: (1, 3)}  # pipeline pair → traced (sender, receiver)
DP = {0: (0, 1), 1: (2, 3)}  # stage → its traced data-parallel members


def _step(s: int, rng: np.random.Generator, slow: set[str], factor: float):
    """One step; the transfers of each kind in `slow` ("pp", "dp.0", "dp.1") take
    `factor` × their usual."""
    ops: dict[int, list] = {r: [("compute", "fwd", "", 0, 0.0, 100.0, 0)] for r in range(4)}
    for p, (a, b) in PP.items():
        for m in range(2):
            ms = 10.0 * (factor if "pp" in slow else 1.0) * rng.lognormal(0, 0.03)
            start = 100.0 + 30.0 * m + p
            ops[a].append(("p2p", "send", f"pp.{p}", 2 * s + m, start, ms, 1 << 16))
            ops[b].append(("p2p", "recv", f"pp.{p}", 2 * s + m, start, ms, 1 << 16))
    for stage, members in DP.items():
        for k in range(3):
            ms = 20.0 * (factor if f"dp.{stage}" in slow else 1.0) * rng.lognormal(0, 0.03)
            for r in members:
                ops[r].append(("coll", "all_reduce", f"dp.{stage}", 3 * s + k,
                               200.0 + 80.0 * k, ms, 1 << 20))
    t0 = 10**18 + s * 10**9
    coords = [{"pp": 0, "dp": 0}, {"pp": 0, "dp": 1}, {"pp": 1, "dp": 0}, {"pp": 1, "dp": 1}]
    return frame_of([rank_step(r, NODES[r], s, ops[r], t0_ns=t0, coords=coords[r])
                     for r in range(4)])


def _incidents(slow: set[str], factor: float = 3.0, onset: int = 30, steps: int = 50):
    diag = JobDiagnoser("j")
    diag.on_job(JobV1(v=1, job="j", event="start", ts_ns=10**18, world_size=8,
                      layout=Layout(tp=1, pp=2, dp=4),
                      nodes=[NodeInfo(n, SWITCH[n]) for n in NODES]))
    rng = np.random.default_rng(7)
    found = []
    for s in range(steps):
        out = diag.on_frame(_step(s, rng, slow if s >= onset else set(), factor))
        found += [(i.kind, i.culprit) for i in out.incidents]
    return list(dict.fromkeys(found))


def test_a_switch_that_slows_every_pipeline_transfer_is_named():
    """Leaf a congested: every pipeline transfer crosses it, so they are ×3 their usual and
    ×1.0 each other's. As fully traced transfers on time they cleared a, whose other
    evidence (its stage's all-reduces) is only partly traced: nothing was named."""
    assert _incidents({"pp", "dp.0"}) == [("switch", "switch:a")]


def test_every_transfer_slower_names_no_network_entity():
    """The whole job's transfers ×3 (a fabric-wide slowdown, or a job-wide change): no
    entity is slower than the transfers that do not touch it."""
    kinds = {k for k, _ in _incidents({"pp", "dp.0", "dp.1"})}
    assert not kinds & {"link", "switch"}, kinds
