"""Network suspects under partial tracing: waits on an untraced member are not a slow NIC."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.candidates import Candidates
from detectors.evidence import Z_ON
from detectors.features import step_features
from detectors.network_suspects import (
    Burst,
    Topology,
    burst_of,
    network_suspects,
    transfer_reference,
)
from detectors.testing import frame_of, rank_step

# six nodes of one traced rank each; every dp group has three members, one of them untraced
DP = {"dp.0": (0, 1), "dp.1": (0, 2), "dp.2": (0, 3), "dp.3": (4, 5), "dp.4": (1, 4),
      "dp.5": (2, 5), "dp.6": (3, 4)}  # fmt: skip
# pipeline pairs with both ends traced
PP = {"pp.0": (0, 1), "pp.1": (0, 2), "pp.2": (1, 3), "pp.3": (2, 4), "pp.4": (3, 5),
      "pp.5": (4, 5), "pp.6": (1, 5)}  # fmt: skip


def _frame(slow_p2p: bool):
    """The dp instances through rank 0's node take 40 ms instead of 10 (every traced copy);
    its pipeline transfers too when `slow_p2p` (a slow NIC), else they are normal (the dp
    instances waited on their untraced member)."""
    ops: dict[int, list] = {r: [] for r in range(6)}
    for i, (group, members) in enumerate(sorted(DP.items())):
        dur = 40.0 if 0 in members else 10.0
        for r in members:
            ops[r].append(("coll", "all_reduce", group, 1, 50.0 * i, dur, 1 << 20))
    for i, (group, (a, b)) in enumerate(sorted(PP.items())):
        dur = 40.0 if slow_p2p and 0 in (a, b) else 10.0
        start = 500.0 + 50.0 * i
        ops[a].append(("p2p", "send", group, 1, start, dur, 1 << 16))
        ops[b].append(("p2p", "recv", group, 1, start, dur, 1 << 16))
    return frame_of([rank_step(r, f"n{r}", 0, ops[r]) for r in range(6)])


def _named(frame, world: int) -> list[tuple[str, str]]:
    feats = step_features(frame)
    out = Candidates()
    topo = Topology(group_size={"dp": 3}, world=world)
    network_suspects(frame, feats, topo, transfer_reference(feats.inst), out)
    return list(zip(out.entity, out.kind, strict=True))


def test_slow_incomplete_instances_with_fast_complete_ones_name_no_nic():
    assert _named(_frame(slow_p2p=False), world=12) == []


def test_a_nic_whose_complete_instances_are_slow_too_is_named():
    assert ("node:n0", "link") in _named(_frame(slow_p2p=True), world=12)


def test_with_every_rank_traced_nothing_is_refuted():
    # the layout and the world agree that all ranks report: the shortest copy is the transfer
    assert ("node:n0", "link") in _named(_frame(slow_p2p=False), world=6)


def _four_nodes(links, slow: set[str], slow_ms: float):
    """Four nodes of one rank each; each (group, (a, b), kind) of `links` runs three
    all-reduces ("coll") or three transfers a → b ("p2p"), 10 ms each, `slow_ms` in the
    groups of `slow`."""
    ops: dict[int, list] = {r: [] for r in range(4)}
    t = 0.0
    for group, (a, b), kind in links:
        for seq in range(3):
            dur = slow_ms if group in slow else 10.0
            if kind == "coll":
                for r in (a, b):
                    ops[r].append(("coll", "all_reduce", group, seq, t, dur, 1 << 20))
            else:
                ops[a].append(("p2p", "send", group, seq, t, dur, 1 << 16))
                ops[b].append(("p2p", "recv", group, seq, t, dur, 1 << 16))
            t += 50.0
    return frame_of([rank_step(r, f"n{r}", 0, ops[r]) for r in range(4)])


def _pair_frame(slow_links: set[str]):
    """Four nodes of one rank each: data-parallel pairs dp.0 (n0, n1) and dp.1 (n2, n3), three
    all-reduces each; pipeline transfers n0→n2, n1→n3 and n0→n3, three each. The groups and
    links in `slow_links` take 40 ms instead of 10."""
    return _four_nodes((("dp.0", (0, 1), "coll"), ("dp.1", (2, 3), "coll"),
                        ("pp.0", (0, 2), "p2p"), ("pp.1", (1, 3), "p2p"),
                        ("pp.2", (0, 3), "p2p")), slow_links, 40.0)


def test_a_pairs_shared_all_reduces_alone_do_not_say_which_end_is_slow():
    # only dp.0 is slow: n1 has fewer fast transfers elsewhere than n0 and would score
    # higher, but nothing in the step tells its NIC from n0's
    assert _named(_pair_frame({"dp.0"}), world=4) == []
    # n1's pipeline transfers are slow too: that is n1's NIC
    assert _named(_pair_frame({"dp.0", "pp.1"}), world=4) == [("node:n1", "link")]


def _two_nodes(ms: float, nodes: tuple[str, ...] = ()):
    """Two nodes of four ranks, four data-parallel pairs across them (rank r and r + 4): one
    all-reduce each per step, `ms` long; the job start named `nodes`."""
    def ops(r: int) -> list:
        return [("coll", "all_reduce", f"dp.{r % 4}", 1, 0.0, ms, 1 << 20)]
    frame = frame_of([rank_step(r, f"n{r // 4}", 0, ops(r)) for r in range(8)])
    return frame, step_features(frame), Topology(nodes=nodes)


def test_a_job_of_two_nodes_names_the_link_between_them():
    """Every transfer across nodes crosses both NICs and the path between: judged by their
    own past, all are slow, and the link is the narrowest entity the timing supports. With
    a third node named by the job start (its agent down) there are more paths than one."""
    from detectors.network_suspects import one_link, reference_and_peers
    from detectors.transfer_history import TransferHistory

    def suspects(nodes: tuple[str, ...]) -> list[tuple[str, str]]:
        history = TransferHistory(delay=0)
        for ms in [10.0, 11.0, 9.5, 10.5, 10.0, 10.2] + [400.0]:
            frame, feats, topo = _two_nodes(ms, nodes)
            ref, peers = reference_and_peers(feats.inst, one_link(frame, topo))
            own = history.observe(frame, feats.inst, ref, peers)
        out = Candidates()
        network_suspects(frame, feats, topo, ref, out, own)
        return list(zip(out.entity, out.kind, strict=True))

    assert suspects(()) == [("link:n0~n1", "link")]
    assert suspects(("n0", "n1")) == [("link:n0~n1", "link")]
    assert suspects(("n0", "n1", "n2")) == []  # four alike in the step: job-wide


def _burst_frame(slow: set[tuple[str, int]], buffered: bool = False, spread: float = 1.0):
    """`_pair_frame`'s four nodes with a loaded host's noise: healthy transfers jitter ×0.4 to
    ×3 (σ ≈ 1 in log space, as sub-millisecond sends on a busy host), and the instances in
    `slow` (group, seq) take 400 ms, as a flapping NIC's burst stalls what is in flight.
    `buffered`: a slow send returns at once (gloo's), and its receiver, there first, waits
    for the data. `spread` scales the noise."""
    jitter = np.exp(spread * np.resize([0.0, 0.9, -0.6, 0.4, -0.9, 0.7, -0.3, 1.1, -1.0, 0.2], 15))
    ops: dict[int, list] = {r: [] for r in range(4)}
    t, k = 0.0, 0
    for group, (a, b), kind in (("dp.0", (0, 1), "coll"), ("dp.1", (2, 3), "coll"),
                                ("pp.0", (0, 2), "p2p"), ("pp.1", (1, 3), "p2p"),
                                ("pp.2", (0, 3), "p2p")):
        for seq in range(3):
            dur = 400.0 if (group, seq) in slow else 10.0 * jitter[k]
            k += 1
            if kind == "coll":
                for r in (a, b):
                    ops[r].append(("coll", "all_reduce", group, seq, t, dur, 1 << 20))
            else:
                src, dst = (a, b) if seq != 1 else (b, a)  # both ways: their clocks line up
                if buffered and (group, seq) in slow:
                    ops[src].append(("p2p", "send", group, seq, t, 0.01, 1 << 16))
                    ops[dst].append(("p2p", "recv", group, seq, t - 5.0, dur + 5.0, 1 << 16))
                else:
                    ops[src].append(("p2p", "send", group, seq, t, dur, 1 << 16))
                    ops[dst].append(("p2p", "recv", group, seq, t, dur, 1 << 16))
            t += 500.0
    return frame_of([rank_step(r, f"n{r}", 0, ops[r]) for r in range(4)])


def _burst_named(frame, burst: Burst | None) -> list[tuple[str, float]]:
    feats = step_features(frame)
    out = Candidates()
    network_suspects(frame, feats, Topology(), transfer_reference(feats.inst), out, burst=burst)
    return list(zip(out.entity, out.z, strict=True))


def test_a_burst_is_named_by_the_seconds_its_transfers_cost_the_step():
    """n1's NIC stalls one all-reduce and one send for 400 ms each: each is only a few σ of
    the host's noise, and n1's other transfers were on time, so alone they stay under the
    bar that counts (z_on).
    The step doubled (0.8 s lost) and n1's transfers carry that loss: n1 is as significant
    as the step."""
    frame = _burst_frame({("dp.0", 0), ("pp.1", 0)})
    assert all(z < Z_ON for _, z in _burst_named(frame, None))  # under the bar that counts
    [(entity, z)] = _burst_named(frame, burst_of(1.2, 0.4, z=30.0))
    assert entity == "node:n1" and 9.0 < z <= 10.0  # the step's z (clipped), nearly all carried


def test_a_burst_on_a_pairs_shared_all_reduce_names_nobody():
    """Only the all-reduce n0 and n1 share was stalled: both lost the same seconds, and no
    burst says which end's NIC it was."""
    assert _burst_named(_burst_frame({("dp.0", 0)}), burst_of(1.2, 0.4, z=30.0)) == []


def test_a_buffered_sends_data_counts_as_its_receiver_saw_it_arrive():
    """The send n1 posted returned at once (its copy 0.01 ms) and its data reached n3 400 ms
    later: by the copies, n0 and n1 lost the same seconds (their shared all-reduce) and
    nobody is named; by the data, n1 lost twice what n0 did."""
    frame = _burst_frame({("dp.0", 0), ("pp.1", 0)}, buffered=True, spread=0.5)
    [(entity, z)] = _burst_named(frame, burst_of(1.2, 0.4, z=30.0))
    assert entity == "node:n1" and 9.0 < z <= 10.0


def test_a_burst_carried_in_part_is_as_significant_as_its_share():
    """One send of the link n1~n3 stalled 0.39 s of the 0.8 s the step lost: about half."""
    [(entity, z)] = _burst_named(_burst_frame({("pp.1", 0)}), Burst(z=10.0, lost_s=0.8))
    assert entity == "link:n1~n3" and 4.0 < z < 6.0


def test_only_a_step_that_doubled_is_a_burst():
    assert burst_of(0.7, 0.4, z=20.0) is None
    assert burst_of(0.8, 0.4, z=20.0) == Burst(z=10.0, lost_s=pytest.approx(0.4))


def _stage_per_switch(slow: set[str], world: int = 4):
    """Four nodes of one rank each, two leaf switches that each hold one pipeline stage: a
    (n0, n1) and b (n2, n3). All-reduces dp.0 (n0, n1) and dp.1 (n2, n3) and pipeline
    transfers n0→n2 and n1→n3, three each a step; every pipeline transfer crosses both
    switches. The groups in `slow` take 30 ms instead of 10; `world` over 4: other ranks of
    the job are not traced."""
    frame = _four_nodes((("dp.0", (0, 1), "coll"), ("dp.1", (2, 3), "coll"),
                         ("pp.0", (0, 2), "p2p"), ("pp.1", (1, 3), "p2p")), slow, 30.0)
    feats = step_features(frame)
    out = Candidates()
    topo = Topology(switch_of={"n0": "a", "n1": "a", "n2": "b", "n3": "b"},
                    group_size={"dp": 2}, world=world)
    network_suspects(frame, feats, topo, transfer_reference(feats.inst), out)
    return list(zip(out.entity, out.kind, out.detail, strict=True))


def test_a_switch_is_judged_by_the_instances_that_can_tell_it_apart():
    """Switch a slows its stage's all-reduces and every pipeline transfer alike: those read
    as on time against each other (each one's peers all cross a too), and counted as a's
    fast instances they hid its slow all-reduces, naming nobody."""
    named = _stage_per_switch({"dp.0", "pp.0", "pp.1"})
    assert [(e, k) for e, k, _ in named] == [("switch:a", "switch")]
    assert named[0][2] == "transfers ×3.00 on 3 of 3 instances"  # the all-reduces it shows
    # partial tracing: its on-time-alike pipeline transfers do not refute it either
    assert [(e, k) for e, k, _ in _stage_per_switch({"dp.0", "pp.0", "pp.1"}, world=8)] == [
        ("switch:a", "switch")]
    # one NIC: n0's pipeline transfers are slower than n1's, and that tells the switch apart
    assert [(e, k) for e, k, _ in _stage_per_switch({"dp.0", "pp.0"})] == [("node:n0", "link")]


def _pipelines(slow_sender: str, factor: float):
    """Two pipelines of three nodes (a0→a1→a2, b0→b1→b2; one rank each), six microbatches
    forward and back. `slow_sender`'s sends take `factor` × 10 ms: a NIC slow one way (a
    rate limit on its egress), whose received transfers are on time."""
    ops: dict[str, list] = {f"{p}{s}": [] for p in "ab" for s in range(3)}
    t = 0.0
    for m in range(6):
        for p in "ab":
            hops = [(f"{p}0", f"{p}1"), (f"{p}1", f"{p}2"), (f"{p}2", f"{p}1"), (f"{p}1", f"{p}0")]
            for h, (src, dst) in enumerate(hops):
                dur = 10.0 * (factor if src == slow_sender else 1.0) * (1 + 0.002 * ((m + h) % 3))
                group = "pp." + "".join(sorted((src, dst)))
                ops[src].append(("p2p", "send", group, 2 * m + (h >= 2), t, dur, 1 << 16))
                ops[dst].append(("p2p", "recv", group, 2 * m + (h >= 2), t, dur, 1 << 16))
                t += 20.0
    names = sorted(ops)
    frame = frame_of([rank_step(r, n, 0, ops[n]) for r, n in enumerate(names)])
    feats = step_features(frame)
    out = Candidates()
    network_suspects(frame, feats, Topology(), transfer_reference(feats.inst), out)
    return out


def test_a_nic_slow_one_way_is_read_by_what_it_sends():
    """Node a1's sends, to a2 and back to a0, are ×1.12; what it receives is on time. Over
    every transfer through it the excess reads half (the all-reduces of a large job, whose
    shortest copies are its own, dilute it further: a ÷1.5 NIC of an 8,192-GPU job sat
    at z 3.5 for good). Its sends alone read whole, and name its NIC."""
    out = _pipelines("a1", 1.12)
    assert out.entity[:1] == ["node:a1"] and out.kind[:1] == ["link"], (out.entity, out.detail)
    assert out.detail[0].startswith("outgoing pipeline transfers ×1.12 on 12 of 12"), out.detail
    assert out.z[0] >= 3.0


def test_a_nodes_sends_to_one_node_are_no_nic_of_its_own():
    """a0 sends only to a1: its egress and a1's ingress slow the same transfers, so its
    sends alone do not name its NIC."""
    out = _pipelines("a0", 1.5)
    assert not any(d.startswith("outgoing") for d in out.detail), (out.entity, out.detail)


def _two_ranks_per_node(slow_ranks: set[int]):
    """Four nodes of two ranks each (rank r on node r // 2); a two-member all-reduce between
    every two ranks of the same local index on different nodes, 10 ms, 40 ms when a member
    is in `slow_ranks`."""
    ops: dict[int, list] = {r: [] for r in range(8)}
    pairs = [(a, b) for a in range(8) for b in range(a + 1, 8)
             if a // 2 != b // 2 and a % 2 == b % 2]
    for i, (a, b) in enumerate(pairs):
        dur = 40.0 if {a, b} & slow_ranks else 10.0
        for r in (a, b):
            ops[r].append(("coll", "all_reduce", f"dp.{a}{b}", 1, 50.0 * i, dur, 1 << 20))
    return frame_of([rank_step(r, f"n{r // 2}", 0, ops[r]) for r in range(8)])


def _named_beside(frame, suspects: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The network suspects of `frame` when `suspects` (entity, kind) are already the step's
    compute or host suspects, at z 8."""
    feats = step_features(frame)
    out = Candidates()
    for entity, kind in suspects:
        out.add(entity, kind, 8.0, 0.1)
    network_suspects(frame, feats, Topology(), transfer_reference(feats.inst), out)
    return [(e, k) for e, k in zip(out.entity, out.kind, strict=True) if k == "link"]


def test_one_slow_ranks_own_transfers_through_its_nic_are_that_ranks():
    # rank 0's all-reduces take 40 ms, its node partner rank 1's through the same NIC 10:
    # with rank 0 slow in its own compute, its process moved those bytes slowly (gloo, a
    # starved NCCL proxy), not n0's NIC
    assert _named_beside(_two_ranks_per_node({0}), [("rank:0", "gpu")]) == []
    assert _named_beside(_two_ranks_per_node({0}), [("rank:0", "host")]) == []


def test_one_ranks_slow_transfers_still_name_its_nic_when_nothing_else_of_it_is_slow():
    # the rank itself shows nothing (another rank is the step's suspect): the NIC stands
    assert _named_beside(_two_ranks_per_node({0}), [("rank:4", "gpu")]) == [("node:n0", "link")]


def test_a_nic_that_slows_both_ranks_of_its_node_is_named_beside_a_slow_rank():
    assert _named_beside(_two_ranks_per_node({0, 1}), [("rank:0", "gpu")]) == [
        ("node:n0", "link")]
