"""ShardStage (stage 1 of a split job): dead letters, committable offsets, the partial frames
it sends, time passing by `tick`, eviction and revocation. No Kafka: records in, messages
out, with a fake clock."""

from __future__ import annotations

import base64

import msgspec
import orjson
import pytest

from detectors.testing import rank_step
from schemas.clock import NS_PER_S
from schemas.partial_frame import GONE, PartialFrame, decode_partial
from schemas.testing import FakeClock
from schemas.topics import DEADLETTER, PARTIALS, SHARD_STEPS
from schemas.wire import DeadLetterV1
from streams.shard_stage import Message, ShardStage

T0 = 10**18
MS = 1_000_000
OPS = [("compute", "fwd", "", 0, 0.0, 9.0, 0)]  # every step: one 9 ms op


def t_start(rank: int, step: int) -> int:
    """Steps 100 ms apart; a rank 1 ms after the one before it."""
    return T0 + step * 100 * MS + rank * MS


def t_end(rank: int, step: int) -> int:
    return t_start(rank, step) + 9 * MS


def value(rank: int, step: int, job: str = "j") -> bytes:
    msg = rank_step(rank, "n0", step, OPS, job=job, t0_ns=t_start(rank, step))
    return orjson.dumps(msg.to_wire())


def make_stage(clock: FakeClock, idle_evict_s: float = 600.0) -> ShardStage:
    return ShardStage(max_message_bytes=2**20, now_ns=clock, shard_ranks=2, grace_s=1.0,
                      idle_evict_s=idle_evict_s)


def put(stage: ShardStage, partition: int, offset: int, rank: int, step: int,
        job: str = "j") -> list[Message]:
    """One good record of `rank`'s `step`, keyed by its shard."""
    key = f"{job}/{rank // stage.shard_ranks}".encode()
    return stage.on_record(partition, offset, key, value(rank, step, job)).sent


def partials(sent: list[Message]) -> list[PartialFrame]:
    return [decode_partial(v) for t, _, v in sent if t == PARTIALS]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(start_ns=0)


# ---- dead letters -------------------------------------------------------------------------
BAD_RECORDS = {  # id: (key, value, cause, reason prefix)
    "key-not-job/shard": (b"j", value(0, 1), "$key", "$key: "),
    "key-shard-not-rank's": (b"j/1", value(0, 1), "$key", "$key: "),
    "key-job-not-message's": (b"k/0", value(0, 1), "$key", "$key: "),
    "invalid-json": (b"j/0", b"{not json", "$", "$: "),
    "no-value": (b"j/0", None, "$", "$: "),
}


@pytest.mark.parametrize(("key", "raw", "cause", "prefix"), list(BAD_RECORDS.values()),
                         ids=list(BAD_RECORDS))
def test_bad_record_is_one_dead_letter_with_its_coordinates_and_reason(
        clock: FakeClock, key: bytes, raw: bytes | None, cause: str, prefix: str) -> None:
    stage = make_stage(clock)
    sent = stage.on_record(3, 42, key, raw).sent
    assert [t for t, _, _ in sent] == [DEADLETTER]
    dl = msgspec.json.decode(sent[0][2], type=DeadLetterV1)
    assert (dl.topic, dl.partition, dl.offset) == (SHARD_STEPS, 3, 42)
    assert dl.reason.startswith(prefix), dl.reason
    assert base64.b64decode(dl.payload_b64) == (raw or b"")
    assert stage.dead_letters.total == 1
    assert stage.dead_letters.by_cause == {cause: 1}
    assert stage.shards == {} and stage.partials_sent == 0
    assert stage.committable(3) == 43  # read, and nothing of it pending


