"""A hang's stacks merged across ranks: the odd one out first, silence explained, bounded."""

from __future__ import annotations

from detectors.diagnoser import JobDiagnoser
from detectors.stacks import MAX_GROUPS, StackBook, rank_ranges
from producers.simulator import ClusterSimulator, Fault, Noise, Scenario, layout_for_gpus
from schemas.frame import StepFrame
from schemas.wire import HeartbeatV1, ThreadStack

WAIT = ["train.py:120 in <module>", "train.py:88 in step", "distributed_c10d.py:2950 in all_reduce"]
LOAD = ["train.py:120 in <module>", "train.py:80 in step", "data.py:40 in load_batch"]


def beat(rank: int, ts: int, frames: list[str] | None = None, state: str | None = None,
         extra: list[ThreadStack] = ()) -> HeartbeatV1:  # type: ignore[assignment]
    stacks = [ThreadStack("MainThread", frames, training=True), *extra] if frames else None
    return HeartbeatV1(v=1, job="j", rank=rank, node=f"n{rank // 4}", ts_ns=ts, step=9,
                       stacks=stacks, stacks_ts_ns=ts if stacks else None, proc_state=state)


def test_the_rank_elsewhere_leads_and_each_group_says_who_is_not_there() -> None:
    book = StackBook()
    for r in range(8):
        book.observe(beat(r, 100, LOAD if r == 5 else WAIT))
    view = book.merged(since_ns=50, world=8)
    assert [(g.thread, g.ranks, g.not_ranks, g.n_ranks) for g in view] == [
        ("training", "5", "0-4,6-7", 1), ("training", "0-4,6-7", "5", 7)]
    assert view[0].frames[-1] == "data.py:40 in load_batch"


def test_ranks_that_cannot_answer_are_a_group_with_the_reason() -> None:
    book = StackBook()
    for r in (0, 1, 3):
        book.observe(beat(r, 100, WAIT))
    book.observe(beat(2, 100, state="stopped"))
    view = book.merged(since_ns=50, world=6)  # ranks 4 and 5 never said anything
    assert [(g.ranks, bool(g.frames)) for g in view] == [("2", False), ("4-5", False),
                                                         ("0-1,3", True)]
    assert "stopped" in view[0].note and "no stack" in view[1].note
    # the process runs again: its state is cleared by its next heartbeat
    assert book.observe(beat(2, 200))
    assert book.proc_state == {}


def test_a_rank_that_cannot_answer_now_is_shown_so_not_by_a_stack_it_sent_before() -> None:
    book = StackBook()
    book.observe(beat(0, 100, WAIT))  # dumped while its step was overdue, then it froze
    book.observe(beat(0, 120, state="blocked"))
    book.observe(beat(1, 110, WAIT))
    view = book.merged(since_ns=50, world=2)
    assert [(g.ranks, bool(g.frames), "cannot answer" in g.note) for g in view] == [
        ("0", False, True), ("1", True, False)]


def test_a_stopped_rank_read_from_outside_after_it_stopped_is_shown_where_it_is() -> None:
    """Its node agent read its stack once it could not run (py-spy, from outside): that is
    where it stopped, shown with the state; the stack it sent before stays unused."""
    book = StackBook()
    book.observe(beat(0, 100, WAIT))  # sent by its hook while it still ran
    book.observe(beat(0, 120, LOAD, state="frozen"))  # read from outside once frozen
    book.observe(beat(1, 110, WAIT))
    view = book.merged(since_ns=50, world=2)
    assert [(g.ranks, g.frames[-1:], g.note) for g in view] == [
        ("0", ["data.py:40 in load_batch"],
         "process frozen by a cgroup freezer: its stack read from outside it"),
        ("1", ["distributed_c10d.py:2950 in all_reduce"], "")]
    book.observe(beat(0, 130))  # it runs again: its state, and what was read then, are done
    assert book.state_since == {}


def test_stacks_from_before_the_hang_began_do_not_describe_it() -> None:
    book = StackBook()
    book.observe(beat(0, 10, LOAD))  # a long checkpoint step, long before
    book.observe(beat(1, 100, WAIT))
    view = book.merged(since_ns=50, world=2)
    assert {g.ranks: g.frames for g in view} == {"0": [], "1": WAIT}


def test_other_threads_follow_the_training_loops_and_the_view_is_bounded() -> None:
    book = StackBook()
    loader = ThreadStack("pin_memory", ["threading.py:1 in run", "pin.py:5 in loop"])
    for r in range(4):
        book.observe(beat(r, 100, WAIT, extra=[loader]))
    view = book.merged(since_ns=0, world=4)
    assert [g.thread for g in view] == ["training", "pin_memory"]
    many = StackBook()
    for r in range(100):
        many.observe(beat(r, 100, [*WAIT, f"user.py:{r} in f"]))
    assert len(many.merged(since_ns=0, world=100)) == MAX_GROUPS


def test_ten_thousand_ranks_in_one_collective_share_one_frame_list() -> None:
    book = StackBook()
    for r in range(10_000):
        book.observe(beat(r, 100, list(WAIT)))
    frames = {id(threads[0][2]) for _, threads in book.stacks.values()}
    assert len(frames) == 1
    (only,) = book.merged(since_ns=0, world=10_000)
    assert only.ranks == "0-9999" and only.not_ranks == ""
    assert rank_ranges(range(0, 10, 2)) == "0,2,4,6,8"


def _hang_events(with_stacks: bool) -> list:
    sc = Scenario(job="t-hang", layout=layout_for_gpus(64), steps=40, seed=11,
                  fault=Fault("hang_rank", 1.5, 20), noise=Noise(), heartbeats=True)
    sim = ClusterSimulator(sc)
    culprit = int(sim.truth.culprit.split(":")[1])
    diag = JobDiagnoser(sc.job)
    diag.on_job(sim.job_start())
    events = []
    for item in sim.run():
        if isinstance(item, StepFrame):
            out = diag.on_frame(item)
        else:
            if with_stacks and item.inflight or item.rank == culprit and item.step >= 20:
                # what the hooks send once their step lasts long: the culprit is elsewhere
                frames = LOAD if item.rank == culprit else WAIT
                item = HeartbeatV1(**{**{f: getattr(item, f) for f in item.__struct_fields__},
                                      "stacks": [ThreadStack("MainThread", frames, True)],
                                      "stacks_ts_ns": item.ts_ns}) if with_stacks else item
            out = diag.on_heartbeat(item)
        events += [i for i in out.incidents if i.kind == "hang"]
    return [culprit, events]


def test_a_hang_incident_carries_the_merged_stacks_with_the_culprit_first() -> None:
    culprit, events = _hang_events(with_stacks=True)
    assert events and events[0].culprit == f"rank:{culprit}"
    shown = [e.stacks for e in events if e.stacks]
    assert shown, "no hang incident carried stacks"
    lead = shown[-1][0]
    assert lead.ranks == str(culprit) and lead.frames[-1] == "data.py:40 in load_batch"
    assert any(g.frames == WAIT and g.n_ranks > 1 for g in shown[-1])
    last = [e for e in events if e.stacks][-1]
    assert last.summary.endswith(f"; stacks: rank {culprit} is at data.py:40 in load_batch")
    assert last.summary.count("; stacks: ") == 1  # replaced, not appended, at each update


def test_without_stacks_a_hang_incident_has_none() -> None:
    _, events = _hang_events(with_stacks=False)
    assert events and all(e.stacks is None for e in events)
