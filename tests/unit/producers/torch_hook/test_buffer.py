"""The hook's op log and its steps messages, on the fake clock (no torch needed)."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from producers.torch_hook.buffer import (
    BLOCKS,
    COLL,
    COMPUTE,
    END,
    NAME,
    P2P,
    START,
    OpLog,
    RankMeta,
    StepCut,
    encode,
    exclusive_compute,
    steps_message,
)
from schemas.decode import decode_steps
from schemas.rankstep import KIND_CODE
from schemas.testing import FakeClock

META = RankMeta("job-a", 3, "node-1", local_rank=1, world_size=4, coords={"tp": 1})


def test_ops_become_one_columnar_step():
    clock = FakeClock(start_ns=1_000_000_000)
    log = OpLog(clock)
    t0 = clock()
    clock.advance_ns(100)
    fwd = log.begin(COMPUTE, "fwd", "", -1, 0)
    clock.advance_ns(5_000)
    log.end(fwd)
    ar = log.begin(COLL, "all_reduce", "dp.0", 7, 4096)
    clock.advance_ns(800)
    log.end(ar)
    send = log.begin(P2P, "send", "pp.1.3-4", 2, 64)
    clock.advance_ns(300)
    log.end(send)
    opt = log.begin(COMPUTE, "optimizer", "", -1, 0)
    clock.advance_ns(50)
    log.end(opt)
    clock.advance_ns(10)
    cut = log.cut()
    assert cut.step == 0 and log.step == 1 and log.step_t0 == clock()
    m = decode_steps(encode(steps_message(META, cut, clock())))
    assert (m.job, m.rank, m.node, m.local_rank, m.step) == ("job-a", 3, "node-1", 1, 0)
    assert m.coords == {"tp": 1}
    assert m.t_start_ns == t0 and m.t_end_ns == t0 + 100 + 5_000 + 800 + 300 + 50
    assert m.name == ["fwd", "all_reduce", "send", "optimizer"]
    assert m.group == ["", "dp.0", "pp.1.3-4", ""]
    assert m.seq.tolist() == [0, 7, 2, 1]  # compute ops numbered within the step
    assert m.start_ns.tolist() == [100, 5_100, 5_900, 6_200]
    assert m.dur_ns.tolist() == [5_000, 800, 300, 50]
    assert m.bytes.tolist() == [0, 4096, 64, 0]


def test_empty_step_is_valid_and_windows_chain():
    clock = FakeClock(start_ns=1_000_000_000)
    log = OpLog(clock)
    clock.advance_ns(1_000)
    a = log.cut()
    clock.advance_ns(2_000)
    b = log.cut()
    assert b.t_start_ns == a.boundary_ns
    m = decode_steps(encode(steps_message(META, b, clock())))
    assert m.step == 1 and m.n_ops == 0 and m.t_end_ns - m.t_start_ns == 2_000


def test_inflight_table_lists_pending_communication_only():
    clock = FakeClock(start_ns=1_000_000_000)
    log = OpLog(clock)
    log.begin(COMPUTE, "fwd", "", -1, 0)  # compute in flight is not reported
    clock.advance_ns(10)
    ar = log.begin(COLL, "all_reduce", "dp.0", 5, 8)
    clock.advance_ns(10)
    done = log.begin(COLL, "broadcast", "world.0", 1, 8)
    log.end(done)
    table = log.inflight()
    assert table == {"step": 0, "inflight": [
        {"group": "dp.0", "name": "all_reduce", "seq": 5, "start_ns": ar[4]}]}
    log.end(ar)
    assert log.inflight()["inflight"] == []


def test_op_still_in_flight_at_send_gets_a_lower_bound_duration():
    clock = FakeClock(start_ns=1_000_000_000)
    log = OpLog(clock)
    log.begin(COLL, "all_reduce", "dp.0", 0, 8)
    clock.advance_ns(1_000)
    cut = log.cut()
    clock.advance_ns(500)
    m = decode_steps(encode(steps_message(META, cut, clock())))
    assert m.dur_ns.tolist() == [1_500]
    assert log.inflight()["inflight"][0]["seq"] == 0  # still reported until it ends


_kinds = st.sampled_from([COMPUTE, COLL, P2P])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(_kinds, st.integers(0, 10**6), st.integers(0, 10**6),
                          st.integers(0, 2**40), st.booleans()), max_size=40))
def test_any_op_sequence_builds_a_valid_message(ops):
    clock = FakeClock(start_ns=1_000_000_000)
    log = OpLog(clock)
    for kind, gap, dur, nbytes, finish in ops:
        clock.advance_ns(gap)
        group = "" if kind == COMPUTE else "pg.1"
        row = log.begin(kind, "x", group, 0, nbytes if kind != COMPUTE else 0)
        clock.advance_ns(dur)
        if finish:
            log.end(row)
    cut = log.cut()
    raw = encode(steps_message(META, cut, clock()))
    m = decode_steps(raw)
    assert m.n_ops == len(ops)
    assert (m.dur_ns >= 0).all() and (m.start_ns >= 0).all()
    assert m.t_end_ns >= m.t_start_ns
    assert orjson.loads(raw)["v"] == 1


def test_messages_have_the_contract_key_order():
    clock = FakeClock(start_ns=1_000_000_000)
    log = OpLog(clock)
    log.end(log.begin(COLL, "all_reduce", "dp.0", 0, 8))
    msg = steps_message(META, log.cut(), clock())
    assert list(msg) == ["v", "job", "rank", "node", "local_rank", "step", "t_start_ns",
                         "t_end_ns", "coords", "ops"]


def test_a_phase_is_sent_without_the_blocking_collectives_called_inside_it():
    """A tensor-parallel forward calls its all-reduce from inside the timed phase: the wait
    for the group's slowest member is not this rank's compute, an async op's time is."""
    clock = FakeClock(start_ns=1_000_000_000)
    log = OpLog(clock)
    fwd = log.begin(COMPUTE, "fwd", "", -1, 0)
    clock.advance_ns(4_000)
    ar = log.begin(COLL, "all_reduce", "tp.0", 3, 64, blocks=True)
    clock.advance_ns(50_000)  # waits for a slow peer
    log.end(ar)
    bucket = log.begin(COLL, "all_reduce", "dp.0", 8, 4096)  # async: the thread goes on
    clock.advance_ns(6_000)
    log.end(bucket)
    log.end(fwd)
    m = decode_steps(encode(steps_message(META, log.cut(), clock())))
    assert m.name == ["fwd", "all_reduce", "fwd", "all_reduce"]
    assert m.start_ns.tolist() == [0, 4_000, 54_000, 54_000]
    assert m.dur_ns.tolist() == [4_000, 50_000, 6_000, 6_000]
    assert m.seq.tolist() == [0, 3, 1, 8]  # compute ops are numbered within the step


