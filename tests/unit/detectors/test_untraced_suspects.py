"""Partial tracing: a traced rank waiting on an untraced group member names that node."""

from __future__ import annotations

import numpy as np

from detectors.candidates import Candidates
from detectors.compute_suspects import compute_ratio
from detectors.evidence import EvidenceTracker
from detectors.features import step_features
from detectors.network_suspects import Topology, transfer_reference
from detectors.noise import NoiseMemory
from detectors.peers import stage_keys
from detectors.suspects import step_suspects
from detectors.testing import frame_of, rank_step
from detectors.untraced_suspects import (
    WaitHistory,
    partial_groups,
    untraced_home,
    untraced_suspects,
)


def _frame(slow_group: int | None, recv_slow: set[int] = frozenset(), step: int = 0,
           recv_ms: float = 20.0):
    """One traced rank per tp group of 4 (ranks 0, 4, 8, 12, 16); each computes 10 ms,
    receives from the previous stage (`recv_slow`: in `recv_ms`, else 1 ms), then
    all-reduces on its tp group."""
    msgs = []
    for r in (0, 4, 8, 12, 16):
        recv = recv_ms if r in recv_slow else 1.0
        wait = 30.0 if slow_group is not None and r // 4 == slow_group else 1.0
        msgs.append(
            rank_step(
                r,
                f"n{r // 4}",
                step,
                [
                    ("p2p", "recv", f"pp.{r}", step, 0.0, recv, 1 << 10),
                    ("compute", "fwd", "", 0, recv, 10.0, 0),
                    ("coll", "all_reduce", f"tp.{r // 4}", step, recv + 10.0, wait, 1 << 20),
                ],
            )
        )
    return frame_of(msgs)


def _judge(frames, topo):
    """Suspects of the last frame, the others first teaching each group its usual wait."""
    noise, waits = NoiseMemory(), WaitHistory()
    for frame in frames:
        out = Candidates()
        untraced_suspects(frame, step_features(frame), topo, stage_keys(frame), noise, waits, out)
    return list(zip(out.entity, out.kind, strict=True))


def _suspects(frame, sizes=None, usual=None):
    topo = Topology(group_size={"tp": 4} if sizes is None else sizes, world=20)
    return _judge([usual or _frame(None)] * 6 + [frame], topo)


def test_partial_groups_need_the_layout_to_say_the_group_is_larger():
    frame = _frame(None)
    partial, observed, measured = partial_groups(frame, {"tp": 4})
    assert {frame.groups[i] for i in partial.nonzero()[0]} == {f"tp.{i}" for i in range(5)}
    assert all(observed[i] == 1 for i in partial.nonzero()[0])
    assert (measured == partial).all()  # every tp group here misses members
    assert not partial_groups(frame, {})[0].any()
    assert not partial_groups(frame, {"tp": 1})[0].any()
    assert partial_groups(frame, {"tp": 1})[2].sum() == 0  # a group of one has no waits


def test_the_node_of_the_waiting_traced_rank_is_the_suspect():
    assert _suspects(_frame(slow_group=2)) == [("node:n2", "gpu")]


def test_a_group_that_always_waits_that_long_is_not_a_suspect():
    # the same wait, usual for this group (it misses more members than its peers), is not new
    assert _suspects(_frame(slow_group=2), usual=_frame(slow_group=2)) == []
    # nothing is judged before a group's usual wait is known
    assert _judge([_frame(slow_group=2)], Topology(group_size={"tp": 4}, world=20)) == []


def test_nothing_without_the_layout_or_without_a_wait():
    assert _suspects(_frame(slow_group=2), sizes={}) == []
    assert _suspects(_frame(slow_group=None)) == []


def test_a_rank_that_also_waits_in_its_recv_is_downstream_not_the_place():
    # rank 8's group waits because rank 8 itself waited for its upstream stage
    assert _suspects(_frame(slow_group=2, recv_slow={8})) == []


def test_a_group_that_waits_far_longer_than_its_rank_received_late_waits_on_its_own():
    # rank 8 received 4 ms late, its group waited 29 ms extra: the pipeline explains a
    # seventh of it, an untraced member of its own the rest (a straggler that holds every
    # all-reduce, and makes its traced peer's next transfers a little late too)
    assert _suspects(_frame(slow_group=2, recv_slow={8}, recv_ms=5.0)) == [("node:n2", "gpu")]


