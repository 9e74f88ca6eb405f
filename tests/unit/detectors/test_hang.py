"""Hangs from heartbeats: the member missing from a stuck collective is the culprit."""

import numpy as np

from detectors.hang import HangDetector
from schemas.wire import HeartbeatV1, InflightOp

S = 1_000_000_000


def hb(rank: int, ts_s: float, inflight=(), step: int = 7) -> HeartbeatV1:
    return HeartbeatV1(
        v=1,
        job="j",
        rank=rank,
        node=f"n{rank // 2}",
        ts_ns=int(ts_s * S),
        step=step,
        inflight=[
            InflightOp(group=g, name=n, seq=q, start_ns=int(t * S)) for g, n, q, t in inflight
        ],
    )


def test_rank_missing_from_stuck_collective_is_named_following_waits_for_chain():
    d = HangDetector(timeout_s=10)
    d.learn_members("tp.0", {0, 1, 2, 3})
    d.learn_members("dp.0", {0, 4})
    for t in range(0, 30):
        d.observe(hb(0, t, [("tp.0", "all_reduce", 40, 1.0)]))
        d.observe(hb(1, t, [("tp.0", "all_reduce", 40, 1.0)]))
        d.observe(hb(3, t, [("tp.0", "all_reduce", 40, 1.2)]))
        d.observe(hb(2, t))  # alive, computing forever
        d.observe(hb(4, t, [("dp.0", "all_reduce", 9, 2.0)]))  # waits for rank 0 in dp
    assert d.check(int(5 * S)) is None  # not yet past the timeout
    f = d.check(int(20 * S))
    assert f is not None
    assert f.culprit == "rank:2"
    assert f.onset_step == 7
    assert "rank 2" in f.summary and "tp.0" in f.summary


def test_all_members_in_flight_is_a_communication_hang():
    d = HangDetector(timeout_s=5)
    d.learn_members("dp.3", {0, 1})
    for t in range(12):
        d.observe(hb(0, t, [("dp.3", "reduce_scatter", 5, 0.5)]))
        d.observe(hb(1, t, [("dp.3", "reduce_scatter", 5, 0.7)]))
    f = d.check(int(12 * S))
    assert f is not None and f.culprit == "group:dp.3"


def test_ops_that_finish_in_time_are_no_hang():
    d = HangDetector(timeout_s=5)
    d.learn_members("tp.0", {0, 1})
    for t in range(20):
        d.observe(hb(0, t, [("tp.0", "all_reduce", t, t - 0.1)]))
        d.observe(hb(1, t, [("tp.0", "all_reduce", t, t - 0.2)]))
    assert d.check(int(20 * S)) is None


def test_a_recv_that_crosses_the_timeout_first_does_not_steal_the_blame():
    """A pp recv started just before a dp collective hung: it is stuck first, but its peer is
    itself inside the hung collective. The full group is the answer once it crosses too."""
    d = HangDetector(timeout_s=10)
    d.learn_members("dp.0", {0, 1})
    d.learn_members("pp.0", {1, 2})
    for t in range(25):
        d.observe(hb(0, t, [("dp.0", "all_reduce", 3, 1.5)]))
        d.observe(hb(1, t, [("dp.0", "all_reduce", 3, 1.5)]))
        d.observe(hb(2, t, [("pp.0", "recv", 8, 1.0)]))  # waits for rank 1, busy in dp.0
    assert d.check(int(11.2 * S)) is None  # only the recv is past the timeout: wait
    f = d.check(int(12.5 * S))
    assert f is not None and f.culprit == "group:dp.0"


def test_a_partial_group_is_blamed_when_no_full_one_ever_appears():
    d = HangDetector(timeout_s=5)
    d.learn_members("pp.0", {0, 1})
    d.learn_members("pp.1", {1, 0})
    for t in range(20):  # a p2p deadlock: each waits in a different group
        d.observe(hb(0, t, [("pp.0", "send", 4, 1.0)]))
        d.observe(hb(1, t, [("pp.1", "send", 6, 1.0)]))
    assert d.check(int(8 * S)) is None
    f = d.check(int(12 * S))
    assert f is not None and f.culprit in ("group:pp.0", "group:pp.1")


