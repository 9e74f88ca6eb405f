"""What a culprit costs the job: the step replayed without its excess (issue #12)."""

import numpy as np
import pytest

from detectors.compute_suspects import compute_ratio
from detectors.features import step_features
from detectors.p2p import delivered
from detectors.peers import stage_keys
from detectors.testing import frame_of, rank_step
from detectors.whatif import UsualStep, job_cost


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


def test_an_excess_masked_by_another_culprit_costs_its_share_once_that_one_is_gone():
    """Four ranks: rank 3 computes 25 ms where its peers take 10, and rank 2 computes 15. The
    all-reduce waits for rank 3: without rank 2's excess alone the job is no faster; with
    rank 3 taken out of both replays (`masked_by`), rank 2's 5 ms are what it decides."""
    frame = _allreduce_step([10.0, 10.0, 15.0, 25.0])
    feats = step_features(frame)
    stages = stage_keys(frame)
    ratio = compute_ratio(frame, feats, stages)
    alone = job_cost(frame, feats, "gpu", "rank:2", ratio, stages)
    assert alone.slowdown == pytest.approx(1.0, abs=1e-3)
    latent = job_cost(frame, feats, "gpu", "rank:2", ratio, stages,
                      masked_by=(("gpu", "rank:3"),))
    # without rank 3: a 45 ms step (15 + 5 + 20 + 5); without both: 40 ms
    assert latent.slowdown == pytest.approx(45.0 / 40.0, rel=1e-3)


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


def test_a_nic_slow_one_way_costs_the_copy_that_waited_on_its_data():
    """Four pairs all-reduce across nodes three times, 5 ms each, computing 10 ms before
    the third, then everyone all-reduces once more. Node n3's NIC is slow only sending, and
    only during the second: its own copy ends after 5 ms, its partner's on n7 after 45, when
    n3's data arrives. Rank 7 computes late, its pair's third all-reduce waits on it, and so
    does everyone's last. The shortest copy says the slow transfer took 5 ms: replayed with
    every copy ending there, the step as it ran was 36 ms and the NIC cost nothing. The step
    took 76 ms and would have taken 36: the job loses 40 ms."""
    msgs = []
    for pair in range(4):
        for side in range(2):
            r = 2 * pair + side
            took = 45.0 if (pair, side) == (3, 1) else 5.0
            third = 70.0 if pair == 3 else 30.0  # the pair's later arrival at the third
            ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0),
                   ("coll", "all_reduce", f"dp.{pair}", 1, 10.0, 5.0, 1024),
                   ("coll", "all_reduce", f"dp.{pair}", 2, 15.0, took, 1024),
                   ("compute", "bwd", "", 0, 15.0 + took, 10.0, 0),
                   ("coll", "all_reduce", f"dp.{pair}", 3, 25.0 + took, third - 20.0 - took,
                    1024),
                   ("coll", "all_reduce", "world.0", 1, third + 5.0, 71.0 - third, 64)]
            msgs.append(rank_step(r, f"n{pair if side == 0 else pair + 4}", 0, ops))
    frame = frame_of(msgs)
    cost = _cost(frame, "link", "node:n3")
    assert cost.actual_s == pytest.approx(0.076)
    assert cost.lost_s == pytest.approx(0.040, abs=1e-3)
    # replayed as it ran, the step is the step as it ran: a NIC that carries none of the
    # slow transfers costs nothing
    assert _cost(frame, "link", "node:n1").lost_s == pytest.approx(0.0, abs=1e-5)


def _one_way_step(took_ms: float):
    """Four pairs all-reduce across nodes (n0-n3 with n4-n7), compute 10 ms, and all
    all-reduce. Node n3's NIC is slow only sending: its own copy of its pair's all-reduce
    ends after 5 ms, its partner's on n7 after `took_ms`."""
    msgs = []
    end = 26.0 + took_ms
    for pair in range(4):
        for side in range(2):
            took = took_ms if (pair, side) == (3, 1) else 5.0
            ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0),
                   ("coll", "all_reduce", f"dp.{pair}", 1, 10.0, took, 1024),
                   ("compute", "bwd", "", 0, 10.0 + took, 10.0, 0),
                   ("coll", "all_reduce", "world.0", 1, 20.0 + took, end - 20.0 - took, 64)]
            msgs.append(rank_step(2 * pair + side, f"n{pair if side == 0 else pair + 4}", 0,
                                  ops))
    return frame_of(msgs)


