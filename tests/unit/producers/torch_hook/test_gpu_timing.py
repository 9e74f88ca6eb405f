"""GPU-side timing through the fake CUDA event backend (no GPU is lent to this project).

What is checked: the training thread only records events and the sender thread only reads
them; GPU times reach the wire mapped onto the host clock, with the issue latency; ops the
GPU has not finished in time keep their host times and say so (-1); NCCL's own duration is
used when it times its kernels; collectives and p2p on an NCCL group are timed, the same calls
on gloo are not; the message with `issue_ns` passes the worker's decoders.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import orjson
import pytest

from producers.torch_hook.buffer import (
    COMPUTE,
    END,
    NAME,
    START,
    OpLog,
    RankMeta,
    StepCut,
    steps_message,
)
from producers.torch_hook.gpu_fake import FakeEvents
from producers.torch_hook.gpu_timing import GpuTimer
from producers.torch_hook.groups import GroupRegistry
from producers.torch_hook.patch import HookStats, Patcher, TimedWork
from schemas.decode import decode_steps
from schemas.steps_decoder import StepsDecoder
from tests.unit.producers.torch_hook import test_patch

MS = 1_000_000


class Clock:
    """A host clock the test moves by hand (ns)."""

    def __init__(self, t: int = 1_000 * MS) -> None:
        self.t = t

    def __call__(self) -> int:
        return self.t


def timer(clock: Clock, gpu: FakeEvents, **kw) -> GpuTimer:
    slept: list[float] = []

    def sleep(s: float) -> None:  # the wait advances the fake monotonic clock
        slept.append(s)
        mono[0] += s

    mono = [0.0]
    t = GpuTimer(gpu, clock=clock, monotonic=lambda: mono[0], sleep=sleep, **kw)
    t.slept = slept  # type: ignore[attr-defined]
    return t


def meta() -> RankMeta:
    return RankMeta(job="j", rank=0, node="n0", local_rank=0, coords={})


def test_gpu_times_replace_host_times_and_carry_the_issue_latency():
    clock = Clock()
    gpu = FakeEvents(clock)
    t = timer(clock, gpu)
    log = OpLog(clock)
    # the host launches fwd at +0 and returns at +1 ms; the GPU runs it from +3 to +40 ms
    gpu.plan(clock.t + 3 * MS, clock.t + 40 * MS)
    row = log.begin(COMPUTE, "fwd", "", -1, 0)
    span = t.start(row)
    clock.t += 1 * MS
    t.stop(span)
    log.end(row)
    clock.t += 60 * MS  # the step ends on the host; the anchor runs now
    cut = log.cut()
    spans = t.take()
    assert t.take() == []  # the next step starts empty
    times = t.resolve(spans, cut.boundary_ns - cut.t_start_ns)
    start, end, issue = times[id(row)]
    assert (start - row[START], end - start, issue) == (3 * MS, 37 * MS, 3 * MS)
    msg = steps_message(meta(), cut, clock(), times)
    assert msg["ops"]["dur_ns"].tolist() == [37 * MS]
    assert msg["ops"]["issue_ns"].tolist() == [3 * MS]
    assert (t.stats.spans, t.stats.resolved, t.stats.unresolved) == (1, 1, 0)


def test_the_training_thread_records_and_the_sender_reads():
    clock = Clock()
    gpu = FakeEvents(clock, lag_ns=2 * MS)
    t = timer(clock, gpu)
    log = OpLog(clock)
    row = log.begin(COMPUTE, "bwd", "", -1, 0)
    span = t.start(row)
    clock.t += 5 * MS
    t.stop(span)
    log.end(row)
    spans = t.take()
    got: dict = {}
    sender = threading.Thread(target=lambda: got.update(t.resolve(spans, 5 * MS)))
    sender.start()
    sender.join()
    assert id(row) in got
    assert gpu.ops_by(threading.get_ident()) == {"new", "record"}  # never waits on the GPU
    assert gpu.ops_by(sender.ident) >= {"query", "elapsed", "synchronize"}
    # the anchor went on a stream of its own, not behind the training's work
    assert [c.stream for c in gpu.calls if c.op == "record" and c.thread == sender.ident] == [
        "anchor0"]


def test_ops_the_gpu_has_not_finished_keep_host_times_and_no_issue_latency():
    clock = Clock()
    gpu = FakeEvents(clock)
    t = timer(clock, gpu, wait_min_s=0.05, wait_max_s=1.0)
    log = OpLog(clock)
    gpu.plan(clock.t + 1 * MS, clock.t + 2 * MS, clock.t + 3 * MS, clock.t + 900 * MS)
    done_row = log.begin(COMPUTE, "fwd", "", -1, 0)
    t.stop(t.start(done_row))
    log.end(done_row)
    late_row = log.begin(COMPUTE, "bwd", "", -1, 0)
    t.stop(t.start(late_row))
    clock.t += 10 * MS
    log.end(late_row)
    gpu.progress_ns = clock.t  # the GPU is 890 ms behind the host
    cut = log.cut()
    times = t.resolve(t.take(), 10 * MS)
    assert list(times) == [id(done_row)]
    # it waited, but no longer than 2 steps (bounded below by wait_min_s)
    assert sum(t.slept) == pytest.approx(0.05)
    msg = steps_message(meta(), cut, clock(), times)
    assert msg["ops"]["issue_ns"].tolist() == [1 * MS, -1]
    assert msg["ops"]["dur_ns"].tolist()[1] == late_row[END] - late_row[START]
    # one late step: the next one does not wait again until one resolves in full
    assert t.wait_budget_s(10 * MS) == 0.0
    gpu.progress_ns = None
    row = log.begin(COMPUTE, "fwd", "", -1, 0)
    t.stop(t.start(row))
    log.end(row)
    assert id(row) in t.resolve(t.take(), 10 * MS)
    assert t.wait_budget_s(10 * MS) == pytest.approx(0.05)
    assert t.wait_budget_s(10_000 * MS) == 1.0  # capped: hang reports stay timely


def test_nccl_own_duration_is_used_when_nccl_times_its_kernels():
    clock = Clock()
    gpu = FakeEvents(clock)
    t = timer(clock, gpu, nccl_timing=True)
    log = OpLog(clock)
    # the start event on the caller's stream runs at +1 ms, but NCCL's stream was busy: the
    # kernel ran 4 ms, ending at +20 ms, so it started at +16 ms
    gpu.plan(clock.t + 1 * MS, clock.t + 20 * MS)
    row = log.begin("coll", "all_reduce", "dp.0", 0, 64)
    span = t.start(row)
    t.attach(span, SimpleNamespace(get_duration=lambda: 4.0, is_completed=lambda: True))
    t.stop(span)
    clock.t += 30 * MS
    log.end(row)
    start, end, issue = t.resolve(t.take(), 30 * MS)[id(row)]
    assert (start - row[START], end - start, issue) == (16 * MS, 4 * MS, 16 * MS)
    # an async op whose end was never recorded: NCCL's duration gives it
    gpu.plan(clock.t + 2 * MS)
    row = log.begin("coll", "all_reduce", "dp.0", 1, 64)
    t.attach(t.start(row), SimpleNamespace(get_duration=lambda: 3.0, is_completed=lambda: True))
    start, end, _ = t.resolve(t.take(), 30 * MS)[id(row)]
    assert (start - row[START], end - start) == (2 * MS, 3 * MS)


def test_a_broken_backend_never_reaches_training():
    class Broken(FakeEvents):
        def record(self, event, stream=None):
            raise RuntimeError("CUDA error: an illegal memory access")

    clock = Clock()
    t = timer(clock, Broken(clock))
    log = OpLog(clock)
    row = log.begin(COMPUTE, "fwd", "", -1, 0)
    assert t.start(row) is None
    t.stop(None)
    assert t.stats.errors == 1 and "illegal memory access" in t.stats.first_error
    assert t.resolve(t.take(), MS) == {}


# -- the hook's wrappers on an NCCL group ----------------------------------------------------
class Tensor(test_patch.Tensor):
    def __init__(self, nbytes: int, cuda: bool) -> None:
        super().__init__(nbytes)
        self.is_cuda = cuda


class Future:
    def __init__(self) -> None:
        self.callbacks: list = []

    def add_done_callback(self, fn) -> None:
        self.callbacks.append(fn)

    def finish(self) -> None:
        for fn in self.callbacks:
            fn(self)


class Work(test_patch.Work):
    """An async collective's Work, with a future (NCCL's have one; gloo p2p's do not)."""

    def __init__(self) -> None:
        super().__init__()
        self.fut = Future()

    def get_future(self):
        return self.fut


