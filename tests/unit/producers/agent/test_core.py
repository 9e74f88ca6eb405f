"""The agent's core on a fake clock: frames in, the messages it would publish out."""

from __future__ import annotations

import orjson
import pytest

from producers.agent.cadence import Cadence
from producers.agent.core import AgentCore
from producers.torch_hook.wire import BYE, HELLO, INFLIGHT, STEPS, FrameError
from schemas import topics
from schemas.decode import decode_heartbeat, decode_job
from schemas.testing import FakeClock
from schemas.wire import ThreadStack


def hello(rank: int, world: int = 4, job: str = "j1") -> bytes:
    return orjson.dumps({"job": job, "rank": rank, "local_rank": rank, "node": "",
                         "world_size": world, "pid": 1})


STEP_MSG = orjson.dumps({"v": 1, "job": "j1", "rank": 0, "node": "n1", "step": 0,
                         "t_start_ns": 1, "t_end_ns": 2,
                         "ops": {"kind": [], "name": [], "group": [], "seq": [],
                                 "start_ns": [], "dur_ns": [], "bytes": []}})


def table(step: int, *ops: tuple[str, int, int]) -> bytes:
    """An in-flight table frame: ops as (group, seq, start_ns)."""
    return orjson.dumps({"step": step, "inflight": [
        {"group": g, "name": "all_reduce", "seq": q, "start_ns": t} for g, q, t in ops]})


def sample(core: AgentCore, clock: FakeClock) -> dict[int, list[tuple[str, int]]]:
    """Advance one interval, sample: {rank: [(group, seq) in flight]} of what was published."""
    clock.advance(core.cadence.interval_s)
    beats = [decode_heartbeat(v) for _t, _k, v in core.heartbeats()]
    assert all(hb.ts_ns == clock() for hb in beats)
    return {hb.rank: [(o.group, o.seq) for o in hb.inflight] for hb in beats}


def test_hello_of_rank_zero_starts_the_job_once():
    clock = FakeClock()
    core = AgentCore("n1", clock)
    out = core.on_frame(1, HELLO, hello(0))
    assert [(t, k) for t, k, _v in out] == [(topics.JOBS, b"j1")]
    job = decode_job(out[0][2])
    assert job.event == "start" and job.world_size == 4 and job.ts_ns == clock()
    assert core.on_frame(2, HELLO, hello(1)) == []
    core.on_disconnect(1)
    assert core.on_frame(3, HELLO, hello(0)) == []  # a reconnect does not restart the job


def test_the_start_event_carries_the_cluster_topology_it_was_given():
    core = AgentCore("n1", FakeClock(), switch_of_node={"n1": "leaf-0", "n9": "leaf-3"})
    job = decode_job(core.on_frame(1, HELLO, hello(0))[0][2])
    assert job.nodes is None  # the cluster's map says nothing of the job's own nodes
    assert [(n.node, n.switch) for n in job.topology or []] == [("n1", "leaf-0"),
                                                                 ("n9", "leaf-3")]
    plain = decode_job(AgentCore("n1", FakeClock()).on_frame(1, HELLO, hello(0))[0][2])
    assert plain.topology is None


def test_the_start_event_names_the_jobs_own_nodes_from_rank_zeros_slurm_host_list():
    core = AgentCore("gpu-01", FakeClock(), switch_of_node={"gpu-01": "leaf-0"})
    first = orjson.loads(hello(0))
    job = decode_job(core.on_frame(1, HELLO, orjson.dumps(
        {**first, "job_nodes": "gpu-[01-03]"}))[0][2])
    assert [(n.node, n.switch) for n in job.nodes or []] == [
        ("gpu-01", "leaf-0"), ("gpu-02", None), ("gpu-03", None)]
    # an unreadable list names no node rather than a wrong one
    bad = decode_job(AgentCore("n1", FakeClock()).on_frame(1, HELLO, orjson.dumps(
        {**first, "job_nodes": "gpu-[x-y]"}))[0][2])
    assert bad.nodes is None and bad.world_size == 4


