"""A CPU thread's phases less the time it sat blocked in communication."""

from __future__ import annotations

import numpy as np

from producers.kineto.waits import Leaves, blocked, pieces


def ns(us: float) -> int:
    return int(us * 1000)


def test_leaves_are_the_innermost_events_and_busy_counts_their_part_inside():
    spans = [(1, 0.0, 100.0, False), (1, 10.0, 20.0, False), (1, 12.0, 5.0, False),
             (1, 50.0, 30.0, False), (1, 85.0, 3.0, True), (2, 0.0, 100.0, False)]
    leaves = Leaves.of(spans, tid=1, ns=ns)
    assert leaves.start.tolist() == [ns(12), ns(50)]  # the comm call is no leaf of compute
    assert leaves.busy(np.array([0, ns(14), ns(60), ns(90)]),
                       np.array([ns(100), ns(55), ns(70), ns(95)])).tolist() == \
        [ns(35), ns(8), ns(10), 0]
    assert Leaves.of([], tid=1, ns=ns).busy(np.array([0]), np.array([5])).tolist() == [0]
    # a child that starts with its parent is the leaf, not the parent around it
    together = Leaves.of([(1, 0.0, 100.0, False), (1, 0.0, 40.0, False)], tid=1, ns=ns)
    assert (together.start.tolist(), together.end.tolist()) == ([0], [ns(40)])


def test_only_ops_the_thread_idled_through_block_and_they_merge():
    leaves = Leaves.of([(1, 0.0, 40.0, False), (1, 100.0, 50.0, False)], tid=1, ns=ns)
    waits = blocked([(ns(40), ns(90)), (ns(80), ns(95)), (ns(100), ns(150)), (ns(0), ns(30))],
                    leaves)
    # 40-95 blocked (two ops overlapping); 100-150 ran beside compute; 0-30 too
    assert [w.tolist() for w in waits] == [[ns(40)], [ns(95)]]
    assert pieces(0, ns(150), waits) == [(0, ns(40)), (ns(95), ns(150))]
    assert pieces(ns(50), ns(60), waits) == []
    assert pieces(ns(90), ns(120), waits) == [(ns(95), ns(120))]
    assert pieces(0, ns(10), blocked([], leaves)) == [(0, ns(10))]