def fake_dist(backend: str):
    """test_patch's stand-in of c10d, plus all_reduce and a backend for its groups."""
    dist = test_patch.make_c10d(0)
    dist.distributed_c10d.all_reduce = lambda tensor, op=None, group=None, async_op=False: (
        Work() if async_op else None)
    dist.get_backend = lambda pg=None: backend
    return dist


def patched(backend: str):
    clock = Clock()
    gpu = FakeEvents(clock)
    t = timer(clock, gpu)
    dist = fake_dist(backend)
    log = OpLog(clock)
    Patcher(dist, log, GroupRegistry(dist, gpu=True), HookStats(), t).install()
    return dist, log, t, gpu


def test_collectives_and_p2p_on_nccl_are_timed_on_the_gpu():
    dist, log, t, gpu = patched("nccl")
    c10d = dist.distributed_c10d
    c10d.all_reduce(Tensor(64, cuda=True))  # synchronous: ends when the call returns
    work = c10d.all_reduce(Tensor(64, cuda=True), async_op=True)
    send = c10d.isend(Tensor(8, cuda=True), 1)
    c10d.all_reduce(Tensor(64, cuda=False))  # a CPU tensor on NCCL: nothing to time
    spans = t.spans_ref[0]
    assert [(s.row[NAME], s.end is not None) for s in spans] == [
        ("all_reduce", True), ("all_reduce", False), ("send", False)]
    work.fut.finish()  # the future callback records the async op's end
    assert isinstance(send, TimedWork)
    send.wait()  # so does wait(): the stream now depends on the transfer
    send.wait()  # and only once
    assert all(s.end is not None for s in spans)
    assert sum(c.op == "record" for c in gpu.calls) == 6
    assert not log.pending
    times = t.resolve(t.take(), 10 * MS)
    assert set(times) == {id(s.row) for s in spans}