def test_rank_zeros_layout_restarts_the_job_once_with_it_and_other_ranks_do_not():
    """Rank 0 says hello before it has groups; its tables carry the layout once they exist
    (partial tracing needs it: a group's untraced members are not absent)."""
    core = AgentCore("gpu-01", FakeClock())
    first = orjson.loads(hello(0))
    core.on_frame(1, HELLO, orjson.dumps({**first, "job_nodes": "gpu-[01-02]"}))
    core.on_frame(2, HELLO, hello(1))
    with_layout = {**orjson.loads(table(0)), "layout": {"tp": 2, "pp": 2, "dp": 1}}
    assert core.on_frame(2, INFLIGHT, orjson.dumps(with_layout)) == []  # not rank 0
    out = core.on_frame(1, INFLIGHT, orjson.dumps(with_layout))
    assert [(t, k) for t, k, _v in out] == [(topics.JOBS, b"j1")]
    job = decode_job(out[0][2])
    assert job.event == "start" and job.world_size == 4 and job.layout is not None
    assert (job.layout.tp, job.layout.pp, job.layout.dp, job.layout.ep) == (2, 2, 1, None)
    assert [n.node for n in job.nodes or []] == ["gpu-01", "gpu-02"]
    assert core.on_frame(1, INFLIGHT, orjson.dumps(with_layout)) == []  # once per layout
    assert core.on_frame(1, INFLIGHT, table(1)) == []
    changed = {**with_layout, "layout": {"tp": 2, "pp": 2, "dp": 1, "ep": 2}}
    assert decode_job(core.on_frame(1, INFLIGHT, orjson.dumps(changed))[0][2]).layout.ep == 2


def test_steps_are_forwarded_untouched_keyed_by_job():
    core = AgentCore("n1", FakeClock())
    core.on_frame(1, HELLO, hello(0))
    assert core.on_frame(1, STEPS, STEP_MSG) == [(topics.STEPS, b"j1", STEP_MSG)]


def test_heartbeats_report_inflight_since_when_and_stop_on_disconnect():
    clock = FakeClock()
    core = AgentCore("n1", clock)
    core.on_frame(1, HELLO, hello(0))
    core.on_frame(2, HELLO, hello(1))
    started = clock()
    core.on_frame(1, INFLIGHT, table(7, ("dp.0", 41, started)))
    core.on_frame(2, INFLIGHT, table(7))
    clock.advance(12)
    beats = {hb.rank: hb for hb in (decode_heartbeat(v) for _t, _k, v in core.heartbeats())}
    assert sorted(beats) == [0, 1]
    hb = beats[0]
    assert (hb.job, hb.node, hb.step, hb.ts_ns) == ("j1", "n1", 7, clock())
    assert [(o.group, o.name, o.seq, o.start_ns) for o in hb.inflight] == [
        ("dp.0", "all_reduce", 41, started)]
    assert beats[1].inflight == []
    core.on_disconnect(2)  # the rank's process died: silence, not a fake "idle"
    clock.advance(5)  # the keepalive of rank 0 (nothing else changed)
    assert [decode_heartbeat(v).rank for _t, _k, v in core.heartbeats()] == [0]


def test_a_rank_that_vanishes_without_goodbye_gets_a_last_heartbeat_saying_so():
    clock = FakeClock()
    core = AgentCore("n1", clock)
    core.on_frame(1, HELLO, hello(0))
    core.on_frame(2, HELLO, hello(1))
    core.on_frame(3, HELLO, hello(2))
    core.on_frame(2, INFLIGHT, table(9, ("tp.0", 5, clock())))
    clock.advance(3)
    out = core.on_disconnect(2)  # killed: its socket closed, no goodbye
    assert [(t, k) for t, k, _v in out] == [(topics.HEARTBEATS, b"j1")]
    hb = decode_heartbeat(out[0][2])
    assert (hb.rank, hb.step, hb.ts_ns, hb.exited) == (1, 9, clock(), "vanished")
    assert [(o.group, o.seq) for o in hb.inflight] == [("tp.0", 5)]
    assert core.stats.vanished == 1
    core.on_frame(1, BYE, b"")  # rank 0 says goodbye, then its socket closes
    assert core.on_disconnect(1) == []
    assert core.on_disconnect(3, broken=True) == []  # the agent closed it: a protocol error
    assert core.stats.vanished == 1