def test_bad_records_between_good_ones_change_no_partial(clock: FakeClock) -> None:
    good = [(0, 0), (1, 0), (0, 1), (1, 1)]  # (rank, step)
    clean = make_stage(clock)
    expected = [v for off, (r, s) in enumerate(good) for t, _, v in put(clean, 0, off, r, s)]
    assert len(expected) == 2  # steps 0 and 1

    stage = make_stage(clock)
    bad = list(BAD_RECORDS.values())
    sent: list[Message] = []
    for i, (r, s) in enumerate(good):  # good, bad, good, bad, ..., good, bad, bad
        sent += put(stage, 0, 2 * i, r, s)
        sent += stage.on_record(0, 2 * i + 1, bad[i][0], bad[i][1]).sent
    sent += stage.on_record(0, 8, bad[4][0], bad[4][1]).sent
    assert [v for t, _, v in sent if t == PARTIALS] == expected
    dead = [msgspec.json.decode(v, type=DeadLetterV1) for t, _, v in sent if t == DEADLETTER]
    assert [d.offset for d in dead] == [1, 3, 5, 7, 8]
    assert stage.dead_letters.total == 5
    assert stage.dead_letters.by_cause == {"$key": 3, "$": 2}


# ---- committable offsets ------------------------------------------------------------------
def test_committable_is_none_for_a_partition_never_read(clock: FakeClock) -> None:
    stage = make_stage(clock)
    put(stage, 0, 5, 0, 0)
    assert stage.committable(1) is None


def test_committable_is_the_oldest_offset_a_pending_step_holds(clock: FakeClock) -> None:
    stage = make_stage(clock)
    put(stage, 0, 10, 0, 0)
    put(stage, 0, 11, 1, 0)
    assert stage.committable(0) == 10  # step 0 waits for a next step
    assert partials(put(stage, 0, 12, 0, 1))[0].frame.step == 0
    assert stage.committable(0) == 12  # step 1 holds 12 now


def test_committable_is_the_minimum_over_shards_of_one_partition(clock: FakeClock) -> None:
    stage = make_stage(clock)
    put(stage, 0, 10, 0, 0)  # shard 0 (ranks 0, 1)
    put(stage, 0, 11, 2, 0)  # shard 1 (ranks 2, 3), same partition
    put(stage, 0, 12, 1, 0)
    put(stage, 0, 13, 3, 0)
    assert stage.committable(0) == 10
    assert [p.shard for p in partials(put(stage, 0, 14, 0, 1))] == [0]
    assert stage.committable(0) == 11  # shard 1's step 0 is still pending
    assert [p.shard for p in partials(put(stage, 0, 15, 2, 1))] == [1]
    assert stage.committable(0) == 14  # both shards' step 1 pending: 14 and 15


def test_committable_is_the_next_offset_once_nothing_is_pending(clock: FakeClock) -> None:
    stage = make_stage(clock)
    for off, (r, s) in enumerate([(0, 0), (1, 0), (0, 1)], start=20):
        put(stage, 0, off, r, s)
    assert stage.committable(0) == 22
    assert [p.frame.step for p in partials(put(stage, 0, 23, 1, 1))] == [1]
    assert stage.committable(0) == 24


# ---- the partial frames -------------------------------------------------------------------
def test_partial_holds_the_shards_ranks_only(clock: FakeClock) -> None:
    stage = make_stage(clock)
    sent: list[Message] = []
    for off, (r, s) in enumerate((r, s) for s in (0, 1) for r in range(4)):
        sent += put(stage, 0, off, r, s)
    got = partials(sent)
    assert sorted((p.frame.step, p.shard, p.frame.rank.tolist()) for p in got) == [
        (0, 0, [0, 1]), (0, 1, [2, 3]), (1, 0, [0, 1]), (1, 1, [2, 3])]
    assert {p.shard_ranks for p in got} == {2}
    assert {k for t, k, _ in sent} == {b"j"}  # keyed by job


def test_watermark_is_the_latest_end_when_nothing_is_pending(clock: FakeClock) -> None:
    stage = make_stage(clock)
    for off, (r, s) in enumerate([(0, 0), (1, 0), (0, 1)]):
        put(stage, 0, off, r, s)
    [p] = partials(put(stage, 0, 3, 1, 1))  # rank 1 ends after rank 0
    assert p.frame.step == 1
    assert p.watermark_ns == t_end(1, 1)