def test_node_clocks_come_from_the_healthy_steps_when_a_nic_is_slow_one_way():
    """The slow pair's all-reduce is its group's only instance: lining up its copies' ends
    reads n7's clock 40 ms off n3's, and the step replayed on those clocks prices the NIC
    at 30 ms where the job lost 40. The healthy steps read the clocks as they are."""
    frame = _one_way_step(45.0)
    feats = step_features(frame)
    stages = stage_keys(frame)
    ratio = compute_ratio(frame, feats, stages)
    alone = job_cost(frame, feats, "link", "node:n3", ratio, stages)
    assert alone.actual_s == pytest.approx(0.071)
    assert abs(alone.lost_s - 0.040) > 0.005  # the step's own clocks are off
    usual = UsualStep()
    healthy = _one_way_step(5.0)
    assert usual.clocks_of(healthy) is None  # nothing read yet
    for _ in range(3):
        usual.learn_clocks(healthy, step_features(healthy))
    assert usual.clocks_of(frame) == pytest.approx(np.zeros(8), abs=1e3)
    cost = job_cost(frame, feats, "link", "node:n3", ratio, stages, history=usual)
    assert cost.lost_s == pytest.approx(0.040, abs=1e-3)


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


def test_node_clocks_are_lined_up_before_the_replay():
    """Node n0's clock runs 8 ms ahead: its rank seems to begin 8 ms late and to arrive last
    at the all-reduce, which would hide most of rank 2's excess. The nodes' offsets are read
    off the all-reduce's copies, which all end together, and the cost is the unskewed one."""
    skew_ms = [8.0, -3.0, 1.0]
    msgs = []
    compute = [10.0, 10.0, 25.0]
    end1 = max(compute) + 5.0
    for r, c in enumerate(compute):
        ops = [("compute", "fwd", "", 0, 0.0, c, 0),
               ("coll", "all_reduce", "dp.0", 1, c, end1 - c, 1024),
               ("compute", "bwd", "", 0, end1, 20.0, 0),
               ("coll", "all_reduce", "dp.0", 2, end1 + 20.0, 5.0, 1024)]
        msgs.append(rank_step(r, f"n{r}", 0, ops, t0_ns=10**18 + round(skew_ms[r] * 1e6)))
    frame = frame_of(msgs)
    offsets = delivered(frame, step_features(frame).inst)[1].offset_ns
    by_node = dict(zip(frame.nodes, offsets.tolist(), strict=True))
    mean = sum(skew_ms) / 3
    for r in range(3):
        assert by_node[f"n{r}"] == pytest.approx((skew_ms[r] - mean) * 1e6, abs=1e3)
    cost = _cost(frame, "gpu", "rank:2")
    assert cost.lost_s == pytest.approx(0.015, abs=1e-4)


def _chained_step(step, t0_ms, bwd_ms):
    """Two ranks: forward 10 ms, all-reduce (5 ms of transfer), backward `bwd_ms`; each
    begins at `t0_ms` (when it ended the step before) and nothing syncs them after."""
    msgs = []
    arrive = [t0 + 10.0 for t0 in t0_ms]
    end1 = max(arrive) + 5.0
    for r in range(2):
        ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0),
               ("coll", "all_reduce", "dp.0", step, 10.0, end1 - arrive[r], 1024),
               ("compute", "bwd", "", 0, end1 - t0_ms[r], bwd_ms[r], 0)]
        msgs.append(rank_step(r, f"n{r}", step, ops, t0_ns=10**18 + round(t0_ms[r] * 1e6)))
    return frame_of(msgs)


def test_a_rank_begins_the_next_step_when_it_ended_the_last_in_its_what_if():
    """Rank 1's backward takes 30 ms instead of 10, so it ends each step 20 ms after rank 0
    and begins the next one 20 ms late; rank 0 then waits for it at the all-reduce. Without
    rank 1's excess both would have begun the second step together: 25 ms, not 45."""
    history = UsualStep()
    first = _chained_step(1, [0.0, 0.0], [10.0, 30.0])
    second = _chained_step(2, [25.0, 45.0], [10.0, 30.0])
    costs = []
    for frame in (first, second):
        feats = step_features(frame)
        stages = stage_keys(frame)
        costs.append(job_cost(frame, feats, "gpu", "rank:1",
                              compute_ratio(frame, feats, stages), stages, history=history))
    assert costs[0].lost_s == pytest.approx(0.010, abs=1e-4)  # median of 25 and 45 ms: 35
    assert costs[1].actual_s == pytest.approx(0.045)
    assert costs[1].without_s == pytest.approx(0.025, abs=1e-4)
    # priced alone, the second step keeps the stagger rank 1 began it with
    assert _cost(second, "gpu", "rank:1").lost_s == pytest.approx(0.010, abs=1e-4)