def test_a_rank_exiting_on_an_exception_says_why_and_ends_no_job():
    core = AgentCore("n1", FakeClock())
    core.on_frame(1, HELLO, hello(0))
    core.on_frame(1, INFLIGHT, table(4, ("dp.0", 7, 5)))
    bye = orjson.dumps({"exit": "exception", "detail": "ZeroDivisionError: division by zero",
                        "stack": ["train.py:9 in <module>", "train.py:42 in step"]})
    out = core.on_frame(1, BYE, bye)
    assert [t for t, _k, _v in out] == [topics.HEARTBEATS]  # rank 0, yet no job end
    hb = decode_heartbeat(out[0][2])
    assert (hb.exited, hb.exit_reason, hb.step) == (
        "vanished", "exception: ZeroDivisionError: division by zero", 4)
    assert hb.exit_stack == ["train.py:9 in <module>", "train.py:42 in step"]
    assert core.on_disconnect(1) == []  # said already


def test_a_rank_killed_by_a_signal_is_read_from_its_fault_file(tmp_path):
    fault = tmp_path / "flare-fault-77.txt"
    fault.write_text("Fatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call "
                     'first):\n  File "/w/model.py", line 12 in forward\n')
    core = AgentCore("n1", FakeClock())
    core.on_frame(1, HELLO, orjson.dumps({"job": "j1", "rank": 3, "world_size": 4,
                                          "fault_file": str(fault)}))
    hb = decode_heartbeat(core.on_disconnect(1)[0][2])
    assert (hb.exit_reason, hb.exit_stack) == ("signal: Aborted", ["model.py:12 in forward"])
    assert not fault.exists()  # read once, then gone
    core.on_frame(2, HELLO, orjson.dumps({"job": "j1", "rank": 2, "world_size": 4,
                                          "fault_file": str(fault)}))
    hb = decode_heartbeat(core.on_disconnect(2)[0][2])  # SIGKILL: nothing was written
    assert hb.exited == "vanished" and hb.exit_reason is None and hb.exit_stack is None


def test_each_rank_follows_the_cadence_with_its_full_inflight_list():
    clock = FakeClock()
    core = AgentCore("n1", clock, cadence=Cadence(interval_s=1.0, keepalive_s=5.0, long_op_s=1.0))
    core.on_frame(1, HELLO, hello(0))
    core.on_frame(2, HELLO, hello(1))
    assert sample(core, clock) == {0: [], 1: []}  # (a) the first sample of every rank
    # short ops come and go on both ranks: nothing is published until the keepalive
    for seq in range(3):
        core.on_frame(1, INFLIGHT, table(1, ("dp.0", seq, clock() + 500_000_000)))
        core.on_frame(2, INFLIGHT, table(1))
        assert sample(core, clock) == {}
    core.on_frame(1, INFLIGHT, table(1))
    assert sample(core, clock) == {}
    # (c) keepalive: 5 s after the last published heartbeat
    assert sample(core, clock) == {0: [], 1: []}
    # (b) rank 0 enters an op that stays in flight: published at the first sample where it
    # is >= 1 s old, with the FULL list (a younger op rides along)
    t0 = clock() + 200_000_000
    core.on_frame(1, INFLIGHT, table(2, ("dp.0", 6, t0)))
    assert sample(core, clock) == {}  # 0.8 s old at this sample: still short
    core.on_frame(1, INFLIGHT, table(2, ("dp.0", 6, t0), ("tp.0", 9, clock())))
    assert sample(core, clock) == {0: [("dp.0", 6), ("tp.0", 9)]}  # 1.8 s: long
    assert sample(core, clock) == {}  # same long set: quiet
    # the op ends: its end is published at the next sample
    core.on_frame(1, INFLIGHT, table(3))
    assert sample(core, clock) == {0: []}
    assert sample(core, clock) == {1: []}  # rank 1's keepalive is independent of rank 0's
    assert core.stats.samples == 2 * 11 and core.stats.heartbeats == 7