def _compute_then_all_reduce(rank: int, node: str, group: str, compute: float, wait: float):
    """One rank-step: `compute` ms of compute, then an all-reduce on `group` of `wait` ms."""
    return rank_step(rank, node, 0, [
        ("compute", "fwd", "", 0, 0.0, compute, 0),
        ("coll", "all_reduce", group, 0, compute, wait, 1 << 20),
    ])  # fmt: skip


def _half_frame(slow_tp: int | None, slow_traced: bool = False):
    """Six tp groups of 4 on six nodes, two members of each traced (ranks 4g and 4g+1). The
    group `slow_tp` has a slow member: untraced (both traced members wait 30 ms) or traced
    (rank 4g computes 29 ms longer and waits little; its traced peer waits 30 ms)."""
    msgs = []
    for g in range(6):
        for r in (4 * g, 4 * g + 1):
            late = slow_tp == g and slow_traced and r == 4 * g
            compute = 39.0 if late else 10.0
            wait = 30.0 if slow_tp == g and not late else 1.0
            msgs.append(_compute_then_all_reduce(r, f"n{g}", f"tp.{g}", compute, wait))
    return frame_of(msgs)


def test_a_group_whose_traced_members_all_wait_names_their_node():
    assert _suspects(_half_frame(slow_tp=3), usual=_half_frame(None)) == [("node:n3", "gpu")]


def test_a_group_whose_slow_member_is_traced_is_left_to_the_compute_view():
    usual = _half_frame(None)
    assert _suspects(_half_frame(slow_tp=3, slow_traced=True), usual=usual) == []
    assert _suspects(_half_frame(slow_tp=None), usual=usual) == []


def _dark_frame(slow_dp: int | str | None):
    """Nodes n0-n2 report three ranks each; the job start names a fourth node, n3, whose
    agent is down. dp.t holds rank t of every node, so each dp group misses its member on n3;
    the traced members of dp.`slow_dp` (of every dp group: "all") wait 30 ms for it. Each
    node's three ranks also form a fully traced tp group."""
    msgs = []
    for node in range(3):
        for t in range(3):
            wait = 30.0 if slow_dp in (t, "all") else 1.0
            msgs.append(
                rank_step(
                    3 * node + t,
                    f"n{node}",
                    0,
                    [
                        ("compute", "fwd", "", 0, 0.0, 10.0, 0),
                        ("coll", "all_reduce", f"tp.{node}", 0, 10.0, 1.0 + 0.1 * t, 1 << 16),
                        ("coll", "all_reduce", f"dp.{t}", 0, 12.0, wait, 1 << 20),
                    ],
                )
            )
    return frame_of(msgs)


def _dark_suspects(frame, nodes):
    topo = Topology(group_size={"dp": 4, "tp": 3}, world=12, nodes=nodes)
    return _judge([_dark_frame(None)] * 6 + [frame], topo)


def test_a_group_across_nodes_names_the_dark_node_that_holds_every_untraced_rank():
    frame = _dark_frame(slow_dp=1)
    assert untraced_home(frame, Topology(world=12, nodes=("n0", "n1", "n2", "n3"))) == "n3"
    assert _dark_suspects(frame, ("n0", "n1", "n2", "n3")) == [("node:n3", "gpu")]
    assert _dark_suspects(_dark_frame(slow_dp=None), ("n0", "n1", "n2", "n3")) == []


def test_without_one_dark_node_a_group_across_nodes_names_nothing():
    frame = _dark_frame(slow_dp=1)
    assert _dark_suspects(frame, ()) == []  # the job start named no nodes
    two_dark = ("n0", "n1", "n2", "n3", "n4")
    assert untraced_home(frame, Topology(world=12, nodes=two_dark)) is None
    assert _dark_suspects(frame, two_dark) == []
    # more ranks missing than one node holds: some untraced rank is elsewhere
    assert untraced_home(frame, Topology(world=13, nodes=("n0", "n1", "n2", "n3"))) is None