def test_an_idle_stopped_rank_is_placed_in_the_step_after_its_last_finished_one():
    # rank 1's newest heartbeat (a keepalive, before it finished step 7) still says step 7;
    # its step message for 7 was read since: it stopped in step 8, where its peers wait
    d = HangDetector(timeout_s=10)
    d.learn_members("tp.0", {0, 1})
    d.observe(hb(1, 0, step=7))
    d.steps_done(np.array([0, 1]), 7, np.array([0, 0]))
    for t in range(1, 15):
        d.observe(hb(0, t, [("tp.0", "all_reduce", 80, 1.0)], step=8))
    f = d.check(int(14 * S))
    assert f is not None and f.culprit == "rank:1"
    assert f.onset_step == 8 and "stopped in step 8" in f.summary, f.summary
    d.steps_done(np.array([3]), 2, np.array([0]))  # a rank never seen before grows the table
    assert d.done.tolist() == [7, 7, -1, 2]


def _straggler_job(d: HangDetector, seconds: int) -> None:
    """Rank 2 computes 20× slower but lives: ranks 0, 1 and 3 (its tp.0 peers) enter a new
    all_reduce with it every 2 s; rank 4 waits for rank 0's replica in one dp.0 all_reduce."""
    d.learn_members("tp.0", {0, 1, 2, 3})
    d.learn_members("dp.0", {0, 4})
    for t in range(seconds):
        seq = 100 + t // 2
        for r in (0, 1, 3):
            d.observe(hb(r, t, [("tp.0", "all_reduce", seq, float(t - t % 2))]))
        d.observe(hb(2, t))  # computing: its own state never changes
        d.observe(hb(4, t, [("dp.0", "all_reduce", 9, 0.0)]))


def test_waits_on_a_slow_but_alive_straggler_are_not_a_hang():
    d = HangDetector(timeout_s=10)
    _straggler_job(d, 60)
    assert d.check(int(59 * S)) is None  # rank 4 waits 59 s, but rank 2's peers progress


def test_when_the_straggler_stops_its_peers_stop_too_and_the_hang_is_named():
    d = HangDetector(timeout_s=10)
    _straggler_job(d, 30)
    for t in range(30, 60):  # rank 2 stopped at 30 s: its peers sit in the same all_reduce
        for r in (0, 1, 3):
            d.observe(hb(r, t, [("tp.0", "all_reduce", 115, 30.0)]))
        d.observe(hb(2, t))
        d.observe(hb(4, t, [("dp.0", "all_reduce", 9, 0.0)]))
    assert d.check(int(38 * S)) is None  # the peers moved 8 s ago: within the timeout
    f = d.check(int(45 * S))
    assert f is not None and f.culprit == "rank:2"