def test_gloo_groups_pay_nothing_for_gpu_timing():
    dist, log, t, gpu = patched("gloo")
    c10d = dist.distributed_c10d
    c10d.all_reduce(Tensor(64, cuda=True))
    c10d.isend(Tensor(8, cuda=True), 1).wait()
    assert len(log.rows) == 2 and t.spans_ref[0] == [] and gpu.calls == []


def test_the_message_with_issue_latency_passes_both_decoders():
    clock = Clock()
    gpu = FakeEvents(clock, lag_ns=1 * MS)
    t = timer(clock, gpu)
    log = OpLog(clock)
    fwd = log.begin(COMPUTE, "fwd", "", -1, 0)
    t.stop(t.start(fwd))
    clock.t += 8 * MS
    log.end(fwd)
    ar = log.begin("coll", "all_reduce", "dp.0", 0, 64)  # host-timed (gloo): issue -1
    clock.t += 2 * MS
    log.end(ar)
    cut: StepCut = log.cut()
    times = t.resolve(t.take(), 10 * MS)
    raw = orjson.dumps(steps_message(meta(), cut, clock(), times),
                       option=orjson.OPT_SERIALIZE_NUMPY)
    assert orjson.loads(raw)["ops"]["issue_ns"] == [1 * MS, -1]
    plain = decode_steps(raw)
    fast = StepsDecoder().decode(raw)
    assert plain.n_ops == fast.n_ops == 2
    assert plain.dur_ns.tolist() == fast.dur_ns.tolist()