def _lone_frame(slow: str | None):
    """One traced rank per node and per tp group of 4 (ranks 0, 4, ..., 20); rank 8 computes
    15 ms instead of 10. A slow GPU arrives last, so its untraced peers wait for it and its
    own all-reduce is short; a slow node keeps its peers as late as it is."""
    msgs = []
    for r in range(0, 24, 4):
        compute = 15.0 if slow and r == 8 else 10.0
        wait = 0.1 if slow == "gpu" and r == 8 else 1.0 + 0.01 * (r % 3)
        msgs.append(_compute_then_all_reduce(r, f"n{r // 4}", f"tp.{r // 4}", compute, wait))
    return frame_of(msgs)


def _all_suspects(frames):
    noise, waits = NoiseMemory(), WaitHistory()
    topo = Topology(group_size={"tp": 4}, world=24)
    for frame in frames:
        feats = step_features(frame)
        stages = stage_keys(frame)
        c = step_suspects(
            frame,
            feats,
            compute_ratio(frame, feats, stages),
            topo,
            transfer_reference(feats.inst),
            noise,
            stages,
            waits,
        )
    return list(zip(c.entity, c.kind, strict=True))


def test_a_nodes_only_traced_rank_is_its_gpu_when_its_peers_wait_for_it():
    assert _all_suspects([_lone_frame(None)] * 6 + [_lone_frame("gpu")]) == [("rank:8", "gpu")]


def test_a_nodes_only_traced_rank_is_its_node_when_its_peers_keep_pace():
    assert _all_suspects([_lone_frame(None)] * 6 + [_lone_frame("node")]) == [("node:n2", "node")]


def test_when_every_group_waits_on_the_dark_node_it_is_still_named():
    # a slow GPU there delays its whole replica: every dp group of the stage waits alike, so
    # the peers say nothing; the fully traced tp groups' usual waits say it is not job-wide
    assert _dark_suspects(_dark_frame("all"), ("n0", "n1", "n2", "n3")) == [("node:n3", "gpu")]


def test_a_node_blamed_whole_or_a_slow_network_is_the_explanation_instead():
    nodes = ("n0", "n1", "n2", "n3")
    topo = Topology(group_size={"dp": 4, "tp": 3}, world=12, nodes=nodes)
    for kind, entity in (("link", "node:n0"), ("switch", "switch:s0")):
        noise, waits = NoiseMemory(), WaitHistory()
        for frame in [_dark_frame(None)] * 6 + [_dark_frame(1)]:
            out = Candidates()
            out.add(entity, kind, 10.0, 0.1)  # what the network view saw on this step
            untraced_suspects(
                frame, step_features(frame), topo, stage_keys(frame), noise, waits, out
            )
        assert out.entity == [entity], kind
    noise, waits = NoiseMemory(), WaitHistory()
    tp4 = Topology(group_size={"tp": 4}, world=20)
    for frame in [_frame(None)] * 6 + [_frame(slow_group=2)]:
        out = Candidates()
        out.add("node:n2", "host", 10.0, 0.1)  # the host view blames node n2 as a whole
        untraced_suspects(frame, step_features(frame), tp4, stage_keys(frame), noise, waits, out)
    assert list(zip(out.entity, out.kind, strict=True)) == [("node:n2", "host")]


def _stall_frame(step: int, stalls: dict[tuple[int, int], float], replicas: int = 4,
                 every: bool = False, rest: dict[tuple[int, int], float] | None = None):
    """Two pipeline stages × four data replicas (or `replicas`), a tp group of 4 per (stage,
    replica) on a node of its own, only tp rank 0 traced. Each traced rank computes 10 ms
    and all-reduces on its tp group four times a step; `stalls` maps (pp, dp) to a wait of
    that many ms at one of the four all-reduces (which one moves with the step; `every`: at
    all four, a slow member), the others wait 1 ms (`rest`: that group's other three)."""
    msgs = []
    for pp in range(2):
        for dp in range(replicas):
            rank, t, ops = pp * 16 + dp * 4, 0.0, []
            stalled = (step + dp) % 4
            for k in range(4):
                hit = every or k == stalled
                usual = (rest or {}).get((pp, dp), 1.0 + 0.01 * dp)
                wait = stalls.get((pp, dp), 1.0) if hit else usual
                ops += [("compute", "fwd", "", k, t, 10.0, 0),
                        ("coll", "all_reduce", f"tp.{pp}-{dp}", k, t + 10.0, wait, 1 << 20)]
                t += 10.0 + wait
            msgs.append(rank_step(rank, f"n{pp}{dp}", step, ops,
                                  coords={"tp": 0, "pp": pp, "dp": dp}))
    return frame_of(msgs)