def test_a_finished_step_is_progress():
    d = HangDetector(timeout_s=10)
    d.learn_members("pp.0", {0, 1})
    for t in range(40):  # rank 0 waits in a recv; rank 1 never shows an op but finishes steps
        d.observe(hb(0, t, [("pp.0", "recv", 3, 0.0)]))
        d.observe(hb(1, t))
        if t % 8 == 7:
            d.steps_done(np.array([1]), t // 8, np.array([t * S]))
    assert d.check(int(39 * S)) is None


def test_a_hang_on_an_untraced_member_names_the_traced_members_node_not_a_group_of_one():
    # one rank per TP group traced (tp = 4 by the layout): rank 0 of tp.0 waits in its
    # all_reduce; the member it waits for reports nothing at all
    d = HangDetector(timeout_s=10)
    d.learn_layout({"tp": 4, "dp": 2})
    d.learn_members("tp.0", {0})
    for t in range(30):
        d.observe(hb(0, t, [("tp.0", "all_reduce", 40, 1.0)]))
    f = d.check(int(29 * S))
    assert f is not None
    assert f.culprit == "node:n0", f.culprit
    assert "not traced" in f.summary and "all 1 members" not in f.summary


def test_a_hang_in_a_group_across_nodes_names_the_dark_node_when_it_holds_every_untraced_rank():
    # dp.0 spans nodes; its member on a node whose agent is down never arrives
    def stuck_in_dp(home):
        d = HangDetector(timeout_s=10)
        d.learn_layout({"dp": 3})
        d.learn_members("dp.0", {0, 2})
        d.untraced_home = home
        for t in range(30):
            for r in (0, 2):
                d.observe(hb(r, t, [("dp.0", "reduce_scatter", 40, 1.0)]))
        return d.check(int(29 * S))

    f = stuck_in_dp("n9")
    assert f is not None and f.culprit == "node:n9", f.culprit
    assert "not traced on n9" in f.summary
    f = stuck_in_dp(None)  # the untraced member may be on any node: the group is named
    assert f is not None and f.culprit == "group:dp.0", f.culprit


def test_a_stopped_replica_is_named_by_its_tensor_parallel_group_not_a_group_across_nodes():
    # half tracing: tp.0 (ranks 0, 1 on n0, two untraced) waits on a GPU that stopped; the
    # dp groups with members in its replica wait too, some a little longer
    def stuck(dp_groups):
        d = HangDetector(timeout_s=10)
        d.learn_layout({"tp": 4, "dp": 4})
        d.learn_members("tp.0", {0, 1})
        for i, g in enumerate(dp_groups):
            d.learn_members(g, {10 + 2 * i, 13 + 2 * i})
        for t in range(30):
            for r in (0, 1):
                d.observe(hb(r, t, [("tp.0", "all_reduce", 40, 1.5)]))
            for i, g in enumerate(dp_groups):
                for r in (10 + 2 * i, 13 + 2 * i):
                    d.observe(hb(r, t, [(g, "reduce_scatter", 9, 1.0)]))
        return d.check(int(29 * S))

    f = stuck(["dp.a", "dp.b"])
    assert f is not None and f.culprit == "node:n0", f.culprit
    # one group across nodes stuck first: a hung collective, its peers' tp group follows
    f = stuck(["dp.a"])
    assert f is not None and f.culprit == "group:dp.a", f.culprit


def test_a_fully_traced_group_inside_one_op_is_still_a_communication_hang():
    d = HangDetector(timeout_s=10)
    d.learn_layout({"tp": 2})
    d.learn_members("tp.0", {0, 1})
    for t in range(30):
        for r in (0, 1):
            d.observe(hb(r, t, [("tp.0", "all_reduce", 40, 1.0)]))
    f = d.check(int(29 * S))
    assert f is not None and f.culprit == "group:tp.0"


def test_an_untraced_wait_is_no_hang_while_the_job_still_moves():
    # a pipeline warm-up on long steps: rank 1's first recv waits on a sender that is not
    # known yet, while rank 0 keeps entering new ops
    d = HangDetector(timeout_s=10)
    d.learn_layout({"tp": 1})
    for t in range(30):
        d.observe(hb(1, t, [("pp.0-1", "recv", 0, 0.0)]))
        d.observe(hb(0, t, [("dp.0", "all_reduce", t, float(t))]))
    assert d.check(int(29 * S)) is None


def test_an_older_pipeline_recv_does_not_outrank_the_stuck_collective():
    # partial tracing: rank 5 has waited in a pipeline recv since second 1 (posted early, as
    # recvs are); rank 0, the only traced member of tp.0 (size 4), sits in an all_reduce
    # since second 3: the collective says where the untraced rank stopped
    d = HangDetector(timeout_s=10)
    d.learn_layout({"tp": 4})
    d.learn_members("tp.0", {0})
    d.learn_members("pp.5-9", {5})
    for t in range(40):
        d.observe(hb(0, t, [("tp.0", "all_reduce", 40, 3.0)]))
        d.observe(hb(5, t, [("pp.5-9", "recv", 7, 1.0)]))
    f = d.check(int(39 * S))
    assert f is not None and f.culprit == "node:n0", f.culprit


def test_a_rank_frozen_before_its_hook_sent_a_newer_table_is_still_the_root():
    """Frozen in step 9, rank 1's last in-flight table is from step 7 (a recv it finished
    long ago; the agent repeats it in every keepalive). Taken at its word, rank 1 waits too,
    nobody is missing, and a pipeline group of one read as a communication hang."""
    d = HangDetector(timeout_s=10)
    d.learn_members("tp.0", {0, 1})
    d.learn_members("pp.0.1-0", {0, 1})
    d.steps_done(np.array([0, 1]), 8, np.array([0, 0]))
    for t in range(1, 25):
        d.observe(hb(1, t, [("pp.0.1-0", "recv", 14, 0.5)], step=7))  # stale, repeated
        d.observe(hb(0, t, [("tp.0", "all_reduce", 18, 1.0)], step=9))
    f = d.check(int(24 * S))
    assert f is not None and f.culprit == "rank:1", f
    assert "stopped in step 9" in f.summary, f.summary


def _frozen_in_a_recv_its_peer_sent(d: HangDetector, peer_sent: bool) -> None:
    """Rank 3 is frozen inside its recv #52 from rank 7; rank 7 then waits in its recv #54
    from rank 3 (the next step's activations). Both show an op in flight for 20 s."""
    d.learn_members("pp.3.7-3", {3, 7})
    d.learn_members("pp.3.3-7", {3, 7})
    sent = ["pp.3.3-7", "pp.3.7-3"] if peer_sent else ["pp.3.3-7"]
    d.ops_done(7, 26, sent, np.array([53, 52][: len(sent)]))
    for t in range(1, 25):
        d.observe(hb(3, t, [("pp.3.7-3", "recv", 52, 0.9)], step=26))
        d.observe(hb(7, t, [("pp.3.3-7", "recv", 54, 1.1)], step=27))


def test_a_rank_frozen_inside_a_recv_its_peer_already_sent_is_the_root():
    """Taken at its heartbeat's word, rank 3 waits on rank 7 as rank 7 waits on it: a cycle
    with no root, blamed on the pair. Rank 7's step message holds the send of #52: that
    transfer is over, so rank 3 waits on nobody; it is stopped, and it is the culprit."""
    d = HangDetector(timeout_s=10)
    _frozen_in_a_recv_its_peer_sent(d, peer_sent=True)
    f = d.check(int(24 * S))
    assert f is not None and f.culprit == "rank:3", f
    assert "inside recv of pp.3.7-3" in f.summary, f.summary


def test_a_rank_frozen_in_a_recv_whose_peer_is_on_its_next_send_is_the_root():
    """Seen in a CI drill: rank 0 froze inside its recv #52 from rank 4. Rank 4's send #52
    had completed (gloo hands it to the socket), and rank 4 now sits in its send #53, which
    rank 0 will never receive; no step of either finished since. Rank 4's heartbeat shows
    it past #52, so rank 0 waits on nobody: it is stopped, not a pipeline group of one."""
    d = HangDetector(timeout_s=10)
    d.learn_members("pp.0.4-0", {0, 4})
    for t in range(1, 25):
        d.observe(hb(0, t, [("pp.0.4-0", "recv", 52, 0.9)], step=26))
        d.observe(hb(4, t, [("pp.0.4-0", "send", 53, 1.0)], step=26))
    f = d.check(int(24 * S))
    assert f is not None and f.culprit == "rank:0", f
    assert "inside recv of pp.0.4-0" in f.summary, f.summary


def test_a_peer_still_on_the_same_instance_is_waiting_too():
    """Both ends in flight on #52 (and rank 4 on #53 as well, a batched isend): nobody is
    past #52, so nothing says who stopped."""
    d = HangDetector(timeout_s=10)
    d.learn_members("pp.0.4-0", {0, 4})
    for t in range(1, 25):
        d.observe(hb(0, t, [("pp.0.4-0", "recv", 52, 0.9)], step=26))
        d.observe(hb(4, t, [("pp.0.4-0", "send", 52, 0.8), ("pp.0.4-0", "send", 53, 1.0)],
                     step=26))
    f = d.check(int(24 * S))
    assert f is None or not f.culprit.startswith("rank:"), f


def test_a_recv_whose_send_never_finished_still_waits_on_its_peer():
    d = HangDetector(timeout_s=10)
    _frozen_in_a_recv_its_peer_sent(d, peer_sent=False)
    f = d.check(int(24 * S))
    assert f is None or not f.culprit.startswith("rank:"), f


def test_waits_of_a_hang_that_ended_open_nothing_until_their_tables_are_renewed():
    """Rank 2 was frozen (its hang was paged) and thawed at second 30: ranks 0 and 1 sat in
    the all-reduce it joined late, and their heartbeats say so until their next ones. That
    is the hang that ended, not a new one; a wait that lasts another timeout is."""
    d = HangDetector(timeout_s=10)
    d.learn_members("tp.0", {0, 1, 2})
    for t in range(20, 31):
        for r in (0, 1, 2):
            d.observe(hb(r, t, [("tp.0", "all_reduce", 40, 5.0)], step=9))
    d.settle(int(30 * S))
    assert d.check(int(31 * S)) is None
    for t in range(31, 42):
        for r in (0, 1, 2):
            d.observe(hb(r, t, [("tp.0", "all_reduce", 40, 5.0)], step=9))
    f = d.check(int(42 * S))
    assert f is not None and f.culprit == "group:tp.0", f


def _vanished(rank: int, ts_s: float, step: int = 7, inflight=()) -> HeartbeatV1:
    last = hb(rank, ts_s, inflight, step)
    last.exited = "vanished"
    return last


def test_the_first_rank_to_vanish_is_named_not_the_peers_that_fail_after_it():
    d = HangDetector(timeout_s=10.0)
    for r in range(8):
        d.observe(hb(r, 1.0, [("dp.0", "all_reduce", 3, 0.9)] if r else ()))
    d.observe(_vanished(5, 2.0, inflight=[("tp.2", "all_reduce", 9, 1.8)]))
    d.observe(_vanished(1, 2.9))  # a launcher kills a peer soon after
    assert d.check(3 * S) is None  # within the grace: who else goes with it is not known yet
    f = d.check(5 * S)
    assert f is not None and f.culprit == "rank:5" and f.onset_step == 7
    assert "rank 5 (n2) died in step 7 in all_reduce of tp.2" in f.summary
    assert "1 more rank(s) vanished after it" in f.summary


def test_a_rank_that_says_why_it_died_is_named_with_its_reason_and_where():
    import msgspec

    d = HangDetector(timeout_s=10.0)
    for r in range(4):
        d.observe(hb(r, 1.0))
    died = msgspec.structs.replace(
        _vanished(2, 2.0), exit_reason="exception: ZeroDivisionError: division by zero",
        exit_stack=["train.py:9 in <module>", "model.py:42 in forward"])
    d.observe(died)
    f = d.check(5 * S)
    assert f is not None and f.culprit == "rank:2"
    assert ("died in step 7: exception: ZeroDivisionError: division by zero at model.py:42 "
            "in forward; the job cannot progress without it") in f.summary, f.summary


def test_peers_that_raise_after_a_killed_rank_are_no_teardown():
    """Seen in a CI drill: rank 3 was killed; the 7 others then raised in their collectives
    ("Connection reset by peer") and said so. Counted as a teardown, nobody was blamed."""
    import msgspec

    d = HangDetector(timeout_s=10.0)
    for r in range(8):
        d.observe(hb(r, 1.0))
    d.observe(_vanished(3, 2.0))
    for i, r in enumerate((7, 2, 1, 6, 0, 5, 4)):
        d.observe(msgspec.structs.replace(
            _vanished(r, 2.01 + 0.3 * i), exit_reason="exception: RuntimeError: Connection "
            "reset by peer", exit_stack=["distributed_c10d.py:3252 in all_reduce"]))
    f = d.check(8 * S)
    assert f is not None and f.culprit == "rank:3", f
    assert "7 more rank(s) vanished after it" in f.summary


def test_a_job_torn_down_at_once_blames_nobody_and_a_restarted_rank_is_back():
    d = HangDetector(timeout_s=10.0)
    for r in range(4):
        d.observe(hb(r, 1.0))
    for r in range(4):
        d.observe(_vanished(r, 2.0 + r * 0.01))  # cancelled: every rank within 30 ms
    assert d.check(10 * S) is None
    assert d.exit_finding(2 * S, 2.0, final=True) is None  # the job ended right then
    d2 = HangDetector(timeout_s=10.0)
    for r in range(4):
        d2.observe(hb(r, 1.0))
    d2.observe(_vanished(2, 2.0))
    d2.observe(hb(2, 3.0))  # an elastic restart: it reports again
    assert d2.exit_finding(10 * S, 2.0, final=True) is None


def _checkpoint_job(d: HangDetector, until_s: int) -> None:
    """Rank 0 saves a checkpoint from second 2; ranks 1-3 wait for it in the world barrier."""
    d.learn_members("world.0", {0, 1, 2, 3})
    for t in range(until_s + 1):
        d.observe(hb(0, t, [("", "host:checkpoint", -1, 2)]))
        for r in (1, 2, 3):
            d.observe(hb(r, t, [("world.0", "barrier", 40, 2.5)]))


def test_a_long_checkpoint_is_work_not_a_hang_until_it_outlasts_what_it_was_given():
    d = HangDetector(timeout_s=10.0)
    _checkpoint_job(d, 95)
    # no checkpoint finished yet: ten hang timeouts (100 s) are given to the first
    assert all(d.check(t * S) is None for t in range(12, 96))
    d = HangDetector(timeout_s=10.0)
    d.learn_stalls(["checkpoint", "gc"], np.array([20.0, 0.1]))  # one took 20 s before
    _checkpoint_job(d, 50)
    assert d.check(40 * S) is None  # 38 s: within twice the longest
    f = d.check(50 * S)
    assert f is not None and f.culprit == "rank:0"
    assert "inside host:checkpoint for 48 s" in f.summary, f.summary


def test_waits_on_a_rank_in_a_stall_are_never_a_communication_hang_of_its_peers():
    d = HangDetector(timeout_s=10.0)
    _checkpoint_job(d, 60)
    assert "" not in d.members
    assert all(d.check(t * S) is None for t in range(20, 61))
