"""A node alone in its pipeline stage, against its own past (`detectors/node_history.py`),
and what the diagnoser makes of it."""

from __future__ import annotations

import numpy as np

from detectors.candidates import Candidates
from detectors.diagnoser import JobDiagnoser
from detectors.features import step_features
from detectors.node_history import NodeHistory
from detectors.peers import stage_keys
from detectors.testing import frame_of, rank_step
from schemas.frame import StepFrame

RANKS_PER_NODE = 4


def _step(step: int, nodes: int = 2, compute: dict[int, float] | None = None,
          idle: dict[int, float] | None = None, job: float = 1.0, stages: int | None = None,
          traced: int = RANKS_PER_NODE, comm_only: bool = False) -> StepFrame:
    """`nodes` nodes of `RANKS_PER_NODE` ranks; node n is pipeline stage n (or n % `stages`).
    Each rank computes 10 ms (× `job`, × `compute[node]`), idles `idle[node]` ms, then
    all-reduces with its node's ranks. A little jitter by rank and step."""
    compute, idle = compute or {}, idle or {}
    msgs = []
    for n in range(nodes):
        for local in range(traced):
            r = n * RANKS_PER_NODE + local
            jitter = 1.0 + 0.01 * ((r * 7 + step * 3) % 5 - 2)
            ms = 10.0 * job * compute.get(n, 1.0) * jitter
            gap = idle.get(n, 0.0) + 0.2 * jitter
            ops = [] if comm_only else [("compute", "fwd", "", 0, 0.0, ms, 0)]
            ops.append(("coll", "all_reduce", f"tp.{n}", step, ms + gap, 1.0, 1 << 20))
            msgs.append(rank_step(r, f"n{n}", step, ops,
                                  coords={"pp": n % (stages or nodes), "tp": local, "dp": 0}))
    return frame_of(msgs)


def _run(history: NodeHistory, steps: range, **kw: object) -> list[Candidates]:
    outs = []
    for s in steps:
        frame = _step(s, **kw)  # type: ignore[arg-type]
        out = Candidates()
        history.observe(frame, step_features(frame), stage_keys(frame), out)
        outs.append(out)
    return outs


def _named(outs: list[Candidates]) -> set[tuple[str, str]]:
    return {(k, e) for out in outs for k, e in zip(out.kind, out.entity, strict=True)}


def test_a_slow_node_alone_in_its_stage_is_named_and_stays_named():
    """Its slow steps never become its usual: 40 steps on, it is still ×1.3."""
    history = NodeHistory()
    assert _named(_run(history, range(25))) == set()
    outs = _run(history, range(25, 65), compute={1: 1.3})
    assert all(out.entity == ["node:n1"] and out.kind == ["node"] for out in outs)
    assert abs(float(outs[-1].detail[0].split("×")[1].split()[0]) - 1.3) < 0.03


def test_three_stages_one_node_each():
    history = NodeHistory()
    _run(history, range(25), nodes=3)
    outs = _run(history, range(25, 30), nodes=3, compute={0: 1.2})
    assert _named(outs) == {("node", "node:n0")}


def test_the_whole_job_changing_is_no_node_fault():
    """A model or batch change moves every node alike: the other nodes' move cancels it."""
    history = NodeHistory()
    _run(history, range(25))
    assert _named(_run(history, range(25, 45), job=1.4)) == set()


def test_a_starved_host_shows_in_its_idle_gaps():
    history = NodeHistory()
    _run(history, range(25))
    outs = _run(history, range(25, 30), idle={0: 3.0})
    assert _named(outs) == {("host", "node:n0")}


def test_without_compute_ops_the_gaps_are_the_compute_and_no_host_is_said():
    history = NodeHistory()
    _run(history, range(25), comm_only=True)
    outs = _run(history, range(25, 30), comm_only=True, idle={0: 3.0})
    assert _named(outs) == {("node", "node:n0")}


