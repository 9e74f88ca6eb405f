"""A gloo trace's sends and receives get their peers: the pair groups, then the timing."""

from __future__ import annotations

import numpy as np

from producers.kineto.groups import ProcessGroup
from producers.kineto.peers import p2p_candidates, pick_peers

MS = 1_000_000
WORLD = ProcessGroup("0", "default_pg", (0, 1, 2, 3))
TP0 = ProcessGroup("1", "undefined", (0, 1))
DP0 = ProcessGroup("3", "undefined", (0, 2))


def test_p2p_goes_to_the_pair_groups_that_ran_no_collective():
    pp = ProcessGroup("9", "undefined", (0, 4))
    groups = (WORLD, TP0, DP0, pp)
    assert p2p_candidates(groups, {"1", "3"}) == (0, 4)
    assert p2p_candidates(groups, {"1", "3", "9"}) == ()  # the default group tells nothing


def test_a_send_goes_to_the_candidate_whose_receive_its_data_released():
    sends = np.array([True, True, False])
    start = np.array([10, 110, 150]) * MS
    end = np.array([11, 111, 160]) * MS
    posted = {  # rank 4 receives 2 ms after each send; rank 6 is busy elsewhere
        4: (np.array([False, False, True]), np.array([5, 100, 149]) * MS,
            np.array([12, 112, 150]) * MS),
        6: (np.array([False, False]), np.array([0, 90]) * MS, np.array([40, 140]) * MS),
    }
    assert pick_peers(0, sends, start, end, (0, 4, 6), posted).tolist() == [4, 4, 4]
    assert pick_peers(0, sends, start, end, (0, 5), {}).tolist() == [5, 5, 5]  # one pair
    assert pick_peers(0, sends, start, end, (0, 5, 7), {}).tolist() == [-1, -1, -1]


def test_a_rank_sends_to_the_few_peers_most_of_its_sends_pick():
    """A middle stage (rank 2) sends 20 activations on to rank 4; rank 6's receives (two
    stages away, released by rank 4's sends) end sooner after two of them than rank 4's.
    Picked one at a time those two would go to rank 6; rank 2 talks to rank 4."""
    t = np.arange(20) * 100 * MS
    sends = np.ones(20, dtype=bool)
    rank4 = (np.zeros(20, dtype=bool), t - 5 * MS, t + 3 * MS)  # receives 3 ms after each
    late = np.array([3, 11])
    rank6_end = t[late] + 1 * MS  # two of rank 6's receives end 1 ms after rank 2's post
    rank6 = (np.zeros(2, dtype=bool), rank6_end - 50 * MS, rank6_end)
    peers = pick_peers(2, sends, t, t + MS, (0, 2, 4, 6), {4: rank4, 6: rank6})
    assert peers.tolist() == [4] * 20