def test_the_first_step_priced_begins_as_usual_where_the_fault_delayed_its_start():
    """The step before the incident was not priced, but rank 1's excess was there already:
    rank 1 begins 20 ms later than it usually does (healthy steps begin together), as late
    as this step's what-if ends it early. Taken for the step before's, that lead puts both
    ranks back at the usual start: 25 ms without rank 1's excess, not 35."""
    history = UsualStep()
    for step in range(3):
        history.update_starts(_chained_step(step, [25.0 * step] * 2, [10.0, 10.0]))
    frame = _chained_step(3, [75.0, 95.0], [10.0, 30.0])
    feats = step_features(frame)
    stages = stage_keys(frame)
    cost = job_cost(frame, feats, "gpu", "rank:1", compute_ratio(frame, feats, stages), stages,
                    history=history)
    assert cost.actual_s == pytest.approx(0.045)
    assert cost.without_s == pytest.approx(0.025, abs=1e-4)


def test_an_untraced_rank_that_waited_on_a_traced_culprit_is_early_without_it():
    """Rank 0 (traced) computes 30 ms instead of its peers' 10, then sends to an untraced
    rank, which computes 10 ms and sends on to rank 1 (traced): rank 1's recv waits 35 ms
    for it, and every rank waits for rank 1 at the final all-reduce. Without rank 0's excess
    the untraced rank would have sent 20 ms earlier (it waited on rank 0); held to the time
    it sent, it would hide the whole cost. Ranks 2-5 receive on time from untraced senders
    (5 ms, the typical transfer); ranks 6-7, rank 0's stage peers, send on time to untraced
    receivers."""
    chains = {0: [("compute", "fwd", "", 0, 0.0, 30.0, 0),
                  ("p2p", "send", "pp.0", 1, 30.0, 5.0, 64)],
              1: [("compute", "fwd", "", 0, 0.0, 10.0, 0),
                  ("p2p", "recv", "pp.1", 1, 10.0, 40.0, 64)]}
    for r in range(2, 6):
        chains[r] = [("compute", "fwd", "", 0, 0.0, 10.0, 0),
                     ("p2p", "recv", f"pp.{r}", 1, 10.0, 5.0, 64)]
    for r in (6, 7):
        chains[r] = [("compute", "fwd", "", 0, 0.0, 10.0, 0),
                     ("p2p", "send", f"pp.{r}", 1, 10.0, 5.0, 64)]
    msgs = []
    for r, ops in chains.items():
        last = ops[-1][4] + ops[-1][5]
        ops = [*ops, ("coll", "all_reduce", "dp.0", 1, last, 55.0 - last, 1024)]
        msgs.append(rank_step(r, f"n{r}", 0, ops))
    cost = _cost(frame_of(msgs), "gpu", "rank:0", group_size={"pp": 2, "dp": 8})
    assert cost.actual_s == pytest.approx(0.055)
    assert cost.lost_s == pytest.approx(0.020, abs=1e-4)


def test_a_slow_node_is_made_typical_for_its_data_replica_s_load():
    """Three data replicas × two pipeline stages, one rank per node. This step replica 1 has
    20% more tokens: its stage-1 rank computes 12 ms where the others compute 10. Its
    stage-0 node is slow (18 ms). Without the fault it would have computed 12 ms, not its
    stage peers' 10: the all-reduce of stage 0 would have ended at 17 ms, as stage 1's did."""
    msgs = []
    compute = {(0, 0): 10.0, (0, 1): 18.0, (0, 2): 10.0, (1, 0): 10.0, (1, 1): 12.0,
               (1, 2): 10.0}
    for (pp, dp), c in compute.items():
        end = max(v for (p, _), v in compute.items() if p == pp) + 5.0
        ops = [("compute", "fwd", "", 0, 0.0, c, 0),
               ("coll", "all_reduce", f"dp.{pp}", 1, c, end - c, 1024)]
        r = 3 * pp + dp
        msgs.append(rank_step(r, f"n{r}", 0, ops, coords={"pp": pp, "dp": dp, "tp": 0}))
    frame = frame_of(msgs)
    cost = _cost(frame, "node", "node:n1")
    assert cost.actual_s == pytest.approx(0.020)  # median of 23 ms × 3 and 17 ms × 3
    assert cost.without_s == pytest.approx(0.017, abs=1e-4)