def test_nodes_with_stage_peers_are_left_to_the_peer_views():
    """Four nodes in two stages: each node has a peer node, so its own past says nothing."""
    history = NodeHistory()
    _run(history, range(25), nodes=4, stages=2)
    assert _named(_run(history, range(25, 35), nodes=4, stages=2, compute={1: 1.5})) == set()


def test_a_node_with_one_traced_rank_is_not_judged():
    """One rank is a GPU or its node; the views of untraced members tell which."""
    history = NodeHistory()
    _run(history, range(25), traced=1)
    assert _named(_run(history, range(25, 35), traced=1, compute={1: 1.5})) == set()


def test_the_steps_not_yet_remembered_are_dropped_while_an_incident_is_open():
    """A fault's first steps come before its incident opens (below the bar then): dropped,
    they never become the node's usual."""
    history = NodeHistory(delay=5)
    _run(history, range(25))
    _run(history, range(25, 28), compute={1: 1.03})
    history.drop_recent()
    _run(history, range(28, 40))
    healthy_top = np.log(0.010 * 1.02)  # 10 ms at the jitter's most
    assert np.nanmax(history._ranks.values[4:8, :, 0]) <= healthy_top + 1e-9
    kept = NodeHistory(delay=5)  # the same steps, nothing dropped: they are remembered
    _run(kept, range(25))
    _run(kept, range(25, 28), compute={1: 1.03})
    _run(kept, range(28, 40))
    assert np.nanmax(kept._ranks.values[4:8, :, 0]) > healthy_top


def test_the_diagnoser_opens_one_node_incident_priced_by_the_node_own_past():
    """A two-node pipeline whose second node computes ×1.5: one `node` incident, not a
    job-wide shift, and its cost is the job's, from the node's own past (its stage has no
    other node to price it by)."""
    d = JobDiagnoser("j")
    incidents = []
    for s in range(45):
        frame = _pipeline(s, slow=1.5 if s >= 30 else 1.0)
        incidents += d.on_frame(frame).incidents
    opened = {(i.kind, i.culprit) for i in incidents}
    assert opened == {("node", "node:n1")}
    last = [i for i in incidents if i.culprit == "node:n1"][-1]
    assert last.opened_step <= 33
    # stage 1's 40 ms at ×1.5 stretch an 82 ms step to 102 (stage 0's span) and stage 1's
    # own span from 62 to 82 ms: the job's step, their median, ×1.24-1.32
    assert 1.2 < last.slowdown < 1.35


def _pipeline(step: int, slow: float) -> StepFrame:
    """Two nodes, one stage each, four ranks a stage: stage 0 computes 20 ms forward, sends
    to stage 1, which computes 40 ms (× `slow`) and sends back; stage 0 then computes 20 ms
    backward."""
    msgs = []
    for r in range(8):
        n, local = divmod(r, 4)
        jitter = 1.0 + 0.01 * ((r * 7 + step * 3) % 5 - 2)
        c1 = 40.0 * slow * jitter
        back = 22.0 + c1  # when stage 1's send back ends
        if n == 0:
            ops = [("compute", "fwd", "", 0, 0.0, 20.0 * jitter, 0),
                   ("p2p", "send", f"pp.{local}", 1, 20.0 * jitter, 1.0, 1 << 20),
                   ("p2p", "recv", f"pp.{local}", 2, 21.0 * jitter, back - 21.0 * jitter,
                    1 << 20),
                   ("compute", "bwd", "", 3, back, 20.0 * jitter, 0)]
        else:
            ops = [("p2p", "recv", f"pp.{local}", 1, 0.0, 21.0, 1 << 20),
                   ("compute", "fwd", "", 2, 21.0, c1, 0),
                   ("p2p", "send", f"pp.{local}", 2, 21.0 + c1, 1.0, 1 << 20)]
        msgs.append(rank_step(r, f"n{n}", step, ops, t0_ns=10**18 + step * 10**9,
                              coords={"pp": n, "tp": local, "dp": 0}))
    return frame_of(msgs)