def _stall_suspects(stalls_of_step, steps: int = 14, replicas: int = 4, every: bool = False,
                    rest: dict[tuple[int, int], float] | None = None):
    topo = Topology(group_size={"tp": 4}, world=8 * replicas)
    frames = [_stall_frame(s, {}, replicas) for s in range(6)]
    frames += [_stall_frame(s, stalls_of_step(s), replicas, every, rest)
               for s in range(6, 6 + steps)]
    return _judge(frames, topo)


def test_an_untraced_member_that_stalls_once_per_step_names_its_nodes_host():
    # one of four all-reduces waits 12 ms for an untraced member: the group's total wait
    # rises while its typical all-reduce does not (a GC pause, a late loader, not a slow GPU)
    assert _stall_suspects(lambda s: {(1, 2): 12.0}) == [("node:n12", "host")]


def test_a_stall_whose_other_collectives_wait_a_little_too_is_still_its_hosts():
    """A stalled process that drives its own sends (gloo, NCCL's proxy) also makes its
    group wait a little at every other collective: the typical all-reduce rises ×1.5,
    significantly, but the lump is 20 times what that rise accounts for. It read as a slow
    member (`gpu`) in 8 of 24 simulated untraced stalls under `cpu_sends`."""
    assert _stall_suspects(lambda s: {(1, 2): 12.0}, rest={(1, 2): 1.5}) == [("node:n12", "host")]
    # a slow member raises every instance alike: the total rises as the typical does
    assert _stall_suspects(lambda s: {(1, 2): 4.0}, every=True) == [("node:n12", "gpu")]


def test_a_wait_that_triples_but_costs_a_sliver_of_the_step_is_no_stall():
    # 1.3 ms instead of 1 in a 44 ms step: unusual for the group (×1.3 on its own spread of
    # nothing), but under 1% of a step, inside a process's ordinary jitter
    assert _stall_suspects(lambda s: {(1, 2): 1.3}) == []


def test_in_a_job_too_small_for_stage_peers_a_stall_is_measured_against_its_usual_wait():
    """Two replicas, so two groups a stage: too few to compare with (`_MIN_PEERS`). A stall
    raises its group's total over its own usual total, its typical all-reduce stays (a
    16-GPU job with one rank per TP group traced read a stalled rank as a job-wide shift)."""
    assert _stall_suspects(lambda s: {(1, 1): 12.0}, replicas=2) == [("node:n11", "host")]
    assert _stall_suspects(lambda s: {(1, 1): 1.3}, replicas=2) == []


def test_a_stall_passed_down_the_pipeline_is_named_where_it_happens():
    # when the lump falls before a send, the next stage's untraced receiver is late and its
    # group waits as long; that happens on some steps, the stall's own group waits on all
    stalls = lambda s: {(1, 2): 12.0, (0, 2): 12.0} if s % 2 else {(1, 2): 12.0}  # noqa: E731
    assert _stall_suspects(stalls) == [("node:n12", "host")]
    assert _stall_suspects(stalls, steps=15) == [("node:n12", "host")]


def test_a_slow_member_whose_group_a_neighbour_stage_echoes_is_named_where_it_is():
    """An untraced member slowed at every all-reduce (its own sends slow with it, as a
    starved process's do) makes its pipeline neighbour's group wait as long on the steps
    its late data reaches that group's untraced member first; the neighbour's traced
    member exchanges with the slow one's traced member, on time, so its transfers say
    nothing. The group that waited in every step is named, on either parity."""
    echoed = lambda s: {(1, 2): 12.0, (0, 2): 12.0} if s % 2 else {(1, 2): 12.0}  # noqa: E731
    for steps in (14, 15):
        assert _stall_suspects(echoed, steps=steps, every=True) == [("node:n12", "gpu")]


def test_two_groups_of_a_replica_waiting_alike_from_the_start_name_neither_yet():
    # one step cannot tell which waits on the other; naming both would page a healthy node
    both = lambda s: {(1, 2): 12.0, (0, 2): 12.0}  # noqa: E731
    assert _stall_suspects(both, steps=3, every=True) == []
    # a slow member alone in its replica is named at once
    assert _stall_suspects(lambda s: {(1, 2): 12.0}, steps=1, every=True) == [("node:n12", "gpu")]


