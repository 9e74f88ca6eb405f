"""Network suspects under partial tracing: waits on an untraced member are not a slow NIC."""

from __future__ import annotations

from detectors.candidates import Candidates
from detectors.features import step_features
from detectors.network_suspects import Topology, network_suspects, transfer_reference
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


def _pair_frame(slow_links: set[str]):
    """Four nodes of one rank each: data-parallel pairs dp.0 (n0, n1) and dp.1 (n2, n3), three
    all-reduces each; pipeline transfers n0→n2, n1→n3 and n0→n3, three each. The groups and
    links in `slow_links` take 40 ms instead of 10."""
    ops: dict[int, list] = {r: [] for r in range(4)}
    t = 0.0
    for group, (a, b), kind in (("dp.0", (0, 1), "coll"), ("dp.1", (2, 3), "coll"),
                                ("pp.0", (0, 2), "p2p"), ("pp.1", (1, 3), "p2p"),
                                ("pp.2", (0, 3), "p2p")):
        for seq in range(3):
            dur = 40.0 if group in slow_links else 10.0
            if kind == "coll":
                for r in (a, b):
                    ops[r].append(("coll", "all_reduce", group, seq, t, dur, 1 << 20))
            else:
                ops[a].append(("p2p", "send", group, seq, t, dur, 1 << 16))
                ops[b].append(("p2p", "recv", group, seq, t, dur, 1 << 16))
            t += 50.0
    return frame_of([rank_step(r, f"n{r}", 0, ops[r]) for r in range(4)])


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
