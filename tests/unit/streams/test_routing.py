"""JobRouter: messages to the right job's diagnoser, bad input to dead letters, time, ownership.

The diagnoser is a spec_set fake of JobDiagnoser, so these tests pin the routing contract
without depending on what the detectors conclude.
"""

from __future__ import annotations

import base64
from typing import Any
from unittest.mock import create_autospec

import orjson
import pytest

from detectors.diagnoser import JobDiagnoser
from schemas import InvalidMessage
from schemas.clock import NS_PER_S
from schemas.rankstep import RankStep
from schemas.report import DiagnoserOutput
from schemas.steps_decoder import StepsDecoder
from schemas.steps_v2 import encode_steps_value
from schemas.testing import FakeClock
from schemas.topics import HEARTBEATS, INCIDENTS, JOBS, STEPS, STEPS_V2
from schemas.wire import HeartbeatV1, JobV1
from streams.routing import JobRouter, decode_input

T0 = 1_790_000_000_000_000_000
S = NS_PER_S


def step_msg(job: str = "j1", rank: int = 0, step: int = 0, t_end: int = T0 + S) -> bytes:
    return orjson.dumps({
        "v": 1, "job": job, "rank": rank, "node": "n0", "step": step,
        "t_start_ns": t_end - S, "t_end_ns": t_end,
        "ops": {"kind": ["compute"], "name": ["fwd"], "group": [""], "seq": [0],
                "start_ns": [0], "dur_ns": [S], "bytes": [0]},
    })


def step_msg_v2(job: str = "j1", rank: int = 0, step: int = 0, t_end: int = T0 + S) -> bytes:
    return encode_steps_value(orjson.loads(step_msg(job, rank, step, t_end)))


def hb_msg(job: str = "j1", ts: int = T0) -> bytes:
    return orjson.dumps({"v": 1, "job": job, "rank": 0, "node": "n0", "ts_ns": ts, "step": 1,
                         "inflight": []})


def job_msg(job: str = "j1", event: str = "start", ts: int = T0) -> bytes:
    body: dict[str, Any] = {"v": 1, "job": job, "event": event, "ts_ns": ts}
    if event == "start":
        body["world_size"] = 2
    return orjson.dumps(body)


def clock() -> FakeClock:
    return FakeClock(start_ns=5 * S)


@pytest.fixture
def made() -> dict[str, Any]:
    return {}


@pytest.fixture
def router(made: dict[str, Any]) -> JobRouter:
    def make(job: str) -> Any:
        fake = create_autospec(JobDiagnoser, spec_set=True, instance=True)
        for name in ("on_steps", "on_heartbeat", "on_job", "tick", "flush"):
            getattr(fake, name).return_value = DiagnoserOutput()
        made[job] = fake
        return fake

    return JobRouter(make, max_message_bytes=10_000, now_ns=clock(), idle_evict_s=60.0)


def test_each_job_gets_its_own_diagnoser_and_the_right_method(router: JobRouter,
                                                              made: dict[str, Any]) -> None:
    assert router.handle(STEPS, 0, 0, b"j1", step_msg("j1")).dead_letter is None
    assert router.handle(STEPS, 1, 0, b"j2", step_msg("j2")).dead_letter is None
    assert router.handle(HEARTBEATS, 0, 1, b"j1", hb_msg("j1")).dead_letter is None
    assert router.handle(JOBS, 0, 2, b"j1", job_msg("j1")).dead_letter is None
    assert set(made) == {"j1", "j2"}
    assert router.jobs(0) == ["j1"] and router.jobs(1) == ["j2"]
    (msg,), _ = made["j1"].on_steps.call_args
    assert isinstance(msg, RankStep) and msg.job == "j1"
    assert isinstance(made["j1"].on_heartbeat.call_args.args[0], HeartbeatV1)
    assert isinstance(made["j1"].on_job.call_args.args[0], JobV1)
    assert made["j2"].on_heartbeat.call_count == 0


def test_the_diagnoser_output_is_returned(router: JobRouter, made: dict[str, Any]) -> None:
    router.handle(STEPS, 0, 0, b"j1", step_msg())
    out = DiagnoserOutput()
    made["j1"].on_steps.return_value = out
    assert router.handle(STEPS, 0, 1, b"j1", step_msg(rank=1)).output is out