def test_a_stall_passed_on_from_a_traced_rank_is_that_ranks():
    # rank 24 (stage 1, replica 2) is traced and stalls: the host view names it, and the
    # untraced receiver in stage 0 of its replica only passes its lateness on to its group
    topo = Topology(group_size={"tp": 4}, world=32)
    frames = [_stall_frame(s, {}) for s in range(6)]
    frames += [_stall_frame(s, {(0, 2): 12.0}) for s in range(6, 20)]

    def named(seen_by_host: bool):
        noise, waits = NoiseMemory(), WaitHistory()
        for frame in frames:
            out = Candidates()
            if seen_by_host:
                out.add("rank:24", "host", 9.0, 0.012, "idle +12 ms per step between its ops")
            untraced_suspects(frame, step_features(frame), topo, stage_keys(frame), noise,
                              waits, out)
        return list(zip(out.entity, out.kind, strict=True))

    assert named(seen_by_host=False) == [("node:n02", "host")]
    assert named(seen_by_host=True) == [("rank:24", "host")]


def _small_job(slow: int | None, step: int, jitter: float = 0.0):
    """A drill's size: two pipeline stages of two nodes, one traced rank per node (tp 2).

    A slow untraced GPU holds its node's group at both forward all-reduces; its data-parallel
    peer, late from the gradient all-reduce it waited on, holds its own node's group at the
    first one only (so that group's total rises too, by less)."""
    msgs = []
    for r in (0, 2, 4, 6):
        node = r // 2
        waits = [1.0 + jitter * ((r + step) % 3), 1.0]
        if slow is not None and node == slow:
            waits = [300.0, 300.0]
        elif slow is not None and node == slow ^ 1:  # its data-parallel peer's node
            waits = [250.0, 1.0]
        ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0)]
        t = 10.0
        for k, w in enumerate(waits):
            ops.append(("coll", "all_reduce", f"tp.{node}", 2 * step + k, t, w, 1 << 20))
            t += w
        msgs.append(rank_step(r, f"n{node}", step, ops, coords={"tp": 0, "pp": node // 2,
                                                                "dp": node % 2}))
    return frame_of(msgs)


def test_in_a_job_too_small_for_stage_peers_the_group_that_rose_most_names_its_node():
    """Two groups of a kind per stage are too few to compare with (`_MIN_PEERS`): each is
    judged by its own usual wait, and of those that rose, the one that rose most is where
    the wait starts (a drill with one rank per node traced: the slow rank was not named)."""
    topo = Topology(group_size={"tp": 2}, world=8)
    usual = [_small_job(None, s, jitter=0.5) for s in range(8)]
    assert _judge([*usual, _small_job(1, 8)], topo) == [("node:n1", "gpu")]
    assert _judge([*usual, _small_job(None, 8, jitter=0.5)], topo) == []


def _dark_stage(step: int, wait: float, compute: float = 40.0, send: float = 2.0):
    """A job of two nodes with n1's agent down: the traced stage on n0 (ranks 0-3, one tp
    group) computes, sends to its untraced pipeline peer on n1 (rank r + 4; `send` ms, the
    peer was ready), receives from it (`wait` ms: the peer's work and the transfer), and
    all-reduces; a little jitter from step to step."""
    j = 1.0 + 0.01 * ((step * 7) % 5 - 2)
    return frame_of([rank_step(r, "n0", step, [
        ("compute", "fwd", "", 0, 0.0, compute, 0),
        ("p2p", "send", f"pp.{r}", 2 * step, compute, send * j, 1 << 16),
        ("p2p", "recv", f"pp.{r}", 2 * step + 1, compute + send * j, wait * j, 1 << 16),
        ("coll", "all_reduce", "tp.0", step, compute + (send + wait) * j, 2.0, 1 << 20),
    ]) for r in range(4)])


def _dark_stage_suspects(frames) -> list[tuple[str, str]]:
    topo = Topology(group_size={"tp": 4}, world=8, nodes=("n0", "n1"))
    history = WaitHistory()
    for frame in frames:
        out = Candidates()
        untraced_suspects(frame, step_features(frame), topo, stage_keys(frame), NoiseMemory(),
                          history, out)
    return list(zip(out.entity, out.kind, strict=True))


