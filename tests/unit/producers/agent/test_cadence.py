"""The heartbeat cadence: the agent's per-rank rule on a fake clock, its checks, and the grid
form the simulator uses."""

from __future__ import annotations

import numpy as np
import pytest

from producers.agent.cadence import (
    KEEPALIVE_S,
    LONG_OP_S,
    MIN_HANG_TIMEOUT_S,
    Cadence,
    GridCadence,
    RankBeat,
)
from schemas.testing import FakeClock
from schemas.wire import InflightOp


def op(group: str, seq: int, start_ns: int) -> InflightOp:
    return InflightOp(group=group, name="all_reduce", seq=seq, start_ns=start_ns)


def test_first_sample_then_only_long_op_changes_and_keepalives():
    clock = FakeClock()
    cadence = Cadence(interval_s=1.0, keepalive_s=5.0, long_op_s=1.0)
    beat = RankBeat()

    def sample(*ops: InflightOp) -> bool:
        clock.advance(1.0)
        return cadence.sample(beat, ops, clock())

    assert sample()  # (a) the first sample
    assert not sample(op("dp.0", 0, clock() + 500_000_000))  # a short op: quiet
    assert [sample() for _ in range(4)] == [False, False, False, True]  # (c) 5 s after the first
    t0 = clock() + 200_000_000
    assert not sample(op("dp.0", 6, t0))  # 0.8 s old: still short
    young = op("tp.0", 9, clock() + 500_000_000)
    assert sample(op("dp.0", 6, t0), young)  # (b) 1.8 s: long (the young op does not count)
    assert not sample(op("dp.0", 6, t0))  # the same long set: quiet
    assert sample()  # (b) the long op ended


def test_keepalive_is_due_half_an_interval_early():
    cadence = Cadence(interval_s=1.0, keepalive_s=5.0)
    assert cadence.keepalive_ns == 4_500_000_000 and cadence.long_ns == 3_000_000_000
    beat = RankBeat()
    assert cadence.sample(beat, [], 0)
    assert not cadence.sample(beat, [], 4_499_999_999)
    assert cadence.sample(beat, [], 4_500_000_000)  # a late timer does not cost a sample


def test_the_defaults_leave_room_below_the_hang_timeout():
    assert KEEPALIVE_S + LONG_OP_S < MIN_HANG_TIMEOUT_S
    assert Cadence() == Cadence(keepalive_s=KEEPALIVE_S, long_op_s=LONG_OP_S)


@pytest.mark.parametrize("kw, match", [
    ({"keepalive_s": 9.5}, "below the 10 s hang timeout"),
    ({"keepalive_s": 4.0, "long_op_s": 6.0}, "below the 10 s hang timeout"),
    ({"interval_s": 2.0, "keepalive_s": 1.0}, "must be >= interval_s"),
    ({"interval_s": 0.0}, "interval_s must be > 0"),
    ({"long_op_s": float("nan")}, "finite number"),
])
def test_invalid_cadence_says_why(kw, match):
    with pytest.raises(ValueError, match=match):
        Cadence(**kw)


def test_grid_cadence_publishes_first_samples_changes_and_every_kth_sample():
    grid = GridCadence.fresh(world=2, period=1.0, keepalive=3.0, long_op=2.0)
    assert grid.every == 3 and grid.long_ns == 2.0
    # rank 0: samples 0..5 of its grid, a long op (dp 7, seq 1) at samples 2 and 3;
    # rank 1: samples 0..2, no long op
    rank = np.array([0] * 6 + [1] * 3)
    n = np.array([0, 1, 2, 3, 4, 5, 0, 1, 2])
    cnt = np.array([6, 3])
    long_g = np.array([-1, -1, 7, 7, -1, -1, -1, -1, -1])
    long_s = np.array([-1, -1, 1, 1, -1, -1, -1, -1, -1])
    keep = grid.select(rank, n, cnt, long_g, long_s)
    # rank 0: first, became long, ended, keepalives at n % 3 == 0; rank 1 (offset by its
    # rank): first, keepalive at (n + 1) % 3 == 0
    assert keep.tolist() == [True, False, True, True, True, False, True, False, True]
    # the state carries over: the next step's first sample compares with the last one
    assert grid.group.tolist() == [-1, -1] and grid.seq.tolist() == [-1, -1]
    again = grid.select(np.array([0]), np.array([7]), np.array([1, 0]), np.array([-1]),
                        np.array([-1]))
    assert again.tolist() == [False]