def test_host_stalls_cut_the_phase_they_sit_in_and_are_never_cut_themselves():
    """A GC pause inside a checkpoint save inside a forward: the forward keeps only what it
    computed, and both stalls arrive whole (a wait is not a phase, and stalls may nest)."""
    clock = FakeClock(start_ns=1_000_000_000)
    log = OpLog(clock)
    fwd = log.begin(COMPUTE, "fwd", "", -1, 0)
    clock.advance_ns(3_000)
    ckpt = log.begin(COMPUTE, "host:checkpoint", "", -1, 0, blocks=True)
    clock.advance_ns(1_000)
    gc_row = log.begin(COMPUTE, "host:gc", "", -1, 0, blocks=True)
    clock.advance_ns(2_000)
    log.end(gc_row)
    clock.advance_ns(4_000)
    log.end(ckpt)
    clock.advance_ns(500)
    log.end(fwd)
    rows = log.cut().rows
    out = exclusive_compute(rows)
    assert [(r[NAME], r[START] - fwd[START], r[END] - fwd[START]) for r in out] == [
        ("fwd", 0, 3_000), ("host:checkpoint", 3_000, 10_000), ("host:gc", 4_000, 6_000),
        ("fwd", 10_000, 10_500)]
    assert out[1] is ckpt and out[2] is gc_row  # passed through as they are
    m = decode_steps(encode(steps_message(META, StepCut(0, fwd[START], fwd[END], rows),
                                          clock())))
    assert m.name == ["fwd", "host:checkpoint", "host:gc", "fwd"]
    assert m.dur_ns.tolist() == [3_000, 7_000, 2_000, 500]
    assert m.group == ["", "", "", ""] and m.bytes.tolist() == [0, 0, 0, 0]
    assert m.kind.tolist() == [KIND_CODE["compute"]] * 4


def _covered(phase: list, waits: list[tuple[int, int]]) -> int:
    """How many nanoseconds of `phase` some wait covers (counted one by one: small spans)."""
    return len({t for s, e in waits for t in range(max(s, phase[START]), min(e, phase[END]))})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["fwd", "host:gc", "all_reduce"]),
                          st.integers(0, 200), st.integers(1, 80), st.booleans()),
                max_size=16))
def test_phases_keep_exactly_their_time_outside_every_blocking_op(spans):
    rows = [[COLL if name == "all_reduce" else COMPUTE, name, "", -1, s, s + d, 0,
             name == "host:gc" or blocks] for name, s, d, blocks in spans]
    waits = [(r[START], r[END]) for r in rows if r[BLOCKS]]
    out = exclusive_compute([list(r) for r in rows])
    others = sorted(r for r in rows if r[NAME] != "fwd")
    assert sorted(r for r in out if r[NAME] != "fwd") == others  # never cut, never dropped
    pieces = [r for r in out if r[NAME] == "fwd"]
    assert all(p[START] < p[END] for p in pieces)
    assert all(p[END] <= s or p[START] >= e for p in pieces for s, e in waits)
    assert sum(p[END] - p[START] for p in pieces) == sum(
        r[END] - r[START] - _covered(r, waits) for r in rows if r[NAME] == "fwd")