def test_a_dark_stage_that_slows_is_named_by_the_waits_on_it():
    """Every traced group is complete; only the pipeline transfers wait on the dark node. The
    receives doubled while the traced ranks' own work did not: the dark node is slow."""
    usual = [_dark_stage(s, 10.0) for s in range(8)]
    assert _dark_stage_suspects(usual + [_dark_stage(8, 20.0)]) == [("node:n1", "gpu")]
    assert _dark_stage_suspects(usual + [_dark_stage(8, 10.0)]) == []
    # the whole job slower alike (its compute and the dark stage's): a change of the job
    assert _dark_stage_suspects(usual + [_dark_stage(8, 20.0, compute=80.0)]) == []
    # the traced ranks' own work grew more than their waits (their host starved, the dark
    # stage late with them): the traced side changed, not the dark node
    assert _dark_stage_suspects(usual + [_dark_stage(8, 20.0, compute=60.0)]) == []


def test_a_dark_stage_behind_a_slow_link_is_still_named_as_the_dark_node():
    """Every transfer to the dark node doubled, the sends whose peer was ready too: a slow
    link would do that, and so, on real training, would a starved receiver that drains its
    sockets slowly. Nothing traced tells them apart: the dark node is named, and its summary
    says its NIC or the path to it would look the same."""
    usual = [_dark_stage(s, 10.0) for s in range(8)]
    frames = usual + [_dark_stage(8, 20.0, send=4.0)]
    assert _dark_stage_suspects(frames) == [("node:n1", "gpu")]
    topo = Topology(group_size={"tp": 4}, world=8, nodes=("n0", "n1"))
    history, out = WaitHistory(), Candidates()
    for frame in frames:
        out = Candidates()
        untraced_suspects(frame, step_features(frame), topo, stage_keys(frame), NoiseMemory(),
                          history, out)
    assert "its NIC or the path to it would look the same" in out.detail[0]


def _routed_job(step: int, heavy: set[int], slow: int | None = None):
    """`_small_job`'s layout, where an untraced member's expert load varies with the tokens
    routed to it: a group waits 1 ms, ×2-5 when the member is routed heavy this step
    (`heavy`: nodes), and 12 ms on every step from a slow untraced GPU (`slow`)."""
    msgs = []
    for r in (0, 2, 4, 6):
        node = r // 2
        wait = 1.0 + 0.02 * ((r + step) % 3)
        if node in heavy:
            wait *= 2.0 + (step * 7 + node) % 4
        if node == slow:
            wait = 12.0
        msgs.append(rank_step(r, f"n{node}", step, [
            ("compute", "fwd", "", 0, 0.0, 10.0, 0),
            ("coll", "all_reduce", f"tp.{node}", step, 10.0, wait, 1 << 20)],
            coords={"tp": 0, "pp": node // 2, "dp": node % 2}))
    return frame_of(msgs)


def _confirmed(frames, topo) -> set[str]:
    """The suspects the evidence tracker confirms from these steps."""
    noise, waits, tracker, confirmed = NoiseMemory(), WaitHistory(), EvidenceTracker(), set()
    for step, frame in enumerate(frames):
        out = Candidates()
        untraced_suspects(frame, step_features(frame), topo, stage_keys(frame), noise, waits, out)
        n = len(out.entity)
        confirmed |= {t.entity for t in tracker.update(step, out.entity, out.kind, out.z,
                                                       [0.0] * n, [""] * n)}
    return confirmed


def test_an_untraced_members_routed_load_is_learnt_as_its_groups_usual_wait():
    """A group judged by its own usual wait, whose untraced member's load follows the tokens
    routed to it (MoE): its long waits come one step in seven, in runs now and then. Each
    excursion that did not persist is learnt late as the group's spread; a slow GPU, long
    every step, never is, and is still named once its wait is past that spread (a wait
    within it, every step, is not: that is the price of a spread that holds the tail)."""
    topo = Topology(group_size={"tp": 2}, world=8)
    rng = np.random.default_rng(3)
    heavy = [{n for n in range(4) if rng.random() < 0.15} for _ in range(300)]
    assert _confirmed([_routed_job(s, heavy[s]) for s in range(300)], topo) == set()
    frames = [_routed_job(s, heavy[s], slow=1 if s >= 250 else None) for s in range(300)]
    assert _confirmed(frames, topo) == {"node:n1"}