def test_a_slow_nic_on_a_p2p_transfer_whose_other_end_is_not_traced():
    """Rank 0's recv from an untraced sender takes 20 ms through node n0's slow NIC where a
    transfer takes 5 ms (three fully traced pairs show it), and the job waits for rank 0 at
    the final all-reduce. Ranks 8-10 wait 12 ms for their untraced senders early in the
    step, off the critical path: taken for the typical recv, their waits would hide rank 0's
    excess (its recv would look like a transfer). Without the slow NIC the step takes 30 ms."""
    p2p = {0: ("recv", "pp.0", 20.0), 1: ("recv", "pp.4", 5.0)}  # (op, group, duration)
    for r in range(2, 8):  # three fully traced pairs: 2 → 3, 4 → 5, 6 → 7
        p2p[r] = ("send" if r % 2 == 0 else "recv", f"pp.{r // 2}", 5.0)
    msgs = []
    for r, (op, group, dur) in p2p.items():
        end = 10.0 + dur
        msgs.append(rank_step(r, f"n{r}", 0, [
            ("compute", "fwd", "", 0, 0.0, 10.0, 0),
            ("p2p", op, group, 1, 10.0, dur, 64),
            ("compute", "bwd", "", 0, end, 10.0, 0),
            ("coll", "all_reduce", "world.0", 1, end + 10.0, 35.0 - end, 8)]))
    for r in (8, 9, 10):
        msgs.append(rank_step(r, f"n{r}", 0, [
            ("p2p", "recv", f"pp.{r - 3}", 1, 0.0, 12.0, 64),
            ("compute", "bwd", "", 0, 12.0, 10.0, 0),
            ("coll", "all_reduce", "world.0", 1, 22.0, 23.0, 8)]))
    cost = _cost(frame_of(msgs), "link", "node:n0", group_size={"pp": 2})
    assert cost.actual_s == pytest.approx(0.045)
    assert cost.without_s == pytest.approx(0.030, abs=1e-4)


def test_a_slow_nic_under_a_buffered_send_costs_what_its_data_took():
    """Four pipeline pairs; each sender's send is buffered (its copy 0.01 ms) and its
    receiver, posted first, gets the data 5 ms later, but 45 ms later through node s3's slow
    NIC, then computes 10 ms before everyone all-reduces. The shortest copy says the slow
    pair's transfer took 0.01 ms and its receiver waited on its sender: priced from it, the
    NIC cost nothing. The data took 45 ms where it takes 5: the job loses 40 ms."""
    msgs = []
    for pair in range(4):
        took = 45.0 if pair == 3 else 5.0
        end = 66.0  # the slow pair's receiver arrives at 65, then a 1 ms all-reduce
        msgs.append(rank_step(2 * pair, f"s{pair}", 0, [
            ("compute", "fwd", "", 0, 0.0, 10.0, 0),
            ("p2p", "send", f"pp.{pair}", 1, 10.0, 0.01, 1 << 20),
            ("coll", "all_reduce", "world.0", 1, 10.01, end - 10.01, 8)]))
        msgs.append(rank_step(2 * pair + 1, f"r{pair}", 0, [
            ("p2p", "recv", f"pp.{pair}", 1, 0.0, 10.0 + took, 1 << 20),
            ("compute", "fwd", "", 0, 10.0 + took, 10.0, 0),
            ("coll", "all_reduce", "world.0", 1, 20.0 + took, end - 20.0 - took, 8)]))
    frame = frame_of(msgs)
    cost = _cost(frame, "link", "node:s3")
    assert cost.actual_s == pytest.approx(0.066)
    assert cost.lost_s == pytest.approx(0.040, abs=1e-3)
    assert _cost(frame, "link", "node:s1").lost_s == pytest.approx(0.0, abs=1e-5)


def test_a_deep_pipeline_is_replayed_to_its_end():
    """Two data replicas of a 12-stage pipeline, one rank per stage and node: each stage
    receives, computes 10 ms and sends (2 ms), and then every rank all-reduces (3 ms). The
    slow GPU (replica 0, stage 0) computes 30 ms; everything after it in its replica waits,
    and so does the all-reduce. The chain of waits is 24 ops long, more than a replay that
    moves a change one op per round settles in twice a rank's ops (the rounds of a replay
    that priced a slow GPU at 1,024 GPUs at a third of its cost): without the slow GPU the
    step ends 20 ms earlier."""
    stages, ranks, finish = 12, [], 0.0
    for dp in range(2):
        ready = 0.0  # when the stage's input arrives
        for pp in range(stages):
            fwd = 30.0 if (dp, pp) == (0, 0) else 10.0
            ops = [] if pp == 0 else [("p2p", "recv", f"pp.{dp}-{pp}", 1, 0.0, ready, 64)]
            ops.append(("compute", "fwd", "", 0, ready, fwd, 0))
            ready += fwd
            if pp < stages - 1:
                ops.append(("p2p", "send", f"pp.{dp}-{pp + 1}", 1, ready, 2.0, 64))
                ready += 2.0
            ranks.append((dp * stages + pp, {"pp": pp, "dp": dp, "tp": 0}, ops, ready))
            finish = max(finish, ready + 3.0)
    frame = frame_of([
        rank_step(r, f"n{r}", 0, [*ops, ("coll", "all_reduce", "world.0", 1, done,
                                         finish - done, 1024)], coords=coords)
        for r, coords, ops, done in ranks])
    cost = _cost(frame, "gpu", "rank:0", group_size={"pp": 2, "world": 24})
    assert cost.actual_s == pytest.approx(finish / 1e3)
    assert cost.lost_s == pytest.approx(0.020, abs=1e-4)