def test_keepalive_never_leaves_a_waiting_rank_silent_past_the_hang_timeout():
    clock = FakeClock()
    core = AgentCore("n1", clock, cadence=Cadence(interval_s=0.5, keepalive_s=3.0, long_op_s=1.0))
    core.on_frame(1, HELLO, hello(0))
    t0 = clock()
    core.on_frame(1, INFLIGHT, table(4, ("dp.0", 1, t0)))
    published = []
    for _ in range(60):  # 30 s blocked in one collective
        clock.advance(0.5)
        if core.heartbeats():
            published.append(clock())
    gaps = [(b - a) / 1e9 for a, b in zip(published, published[1:], strict=False)]
    # first sample, the op turning long at 1 s, then keepalives every 3 s
    assert published[0] - t0 == 500_000_000 and gaps[0] == 0.5
    assert set(gaps[1:]) == {3.0}
    assert len(published) == 2 + 29 // 3


def test_a_reconnected_rank_is_published_at_its_first_sample():
    clock = FakeClock()
    core = AgentCore("n1", clock)
    core.on_frame(1, HELLO, hello(3))
    assert sample(core, clock) == {3: []}
    assert sample(core, clock) == {}
    core.on_disconnect(1)
    core.on_frame(2, HELLO, hello(3))
    assert sample(core, clock) == {3: []}


def test_bye_of_rank_zero_ends_the_job():
    core = AgentCore("n1", FakeClock())
    core.on_frame(1, HELLO, hello(0))
    out = core.on_frame(1, BYE, b"{}")
    assert decode_job(out[0][2]).event == "end"
    assert core.heartbeats() == []


@pytest.mark.parametrize("frames, match", [
    ([(STEPS, STEP_MSG)], "first frame"),
    ([(HELLO, b"{not json")], "bad hello"),
    ([(HELLO, orjson.dumps({"job": "", "rank": 0}))], "needs a job"),
    ([(HELLO, hello(0)), (INFLIGHT, orjson.dumps({"step": "x"}))], "in-flight"),
])
def test_protocol_violations_are_frame_errors(frames, match):
    core = AgentCore("n1", FakeClock())
    with pytest.raises(FrameError, match=match):
        for ftype, payload in frames:
            core.on_frame(1, ftype, payload)


def _stacks_table(step: int, ts: int, frames: list[str]) -> bytes:
    return orjson.dumps({"step": step, "inflight": [], "stacks_ts_ns": ts, "stacks": [
        {"thread": "MainThread", "frames": frames, "training": True},
        {"thread": "pin_memory", "frames": ["threading.py:1 in run"]}]})


def test_stacks_from_a_rank_go_out_once_with_its_next_sample_whatever_the_cadence():
    clock = FakeClock()
    core = AgentCore("n1", clock, proc_state=lambda pid: None)
    core.on_frame(1, HELLO, hello(0))
    core.on_frame(2, HELLO, hello(1))
    sample(core, clock)  # the first samples
    assert sample(core, clock) == {}  # quiet: nothing due
    core.on_frame(2, INFLIGHT, _stacks_table(4, clock(), ["train.py:9 in main",
                                                          "data.py:40 in load_batch"]))
    clock.advance(core.cadence.interval_s)
    beats = [decode_heartbeat(v) for _t, _k, v in core.heartbeats()]
    assert [hb.rank for hb in beats] == [1]  # published though no keepalive was due
    (hb,) = beats
    assert hb.stacks is not None and hb.stacks_ts_ns is not None
    assert [(t.thread, t.training, t.frames[-1]) for t in hb.stacks] == [
        ("MainThread", True, "data.py:40 in load_batch"), ("pin_memory", False,
                                                           "threading.py:1 in run")]
    assert sample(core, clock) == {}  # once: not repeated with the next samples


