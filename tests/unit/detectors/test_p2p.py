"""A p2p transfer as its receiver saw it, across node clocks (`detectors/p2p.py`, `clocks.py`)."""

import pytest

from detectors.features import step_features
from detectors.p2p import delivered
from detectors.testing import frame_of, rank_step

P2P = 2


def _delivered_ms(msgs):
    frame = frame_of(msgs)
    inst = step_features(frame).inst
    mine = inst.kind == P2P
    return (delivered(frame, inst)[0][mine] * 1e3).tolist(), (inst.transfer_s[mine] * 1e3).tolist()


def _offsets(msgs):
    frame = frame_of(msgs)
    return delivered(frame, step_features(frame).inst)[1].offset_ns.tolist()


def test_stages_joined_only_by_p2p_are_put_on_one_clock_by_their_round_trips():
    """Stage 0 on node a, stage 1 on node b, whose clock runs 7 ms ahead; no collective spans
    the two. A buffered send each way (0.01 ms), each received 4 ms after it was posted by a
    receiver that was there first. On the stamps as they are, one transfer took 11 ms and
    the other -3 ms; the quickest each way differ by twice the offset."""
    a = rank_step(0, "a", 0, [("p2p", "send", "pp.0", 1, 10.0, 0.01, 1 << 20),
                              ("p2p", "recv", "pp.0", 2, 12.0, 22.0, 1 << 20)])
    b = rank_step(1, "b", 0, [("p2p", "recv", "pp.0", 1, 7.0, 14.0, 1 << 20),
                              ("p2p", "send", "pp.0", 2, 37.0, 0.01, 1 << 20)])
    delivered, shortest = _delivered_ms([a, b])
    assert delivered == pytest.approx([4.0, 4.0])
    assert shortest == pytest.approx([0.01, 0.01])
    assert _offsets([a, b]) == pytest.approx([0, 7e6])


def test_a_blocking_send_and_a_data_that_waited_for_its_receiver_keep_the_shortest_copy():
    """Node b's clock 3 ms ahead, lined up by an all-reduce. Pair 1: the send blocks until
    its data is taken (both copies end together): the later poster's copy, 5 ms, is the
    transfer. Pair 2: the send was buffered and returned before its receiver posted; the data
    may have waited there for the receiver, whose 0.2 ms says nothing of what it took, and
    the shortest copy stays."""
    a = rank_step(0, "a", 0, [("p2p", "send", "pp.0", 1, 0.0, 15.0, 1 << 20),
                              ("p2p", "send", "pp.0", 2, 20.0, 0.01, 1 << 20),
                              ("coll", "all_reduce", "dp.0", 1, 40.0, 2.0, 8)])
    b = rank_step(1, "b", 0, [("p2p", "recv", "pp.0", 1, 13.0, 5.0, 1 << 20),
                              ("p2p", "recv", "pp.0", 2, 33.0, 0.2, 1 << 20),
                              ("coll", "all_reduce", "dp.0", 1, 44.0, 1.0, 8)])
    delivered, shortest = _delivered_ms([a, b])
    assert delivered == pytest.approx([5.0, 0.01])
    assert shortest == pytest.approx([5.0, 0.01])


def test_stages_joined_by_blocking_sends_are_lined_up_by_their_ends_whatever_each_way_takes():
    """The same two stages, node b's clock 7 ms ahead, with sends that block until their
    data is taken: a→b takes 10 ms, b→a 2 ms. The quickest each way would put b 11 ms ahead
    (half of 10 - 2 off); the copies of each pair end together, and that says 7."""
    a = rank_step(0, "a", 0, [("p2p", "send", "pp.0", 1, 10.0, 10.0, 1 << 20),
                              ("p2p", "recv", "pp.0", 2, 25.0, 7.0, 1 << 20)])
    b = rank_step(1, "b", 0, [("p2p", "recv", "pp.0", 1, 7.0, 20.0, 1 << 20),
                              ("p2p", "send", "pp.0", 2, 37.0, 2.0, 1 << 20)])
    assert _offsets([a, b]) == pytest.approx([0, 7e6])
    delivered, shortest = _delivered_ms([a, b])
    assert delivered == pytest.approx([10.0, 2.0])
    assert shortest == pytest.approx([10.0, 2.0])
