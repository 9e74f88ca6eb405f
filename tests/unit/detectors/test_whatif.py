"""What a culprit costs the job: the step replayed without its excess (issue #12)."""

import numpy as np
import pytest

from detectors.compute_suspects import compute_ratio
from detectors.features import step_features
from detectors.peers import stage_keys
from detectors.testing import frame_of, rank_step
from detectors.whatif import job_cost


def _cost(frame, kind, entity, group_size=None, switch_of=None):
    feats = step_features(frame)
    stages = stage_keys(frame)
    return job_cost(frame, feats, kind, entity, compute_ratio(frame, feats, stages), stages,
                    group_size, switch_of)


def _allreduce_step(compute_ms, gap_ms=None, transfer_ms=5.0, after_ms=20.0, nodes=None):
    """Each rank waits `gap`, computes, all-reduces (ends at the last arrival + transfer),
    computes `after_ms` and all-reduces again."""
    n = len(compute_ms)
    gap_ms = gap_ms or [0.0] * n
    arrive = [g + c for g, c in zip(gap_ms, compute_ms, strict=True)]
    end1 = max(arrive) + transfer_ms
    msgs = []
    for r in range(n):
        ops = [("compute", "fwd", "", 0, gap_ms[r], compute_ms[r], 0),
               ("coll", "all_reduce", "dp.0", 1, arrive[r], end1 - arrive[r], 1024),
               ("compute", "bwd", "", 0, end1, after_ms, 0),
               ("coll", "all_reduce", "dp.0", 2, end1 + after_ms, transfer_ms, 1024)]
        msgs.append(rank_step(r, (nodes or [f"n{i}" for i in range(n)])[r], 0, ops))
    return frame_of(msgs)


def test_a_slow_gpu_costs_the_wait_it_imposes_on_everyone():
    frame = _allreduce_step([10.0, 10.0, 25.0])
    cost = _cost(frame, "gpu", "rank:2")
    assert cost.actual_s == pytest.approx(0.055)
    assert cost.without_s == pytest.approx(0.040, abs=1e-4)
    assert cost.lost_s == pytest.approx(0.015, abs=1e-4)


def test_slack_absorbs_an_excess_that_is_off_the_critical_path():
    """Rank 2 computes 4 ms more than its peers, but rank 0 waits 20 ms for data before it
    computes: the all-reduce waits for rank 0 anyway, and rank 2's excess costs nothing."""
    frame = _allreduce_step([10.0, 10.0, 14.0], gap_ms=[20.0, 0.0, 0.0])
    cost = _cost(frame, "gpu", "rank:2")
    assert cost.lost_s == pytest.approx(0.0, abs=1e-5)
    assert cost.slowdown == pytest.approx(1.0, abs=1e-3)


def test_a_slow_nic_costs_its_transfers_beyond_the_typical_ones():
    """Four pairs all-reduce across nodes with 5 ms transfers; node n3's pair takes 25 ms.
    Every rank then waits for the next all-reduce, which n3 holds up by 20 ms."""
    msgs = []
    for pair in range(4):
        for side in range(2):
            r = 2 * pair + side
            t = 25.0 if pair == 3 else 5.0
            ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0),
                   ("coll", "all_reduce", f"dp.{pair}", 1, 10.0, t, 1024),
                   ("coll", "all_reduce", "world.0", 1, 10.0 + t, 35.0 - t, 64)]
            msgs.append(rank_step(r, f"n{pair if side == 0 else pair + 4}", 0, ops))
    frame = frame_of(msgs)
    cost = _cost(frame, "link", "node:n3")
    assert cost.lost_s == pytest.approx(0.020, abs=1e-3)
    # a NIC that carries none of the slow transfers costs nothing
    assert _cost(frame, "link", "node:n1").lost_s == pytest.approx(0.0, abs=1e-5)


def test_an_untraced_culprit_costs_the_waits_of_the_traced_members_on_it():
    """Four tp groups of 2, one rank of each traced; rank 1 (untraced) arrives 30 ms late
    to tp.0, so rank 0's copy lasts 35 ms where the others' last 5, and the data-parallel
    all-reduce of the traced ranks that follows waits for rank 0."""
    msgs = []
    for r in (0, 2, 4, 6):
        t = 35.0 if r == 0 else 5.0
        msgs.append(rank_step(r, f"n{r // 2}", 0, [
            ("compute", "fwd", "", 0, 0.0, 10.0, 0),
            ("coll", "all_reduce", f"tp.{r // 2}", 1, 10.0, t, 1024),
            ("coll", "all_reduce", "dp.0", 1, 10.0 + t, 40.0 - t, 4096)]))
    frame = frame_of(msgs)
    sizes = {"tp": 2, "dp": 4}
    cost = _cost(frame, "gpu", "rank:1", group_size=sizes)
    assert cost.actual_s == pytest.approx(0.050)
    assert cost.lost_s == pytest.approx(0.030, abs=1e-4)
    # a traced rank is not what its peers wait for: making it typical changes nothing
    assert _cost(frame, "gpu", "rank:2", group_size=sizes).lost_s == pytest.approx(0.0, abs=1e-5)


def test_async_work_stays_overlapped_in_the_replay():
    """A gradient all-reduce runs on a comm stream under the next 30 ms of compute: replayed
    as it ran, the step keeps its length (the ops are not serialized)."""
    msgs = []
    for r in range(2):
        ops = [("compute", "bwd", "", 0, 0.0, 10.0, 0),
               ("coll", "all_reduce", "dp.0", 1, 10.0, 20.0, 1024),
               ("compute", "bwd", "", 0, 10.0, 30.0, 0),
               ("compute", "optimizer", "", 0, 40.0, 5.0, 0)]
        msgs.append(rank_step(r, f"n{r}", 0, ops))
    frame = frame_of(msgs)
    cost = _cost(frame, "gpu", "rank:1")
    assert cost.actual_s == pytest.approx(0.045)
    assert cost.without_s == pytest.approx(0.045, abs=1e-5)


def test_no_ops_no_cost():
    frame = frame_of([rank_step(r, "n0", 0, []) for r in range(2)])
    cost = _cost(frame, "gpu", "rank:0")
    assert cost.lost_s == 0.0 and cost.slowdown == 1.0
    assert np.isfinite(cost.actual_s)