BAD: list[tuple[str, bytes | None, bytes | None, str, str]] = [
    (STEPS, b"j1", b'{"v":1,"job":"j1","rank":', "$", "truncated"),
    (STEPS, b"j1", b"\xff\xfe not json", "$", "malformed"),
    (STEPS, b"j1", b'{"v":2,"job":"j1"}', "$.v", "this worker accepts v=1"),
    (STEPS, b"j1", b'{"v":1,"job":"j1","rank":"x"}', "$.rank", "Expected `int`"),
    (STEPS, b"j1", b"x" * 10_001, "$", "exceeds the 10000-byte limit"),
    (STEPS, b"j1", None, "$", "empty message"),
    (HEARTBEATS, b"j1", b'{"v":1}', "$", "missing required field"),
    (JOBS, b"j1", b'{"v":1,"job":"j1","event":"start","ts_ns":1}', "$.world_size",
     "needs world_size"),
    (STEPS, b"other", step_msg("j1"), "$key", "is not the job id 'j1'"),
    (INCIDENTS, b"j1", b"{}", "$topic", "not an input topic"),
    (STEPS_V2, b"j1", step_msg_v2()[:-1], "$", "truncated"),
    (STEPS_V2, b"j1", step_msg(), "$", "not a v2 steps message"),
    (STEPS_V2, b"j1", step_msg_v2() + b"\0" * 10_000, "$", "exceeds the 10000-byte limit"),
    (STEPS_V2, b"other", step_msg_v2("j1"), "$key", "is not the job id 'j1'"),
]


@pytest.mark.parametrize(("topic", "key", "value", "cause", "reason"), BAD)
def test_bad_input_becomes_a_dead_letter_with_reason(
    router: JobRouter, made: dict[str, Any], topic: str, key: bytes | None,
    value: bytes | None, cause: str, reason: str,
) -> None:
    routed = router.handle(topic, 3, 42, key, value)
    dl = routed.dead_letter
    assert dl is not None
    assert (dl.topic, dl.partition, dl.offset) == (topic, 3, 42)
    assert reason in dl.reason and dl.reason.startswith(cause)
    assert base64.b64decode(dl.payload_b64) == (value or b"")
    assert router.dead_letters.total == 1
    assert router.dead_letters.by_cause[cause] == 1
    assert router.dead_letters.by_topic[topic] == 1
    assert not made  # no diagnoser state for an unusable message


def test_missing_key_is_refused_because_the_job_would_be_split(router: JobRouter) -> None:
    dl = router.handle(STEPS, 0, 0, None, step_msg()).dead_letter
    assert dl is not None and "$key: missing" in dl.reason


def test_a_failing_diagnoser_dead_letters_the_message_and_keeps_going(
        router: JobRouter, made: dict[str, Any]) -> None:
    router.handle(STEPS, 0, 0, b"j1", step_msg())
    made["j1"].on_steps.side_effect = ZeroDivisionError("boom")
    dl = router.handle(STEPS, 0, 1, b"j1", step_msg(rank=1)).dead_letter
    assert dl is not None and dl.reason.startswith("internal: the diagnoser raised "
                                                   "ZeroDivisionError: boom")
    made["j1"].on_steps.side_effect = None
    assert router.handle(STEPS, 0, 2, b"j1", step_msg(rank=2)).dead_letter is None
    assert router.dead_letters.by_cause["internal"] == 1


def test_tick_moves_each_quiet_job_by_worker_time_since_its_last_message(
        made: dict[str, Any]) -> None:
    now = clock()
    r = JobRouter(lambda job: made.setdefault(job, _fake()), max_message_bytes=10_000,
                  now_ns=now, idle_evict_s=60.0)
    r.handle(STEPS, 0, 0, b"j1", step_msg(t_end=T0 + 7 * S))
    r.handle(STEPS, 1, 0, b"j2", step_msg("j2", t_end=T0 + 100 * S))
    now.advance_ns(3 * S)
    list(r.tick_each([0]))  # partition 1 is not caught up: its job must not see time pass
    made["j1"].tick.assert_called_once_with(T0 + 10 * S)
    made["j2"].tick.assert_not_called()
    list(r.tick_each([0]))  # no time passed since: no repeated tick at the same stream time
    assert made["j1"].tick.call_count == 1


def test_an_ended_job_keeps_ticking_and_idle_jobs_are_flushed_and_dropped(
        made: dict[str, Any]) -> None:
    """Time still passes for a job that ended: its end is final only after a grace, which
    its diagnoser counts (and it knows a job that ended is silent, not hung)."""
    now = clock()
    r = JobRouter(lambda job: made.setdefault(job, _fake()), max_message_bytes=10_000,
                  now_ns=now, idle_evict_s=60.0)
    r.handle(STEPS, 0, 0, b"j1", step_msg())
    r.handle(JOBS, 0, 0, b"j1", job_msg(event="end", ts=T0 + 2 * S))
    r.handle(HEARTBEATS, 0, 1, b"j1", hb_msg(ts=T0 + S))
    now.advance_ns(10 * S)
    list(r.tick_each([0]))
    made["j1"].tick.assert_called_once_with(T0 + 12 * S)
    now.advance_ns(61 * S)
    list(r.tick_each([0]))
    made["j1"].flush.assert_called_once()
    assert r.jobs() == []


