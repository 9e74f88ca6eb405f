"""The collective wrappers' hot path against a stand-in of torch's c10d module (fake clock).

A synchronous collective on the CPU path is logged as a tuple and replaced by its finished
tuple when the call returns, so that a step of many ops holds nothing the cyclic GC walks
(`buffer`'s module doc). What is checked: the step's message is byte for byte what list rows
give (the representation before), with phases cut around the ops, GC stalls inside them, async
ops and a cut taken while an op is in flight; the op is in the in-flight table during the call;
the collector stops tracking the finished rows; rows logged during the call (a GC stall,
another thread's ops) do not take the op's end.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest

from producers.torch_hook.buffer import (
    COLL,
    COMPUTE,
    END,
    OpLog,
    RankMeta,
    StepCut,
    encode,
    seal,
    steps_message,
)
from producers.torch_hook.groups import GroupRegistry
from producers.torch_hook.patch import HookStats, Patcher
from schemas.decode import decode_steps
from schemas.testing import FakeClock

META = RankMeta("job-a", 0, "node-1", local_rank=0, world_size=2, coords={})


class Tensor:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class PG:
    group_name, group_desc = "0", "default_pg"


class Future:
    def __init__(self) -> None:
        self.callbacks: list = []

    def add_done_callback(self, fn) -> None:
        self.callbacks.append(fn)


class Work:
    def __init__(self) -> None:
        self.fut = Future()

    def get_future(self) -> Future:
        return self.fut


def install(clock: FakeClock, during=None):
    """A patched fake c10d whose all_reduce takes 700 ns and runs `during(call number)`."""
    world = PG()
    calls = [0]

    def all_reduce(tensor, op=None, group=None, async_op=False):
        calls[0] += 1
        clock.advance_ns(300)
        if during is not None:
            during(calls[0])
        clock.advance_ns(400)
        return Work() if async_op else None

    def passthrough(*a, **k):
        return None

    c10d = SimpleNamespace(all_reduce=all_reduce, _get_default_group=lambda: world,
                           _get_process_group_name=lambda pg: pg.group_name)
    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv",
                 "destroy_process_group", "init_process_group"):
        setattr(c10d, name, passthrough)
    dist = SimpleNamespace(distributed_c10d=c10d, get_rank=lambda group=None: 0,
                           all_reduce=all_reduce)
    log = OpLog(clock)
    stats = HookStats()
    Patcher(dist, log, GroupRegistry(dist), stats).install()
    log_stats.append(stats)
    return dist, log


log_stats: list[HookStats] = []


@pytest.fixture(autouse=True)
def _no_hook_errors():
    """The hook swallows its own errors: a test whose ops went unlogged must fail."""
    log_stats.clear()
    yield
    assert [s.first_error for s in log_stats if s.hook_errors] == []


def as_lists(cut: StepCut) -> StepCut:
    """The same step with every row a list, as the hot path logged it before tuples."""
    rows = [list(r) if isinstance(r, tuple) else r for r in cut.rows]
    return StepCut(cut.step, cut.t_start_ns, cut.boundary_ns, rows, cut.gpu)


def test_a_step_of_many_ops_sends_the_bytes_list_rows_sent():
    clock = FakeClock(start_ns=1_000_000_000)
    log_box: list[OpLog] = []
    cuts: list[StepCut] = []

    def during(k: int) -> None:
        log = log_box[0]
        if k % 97 == 0:  # a collection inside the call: a blocking stall within a blocking op
            gc_row = log.begin(COMPUTE, "host:gc", "", -1, 0, True)
            clock.advance_ns(50)
            log.end(gc_row)
        if k == 2_500:  # another thread ends the step while this op is in flight
            assert k - 1 in [op["seq"] for op in log.inflight()["inflight"]]
            cuts.append(log.cut())

    dist, log = install(clock, during)
    log_box.append(log)
    works = []
    t = Tensor(4096)
    for k in range(3_000):
        if k % 500 == 0:
            fwd = log.begin(COMPUTE, "fwd", "", -1, 0)
        if k % 250 == 3:
            works.append(dist.all_reduce(t, async_op=True))
        else:
            dist.all_reduce(t)
        clock.advance_ns(100)
        if k % 500 == 499:
            log.end(fwd)
    for w in works[:-1]:  # the last async op is still in flight when its step is sent
        w.fut.callbacks[0](w.fut)
    cuts.append(log.cut())
    clock.advance_ns(1_000)
    assert [r[END] for r in log.pending.values()] == [-1]
    for cut in cuts:
        assert sum(isinstance(r, tuple) for r in cut.rows) > 400  # the hot path's rows
        raw = encode(steps_message(META, cut, clock()))
        assert raw == encode(steps_message(META, as_lists(cut), clock()))
        m = decode_steps(raw)
        assert m.n_ops > len(cut.rows)  # the phases were cut around the ops
    # the op in flight at the first cut stays in that step, with the end it got later
    first = cuts[0].rows
    (straddling,) = [r for r in first if r[0] == COLL and r[3] == 2_499]
    assert isinstance(straddling, tuple) and straddling[END] > cuts[0].boundary_ns


def test_the_collector_stops_tracking_a_steps_finished_rows():
    clock = FakeClock()
    dist, log = install(clock)
    t = Tensor(64)
    for _ in range(2_000):
        dist.all_reduce(t)
    gc.collect(0)  # a young collection, as the interpreter runs every few hundred allocations
    assert len(log.rows) == 2_000 and not log.pending
    assert not any(gc.is_tracked(r) for r in log.rows)


def test_a_synchronous_op_is_in_flight_during_the_call_and_ends_if_it_raises():
    clock = FakeClock()
    seen = []

    def during(k: int) -> None:
        seen.append(log.inflight()["inflight"])
        if k == 2:
            raise RuntimeError("peer gone")

    dist, log = install(clock, during)
    dist.all_reduce(Tensor(8))
    with pytest.raises(RuntimeError, match="peer gone"):
        dist.all_reduce(Tensor(8))
    assert [[(op["name"], op["seq"]) for op in table] for table in seen] == [
        [("all_reduce", 0)], [("all_reduce", 1)]]
    assert not log.pending and all(r[END] - r[4] == 300 for r in log.rows[1:])


def test_seal_finds_the_row_when_others_were_logged_during_the_call():
    flying = (COLL, "all_reduce", "world.0", 0, 10, -1, 8, True)
    other = [COMPUTE, "host:gc", "", -1, 11, -1, 0, True]
    step: list = [flying, other, list(other)]  # a GC stall and a row of another thread
    done = (*flying[:END], 20, *flying[END + 1:])
    seal(step, flying, done)
    assert step == [done, other, other] and step[0] is done
    seal(step, flying, done)  # not there any more: nothing happens, nothing raises
    assert step == [done, other, other]
