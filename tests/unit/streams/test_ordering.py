"""Event-time merge of a job's topics: order, waiting for lagging topics, bounds."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from schemas.testing import FakeClock
from streams.ordering import EventTimeMerger

TOPICS = ("steps", "heartbeats", "jobs")


def nothing_more(topic: str, partition: int) -> bool:
    return False


def test_heads_are_released_in_event_time_order_with_ties_by_topic() -> None:
    m: EventTimeMerger[str] = EventTimeMerger(TOPICS, FakeClock().seconds)
    m.push(0, "j", "jobs", 30, "end")
    m.push(0, "j", "heartbeats", 10, "hb10")
    m.push(0, "j", "steps", 10, "s10")
    m.push(0, "j", "steps", 20, "s20")
    m.push(0, "j", "heartbeats", 30, "hb30")
    m.push(0, "j", "steps", 30, "s30")
    assert m.release(nothing_more) == ["s10", "hb10", "s20", "s30", "hb30", "end"]
    assert m.buffered == 0


def test_order_within_a_topic_is_never_changed() -> None:
    m: EventTimeMerger[str] = EventTimeMerger(TOPICS, FakeClock().seconds)
    for i, t in enumerate([50, 10, 40]):  # ranks of one step end at different times
        m.push(0, "j", "steps", t, f"s{i}")
    m.push(0, "j", "heartbeats", 45, "hb")
    assert m.release(nothing_more) == ["hb", "s0", "s1", "s2"]  # a merge of heads


def test_a_job_waits_for_a_topic_that_still_has_messages_to_fetch() -> None:
    clock = FakeClock()
    m: EventTimeMerger[str] = EventTimeMerger(TOPICS, clock.seconds, max_hold_s=5.0)
    m.push(0, "j", "heartbeats", 100, "hb100")
    m.push(0, "j", "jobs", 200, "end")
    lagging = {("steps", 0)}

    def has_more(topic: str, partition: int) -> bool:
        return (topic, partition) in lagging

    assert m.release(has_more) == []  # steps of the job may still come before t=100
    m.push(0, "j", "steps", 90, "s90")
    m.push(0, "j", "steps", 150, "s150")
    assert m.release(has_more) == ["s90", "hb100", "s150"]  # steps' queue empty again: wait
    lagging.clear()
    assert m.release(has_more) == ["end"]


def test_the_hold_is_timed_from_when_the_topic_ran_empty_not_from_the_oldest_item() -> None:
    """Under a backlog the job's `end` waits behind its steps for as long as they keep coming."""
    clock = FakeClock()
    m: EventTimeMerger[str] = EventTimeMerger(TOPICS, clock.seconds, max_hold_s=5.0)

    def steps_lag(topic: str, partition: int) -> bool:
        return topic == "steps"

    m.push(0, "j", "jobs", 1000, "end")
    m.push(0, "j", "steps", 100, "s1")
    assert m.release(steps_lag) == ["s1"]
    clock.advance(4.0)
    m.push(0, "j", "steps", 200, "s2")
    assert m.release(steps_lag) == ["s2"]
    clock.advance(4.0)  # `end` is 8 s old, but the steps topic ran empty only 4 s ago
    assert m.release(steps_lag) == []
    assert m.forced == 0
    clock.advance(1.0)  # 5 s without a step while the topic still has messages: it is stalled
    assert m.release(steps_lag) == ["end"]
    assert m.forced == 1


def test_a_topic_that_gets_lag_while_empty_is_waited_for_from_then() -> None:
    clock = FakeClock()
    m: EventTimeMerger[str] = EventTimeMerger(TOPICS, clock.seconds, max_hold_s=5.0)
    lagging: set[str] = set()

    def has_more(topic: str, partition: int) -> bool:
        return topic in lagging

    m.push(0, "j", "heartbeats", 100, "hb")
    m.push(0, "j", "heartbeats", 300, "hb2")
    clock.advance(60.0)
    lagging.add("steps")  # a step reached the broker but is not fetched yet
    assert m.release(has_more) == []
    clock.advance(4.0)
    assert m.release(has_more) == []  # waited 4 s, not 60
    m.push(0, "j", "steps", 200, "s")
    lagging.clear()
    assert m.release(has_more) == ["hb", "s", "hb2"]


def test_waiting_is_bounded_in_time_and_space() -> None:
    clock = FakeClock()
    m: EventTimeMerger[str] = EventTimeMerger(TOPICS, clock.seconds, max_hold_s=5.0, max_buffered=3)

    def always(topic: str, partition: int) -> bool:
        return topic == "steps"

    m.push(0, "j", "heartbeats", 1, "a")
    assert m.release(always) == []
    clock.advance(5.0)
    assert m.release(always) == ["a"]
    assert m.forced == 1
    for i in range(4):
        m.push(1, "k", "heartbeats", i, f"h{i}")
    assert m.release(always) == ["h0"]  # over the space bound: release down to it
    assert m.buffered == 3


def test_a_release_hands_over_at_most_its_limit_and_the_rest_follows_in_order() -> None:
    m: EventTimeMerger[str] = EventTimeMerger(TOPICS, FakeClock().seconds)
    for job in ("a", "b"):
        for t in (30, 10, 20):
            m.push(0, job, "steps", t, f"{job}{t}")
        m.push(0, job, "heartbeats", 15, f"{job}-hb")
    assert m.release(nothing_more, limit=3) == ["a-hb", "a30", "a10"]  # a merge of heads
    assert m.buffered == 5
    assert m.release(nothing_more, limit=3) == ["a20", "b-hb", "b30"]
    assert m.release(nothing_more) == ["b10", "b20"]
    assert m.buffered == 0 and m.release(nothing_more, limit=3) == []


def test_jobs_do_not_block_each_other() -> None:
    m: EventTimeMerger[str] = EventTimeMerger(TOPICS, FakeClock().seconds)
    m.push(0, "a", "steps", 100, "a-step")
    m.push(0, "b", "steps", 10, "b-step")
    m.push(0, "a", "heartbeats", 50, "a-hb")
    assert m.release(nothing_more) == ["a-hb", "a-step", "b-step"]


def test_drop_forgets_revoked_partitions() -> None:
    m: EventTimeMerger[str] = EventTimeMerger(TOPICS, FakeClock().seconds)
    m.push(0, "a", "steps", 1, "x")
    m.push(1, "b", "steps", 1, "y")
    assert m.drop({1}) == ["y"]
    assert m.buffered == 1 and m.partitions_with_items() == {0}


@given(st.lists(st.tuples(st.sampled_from(TOPICS), st.integers(0, 50)), max_size=60))
def test_merge_of_time_sorted_topics_is_time_sorted_and_complete(
        items: list[tuple[str, int]]) -> None:
    m: EventTimeMerger[tuple[str, int, int]] = EventTimeMerger(TOPICS, FakeClock().seconds)
    per_topic = {t: sorted(ts for tt, ts in items if tt == t) for t in TOPICS}
    for t, times in per_topic.items():
        for i, ts in enumerate(times):
            m.push(0, "j", t, ts, (t, ts, i))
    out = m.release(nothing_more)
    assert sorted(out) == sorted((t, ts, i) for t, v in per_topic.items()
                                 for i, ts in enumerate(v))
    assert [ts for _t, ts, _i in out] == sorted(ts for _t, ts, _i in out)
