"""Partial tracing: a traced rank waiting on an untraced group member names that node."""

from __future__ import annotations

from detectors.candidates import Candidates
from detectors.features import step_features
from detectors.noise import NoiseMemory
from detectors.peers import stage_keys
from detectors.testing import frame_of, rank_step
from detectors.untraced_suspects import single_member_groups, untraced_suspects


def _frame(slow_group: int | None, recv_slow: set[int] = frozenset(), step: int = 0):
    """One traced rank per tp group of 4 (ranks 0, 4, 8, 12, 16); each computes 10 ms,
    receives from the previous stage, then all-reduces on its tp group."""
    msgs = []
    for r in (0, 4, 8, 12, 16):
        recv = 20.0 if r in recv_slow else 1.0
        wait = 30.0 if slow_group is not None and r // 4 == slow_group else 1.0
        msgs.append(rank_step(r, f"n{r // 4}", step, [
            ("p2p", "recv", f"pp.{r}", step, 0.0, recv, 1 << 10),
            ("compute", "fwd", "", 0, recv, 10.0, 0),
            ("coll", "all_reduce", f"tp.{r // 4}", step, recv + 10.0, wait, 1 << 20),
        ]))
    return frame_of(msgs)


def _suspects(frame, sizes=None):
    out = Candidates()
    untraced_suspects(frame, step_features(frame), {"tp": 4} if sizes is None else sizes,
                      stage_keys(frame), NoiseMemory(), out)
    return list(zip(out.entity, out.kind, strict=True))


def test_single_member_groups_need_the_layout_to_say_the_group_is_larger():
    frame = _frame(None)
    lonely = single_member_groups(frame, {"tp": 4})
    assert {frame.groups[i] for i in lonely.nonzero()[0]} == {f"tp.{i}" for i in range(5)}
    assert not single_member_groups(frame, {}).any()


def test_the_node_of_the_waiting_traced_rank_is_the_suspect():
    assert _suspects(_frame(slow_group=2)) == [("node:n2", "gpu")]


def test_nothing_without_the_layout_or_without_a_wait():
    assert _suspects(_frame(slow_group=2), sizes={}) == []
    assert _suspects(_frame(slow_group=None)) == []


def test_a_rank_that_also_waits_in_its_recv_is_downstream_not_the_place():
    # rank 8's group waits because rank 8 itself waited for its upstream stage
    assert _suspects(_frame(slow_group=2, recv_slow={8})) == []