def test_watermark_is_never_past_the_oldest_pending_step(clock: FakeClock) -> None:
    stage = make_stage(clock)
    for off, (r, s) in enumerate([(0, 0), (1, 0), (0, 1), (0, 2), (0, 3)]):
        put(stage, 0, off, r, s)
    [p] = partials(put(stage, 0, 5, 1, 1))  # step 1 whole; steps 2 and 3 wait for rank 1
    assert p.frame.step == 1
    assert p.watermark_ns == t_end(0, 2)  # when step 2 began to wait
    assert p.watermark_ns < t_end(0, 3)  # the shard's latest end


# ---- tick -------------------------------------------------------------------------------
def silent_rank_1(stage: ShardStage) -> None:
    """Steps 0 and 1 whole and sent; rank 1 says nothing of step 2."""
    for off, (r, s) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]):
        put(stage, 0, off, r, s)


def test_tick_sends_a_step_missing_a_silent_rank_after_the_grace(clock: FakeClock) -> None:
    stage = make_stage(clock)
    silent_rank_1(stage)
    clock.advance(0.5)
    assert stage.tick([0]).sent == []  # within the grace
    clock.advance(0.6)
    [p] = partials(stage.tick([0]).sent)
    assert (p.frame.step, p.frame.rank.tolist(), p.frame.missing.tolist()) == (2, [0], [1])
    assert stage.committable(0) == 5


def test_tick_leaves_partitions_not_caught_up_alone(clock: FakeClock) -> None:
    stage = make_stage(clock)
    silent_rank_1(stage)
    clock.advance(5.0)
    assert stage.tick([]).sent == []
    assert stage.tick([1]).sent == []
    assert stage.committable(0) == 4  # step 2 still held
    assert [p.frame.step for p in partials(stage.tick([0]).sent)] == [2]


def test_tick_sends_a_watermark_alone_every_quarter_grace(clock: FakeClock) -> None:
    stage = make_stage(clock)
    for off, (r, s) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        put(stage, 0, off, r, s)  # nothing pending
    last = t_end(1, 1)
    clock.advance(0.25)
    [p] = partials(stage.tick([0]).sent)
    assert p.frame.n_ranks == 0 and p.shard == 0
    assert p.watermark_ns == last + NS_PER_S // 4
    assert stage.tick([0]).sent == []  # the clock did not move
    clock.advance(0.1)
    assert stage.tick([0]).sent == []  # less than a quarter grace since the last
    clock.advance(0.15)
    [p] = partials(stage.tick([0]).sent)
    assert p.frame.n_ranks == 0 and p.watermark_ns == last + NS_PER_S // 2


# ---- eviction and revocation ----------------------------------------------------------------
def test_idle_shard_is_flushed_marked_gone_and_dropped(clock: FakeClock) -> None:
    stage = make_stage(clock, idle_evict_s=0.5)  # before step 1's grace of 1 s is over
    for off, (r, s) in enumerate([(0, 0), (1, 0), (0, 1)]):
        put(stage, 0, off, r, s)
    clock.advance(0.4)
    assert stage.tick([0]).sent == [] and stage.shards
    clock.advance(0.2)
    got = partials(stage.tick([0]).sent)
    assert [(p.frame.step, p.frame.rank.tolist(), p.frame.missing.tolist())
            for p in got[:-1]] == [(1, [0], [1])]
    assert got[-1].frame.n_ranks == 0 and got[-1].watermark_ns == GONE
    assert stage.shards == {}
    assert stage.committable(0) == 3


def test_revoke_drops_only_the_partitions_shards(clock: FakeClock) -> None:
    stage = make_stage(clock)
    put(stage, 0, 7, 0, 0)  # j/0 on partition 0
    put(stage, 0, 8, 0, 0, job="k")  # k/0 on partition 0
    put(stage, 1, 3, 2, 0)  # j/1 on partition 1
    assert stage.revoke([0]) == 2
    assert list(stage.shards) == [("j", 1)]
    assert stage.committable(0) is None
    assert stage.committable(1) == 3