def test_jobs_tick_one_at_a_time_and_one_revoked_in_between_is_skipped(
        made: dict[str, Any]) -> None:
    """The worker hands its loop back between jobs' ticks; a rebalance may come then."""
    now = clock()
    r = JobRouter(lambda job: made.setdefault(job, _fake()), max_message_bytes=10_000,
                  now_ns=now, idle_evict_s=60.0)
    for p, job in ((0, "a"), (0, "b"), (1, "c")):
        r.handle(STEPS, p, 0, job.encode(), step_msg(job))
    now.advance_ns(3 * S)
    each = r.tick_each([0, 1])
    next(each)
    assert [made[j].tick.call_count for j in "abc"] == [1, 0, 0]
    r.revoke([1])
    assert len(list(each)) == 1  # b's tick; c's partition is gone
    assert [made[j].tick.call_count for j in "abc"] == [1, 1, 0]


def test_revoke_drops_only_the_revoked_partitions(router: JobRouter) -> None:
    router.handle(STEPS, 0, 0, b"j1", step_msg("j1"))
    router.handle(STEPS, 1, 0, b"j2", step_msg("j2"))
    assert router.revoke([1]) == ["j2"]
    assert router.jobs() == ["j1"]


def _fake() -> Any:
    fake = create_autospec(JobDiagnoser, spec_set=True, instance=True)
    for name in ("on_steps", "on_heartbeat", "on_job", "tick", "flush"):
        getattr(fake, name).return_value = DiagnoserOutput()
    return fake


def test_a_v2_step_reaches_its_diagnoser_as_the_same_step_as_v1(
        router: JobRouter, made: dict[str, Any]) -> None:
    assert router.handle(STEPS, 0, 0, b"j1", step_msg(rank=0)).dead_letter is None
    assert router.handle(STEPS_V2, 0, 0, b"j1", step_msg_v2(rank=1)).dead_letter is None
    v1, v2 = (c.args[0] for c in made["j1"].on_steps.call_args_list)
    assert isinstance(v2, RankStep) and v2.rank == 1
    assert (list(v1.name), v1.dur_ns.tolist(), v1.t_end_ns) == (
        list(v2.name), v2.dur_ns.tolist(), v2.t_end_ns)


def test_heartbeats_and_job_events_get_the_steps_decoders_size_limit() -> None:
    small = StepsDecoder(max_bytes=50)
    for topic, raw in ((HEARTBEATS, hb_msg()), (JOBS, job_msg())):
        with pytest.raises(InvalidMessage, match="exceeds the 50-byte limit"):
            decode_input(topic, raw, small)
    assert isinstance(decode_input(HEARTBEATS, hb_msg(), StepsDecoder()), HeartbeatV1)


def test_a_rank_outside_the_jobs_declared_world_is_a_dead_letter_not_state() -> None:
    """Valid alone, but not for its job: a rank past the start event's world_size would size
    every detector's per-rank arrays (a real diagnoser here, not the fake)."""
    made: dict[str, JobDiagnoser] = {}

    def make(job: str) -> JobDiagnoser:
        made[job] = JobDiagnoser(job)
        return made[job]

    router = JobRouter(make, max_message_bytes=10_000, now_ns=clock(), idle_evict_s=60.0)
    assert router.handle(JOBS, 0, 0, b"j1", job_msg()).dead_letter is None  # world_size 2
    assert router.handle(STEPS, 0, 1, b"j1", step_msg(rank=1)).dead_letter is None
    far = orjson.dumps({"v": 1, "job": "j1", "rank": 1_000_000, "node": "n0", "ts_ns": T0,
                        "step": 1, "inflight": []})
    for offset, (topic, value) in enumerate([(STEPS, step_msg(rank=2)), (HEARTBEATS, far)], 2):
        dl = router.handle(topic, 0, offset, b"j1", value).dead_letter
        assert dl is not None and dl.reason.startswith("$.rank")
        assert "outside the job's world_size 2" in dl.reason
    assert router.dead_letters.by_cause["$.rank"] == 2
    assert made["j1"].hang.done.size <= 2  # nothing was sized by the far rank
    # and a rank no job could have is refused by the contract itself
    dl = router.handle(HEARTBEATS, 0, 9, b"j1", far.replace(b"1000000", b"1048576")).dead_letter
    assert dl is not None and dl.reason.startswith("$.rank")
