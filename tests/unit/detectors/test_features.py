"""The physics of one step: who waited for whom, compute vs transfer vs idle gaps."""

import numpy as np
import pytest

from detectors.features import step_features
from detectors.testing import frame_of, rank_step


def _tp_step(slow_rank: int, slow_ms: float = 30.0, gap_rank: int | None = None):
    """4 ranks on 2 nodes: compute, then a tp all_reduce that ends at last arrival + 5 ms."""
    msgs = []
    comp = {r: 10.0 + (slow_ms if r == slow_rank else 0.0) for r in range(4)}
    gap = {r: (7.0 if r == gap_rank else 0.0) for r in range(4)}
    arrive = {r: gap[r] + comp[r] for r in range(4)}
    end = max(arrive.values()) + 5.0
    for r in range(4):
        msgs.append(
            rank_step(
                r,
                f"n{r // 2}",
                0,
                [
                    ("compute", "fwd", "", 0, gap[r], comp[r], 0),
                    ("coll", "all_reduce", "tp.0", 7, arrive[r], end - arrive[r], 1024),
                ],
            )
        )
    return frame_of(msgs)


def test_slow_rank_has_short_copy_and_causes_the_wait():
    f = _tp_step(slow_rank=2)
    feats = step_features(f)
    inst = feats.inst
    assert inst.transfer_s.tolist() == pytest.approx([0.005])
    assert np.argmax(feats.caused_wait_s) == 2
    assert feats.wait_s[2] == pytest.approx(0.0)
    assert feats.wait_s[0] == pytest.approx(0.030)
    assert feats.compute_s[2] == pytest.approx(0.040)
    assert inst.cross_node.tolist() == [True]


def test_idle_gap_is_measured_apart_from_compute():
    f = _tp_step(slow_rank=-1, gap_rank=1)
    feats = step_features(f)
    assert feats.gap_s[1] == pytest.approx(0.007)
    assert feats.gap_s[0] == pytest.approx(0.0)
    assert feats.compute_s[1] == pytest.approx(0.010)


def test_overlapping_ops_are_not_counted_twice_as_busy():
    m = rank_step(
        0,
        "n0",
        0,
        [
            ("compute", "fwd", "", 0, 0.0, 10.0, 0),
            ("p2p", "send", "pp.0-1", 1, 5.0, 10.0, 8),
            ("compute", "bwd", "", 1, 20.0, 5.0, 0),
        ],
    )
    feats = step_features(frame_of([m]))
    assert feats.span_s[0] == pytest.approx(0.025)
    assert feats.gap_s[0] == pytest.approx(0.005)


def test_each_groups_seq_range_is_its_first_and_last_seq() -> None:
    """Against a plain per-group scan, on codes with gaps (groups absent from the step)."""
    from detectors.features import _seq_range

    rng = np.random.default_rng(3)
    group = rng.integers(0, 40, 5000).astype(np.int32) * 2  # odd codes never appear
    seq = rng.integers(-5, 10**12, 5000)
    gmin, gmax = _seq_range(group, seq, 81)
    for g in range(81):
        mine = seq[group == g]
        if mine.size:
            assert (gmin[g], gmax[g]) == (mine.min(), mine.max())
        else:
            assert gmin[g] == np.iinfo(np.int64).max and gmax[g] == np.iinfo(np.int64).min