def test_a_rank_too_long_a_stack_is_cut_to_its_innermost_frames():
    clock = FakeClock()
    core = AgentCore("n1", clock, proc_state=lambda pid: None)
    core.on_frame(1, HELLO, hello(0))
    core.on_frame(1, INFLIGHT, _stacks_table(1, 5, [f"f.py:{i} in f" for i in range(500)]))
    clock.advance(1.0)
    (hb,) = [decode_heartbeat(v) for _t, _k, v in core.heartbeats()]
    assert hb.stacks and len(hb.stacks[0].frames) == 40
    assert hb.stacks[0].frames[-1] == "f.py:499 in f"


def test_a_stopped_process_is_said_by_its_node_and_cleared_when_it_runs_again():
    clock = FakeClock()
    state: dict[int, str | None] = {1: None}
    core = AgentCore("n1", clock, proc_state=lambda pid: state[pid])
    core.on_frame(1, HELLO, hello(0))
    sample(core, clock)
    assert sample(core, clock) == {}
    state[1] = "stopped"
    clock.advance(1.0)
    beats = [decode_heartbeat(v) for _t, _k, v in core.heartbeats()]
    assert [(hb.rank, hb.proc_state) for hb in beats] == [(0, "stopped")]
    assert sample(core, clock) == {}  # said once; the keepalive repeats it
    state[1] = None
    clock.advance(1.0)
    beats = [decode_heartbeat(v) for _t, _k, v in core.heartbeats()]
    assert [(hb.rank, hb.proc_state) for hb in beats] == [(0, None)]


def test_a_moment_in_uninterruptible_sleep_is_no_blocked_process_but_two_samples_are():
    clock = FakeClock()
    seen = iter([None, None, "blocked", None, "blocked", "blocked", "blocked"])
    core = AgentCore("n1", clock, proc_state=lambda pid: next(seen))
    core.on_frame(1, HELLO, hello(0))
    states = []
    for _ in range(7):
        clock.advance(1.0)
        states.append([decode_heartbeat(v).proc_state for _t, _k, v in core.heartbeats()])
    # published: the first sample; then only when two samples in a row found it blocked
    assert states == [[None], [], [], [], [], ["blocked"], []]


def test_a_process_that_stops_has_its_stacks_read_from_outside_once():
    """The agent reads a stopped rank's stacks itself (its hook cannot send them), once,
    when it first finds the process unable to run, and sends them with that heartbeat."""
    clock = FakeClock()
    state: dict[int, str | None] = {1: None}
    reads: list[int] = []

    def read(pid: int) -> list[ThreadStack]:
        reads.append(pid)
        return [ThreadStack("MainThread", ["train.py:9 in main", "data.py:40 in load"], True)]

    core = AgentCore("n1", clock, proc_state=lambda pid: state[pid], read_stacks=read)
    core.on_frame(1, HELLO, hello(0))
    sample(core, clock)
    assert reads == []  # it runs: nothing read
    state[1] = "stopped"
    clock.advance(1.0)
    (hb,) = [decode_heartbeat(v) for _t, _k, v in core.heartbeats()]
    assert hb.proc_state == "stopped" and hb.stacks is not None
    assert hb.stacks[0].frames[-1] == "data.py:40 in load" and hb.stacks_ts_ns == clock()
    for _ in range(3):
        clock.advance(1.0)
        core.heartbeats()
    assert len(reads) == 1
