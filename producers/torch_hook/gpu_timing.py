"""GPU-side timing of a rank's ops: CUDA events recorded on the training thread, read elsewhere.

WHY: on NCCL, a collective call returns as soon as it is enqueued, so the host clock around
it measures the launch, not the transfer; compute phases likewise end on the host long
before their kernels do. What the GPU did is only known from events on its streams.

Two halves, on two threads:

- the training thread only *records* events (`GpuTimer.start` / `stop`: a CUDA event record
  each, no synchronisation), and only for ops that run on the GPU: groups whose backend is
  NCCL (decided once per group, `groups.GroupInfo.gpu`) with a CUDA tensor, and compute
  phases of a model on CUDA;
- the sender thread *resolves* a finished step's events (`GpuTimer.resolve`) before it
  builds the step's message: it waits for them with a bound that scales with the step time,
  maps them to the host clock, and hands back per row (start, end, issue latency). Rows
  whose events are not done in time keep their host times and get no issue latency (-1).

Where an op's end is measured. A synchronous collective makes the caller's stream wait for
NCCL's, so an event recorded after the call marks its end. An async one does not: its end
event is recorded where the stream next depends on it: in the Work's future callback (torch
runs it on a pool stream made to wait on the Work's CUDA events: `ivalue::Future::
invokeCallback`) or after `Work.wait()`. When NCCL times its own kernels
(TORCH_NCCL_ENABLE_TIMING=1), `Work.get_duration()` gives the duration on NCCL's stream, and
the op starts that long before its end (a start event on the caller's stream can precede the
kernel when NCCL's stream is still busy with an earlier collective).

Clock mapping. Event times are relative (`elapsed_time` between two events, in float32
milliseconds) and cannot be compared with a host clock directly. Per resolved step the sender
records an *anchor* event on a stream of its own, synchronises it and reads the host clock:
the anchor ran at that host time (within the wake-up latency of the synchronisation, a few
µs), so an event e ran at `anchor_host_ns - elapsed(e, anchor)`. A fresh anchor per step keeps
the float32 intervals short (µs precision up to seconds) and follows the host clock when NTP
slews it. The anchor is recorded after the step's events completed, so every interval is >= 0
(CUDA reports elapsed time between two completed events only).

No GPU was available to this project: the CUDA path has run only against `gpu_fake.FakeEvents`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from producers.torch_hook.buffer import START, Row

GpuTimes = dict[int, tuple[int, int, int]]  # id(row) -> (start_ns, end_ns, issue_ns)
Anchors = dict[Hashable, tuple[Any, int]]  # device -> (anchor event, its host ns)


class EventBackend(Protocol):
    """The few CUDA event operations GPU timing needs (a seam: `CudaEvents`, `FakeEvents`)."""

    def new_event(self) -> Any:
        """A timing event, not yet recorded."""

    def record(self, event: Any, stream: Any = None) -> None:
        """Record `event` on `stream` (None: the calling thread's current stream)."""

    def query(self, event: Any) -> bool:
        """Whether the work before `event` on its stream has completed (never blocks)."""

    def elapsed_ms(self, first: Any, second: Any) -> float:
        """Milliseconds from `first` to `second`, both recorded and completed."""

    def synchronize(self, event: Any) -> None:
        """Block until `event` has completed."""

    def device_of(self, event: Any) -> Hashable:
        """The device `event` was recorded on (events of different devices do not compare)."""

    def anchor_stream(self, device: Hashable) -> Any:
        """A private stream on `device` with no work of the training on it."""


class CudaEvents:
    """`EventBackend` over `torch.cuda.Event(enable_timing=True)`.

    Anchors go on a stream of their own per device (torch creates its streams non-blocking):
    an anchor there runs at once rather than behind the training's queued kernels. Either way
    the mapping holds (the host clock is read when the anchor has run); this only keeps the
    sender's synchronisation short.
    """

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda
        self._streams: dict[Hashable, Any] = {}

    def new_event(self) -> Any:
        return self._cuda.Event(enable_timing=True)

    def record(self, event: Any, stream: Any = None) -> None:
        event.record(stream)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def elapsed_ms(self, first: Any, second: Any) -> float:
        return float(first.elapsed_time(second))

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def device_of(self, event: Any) -> Hashable:
        return getattr(event, "device", None)

    def anchor_stream(self, device: Hashable) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = self._cuda.Stream(device=device)
        return stream


class GpuSpan:
    """The events of one op row: recorded on the training thread, read on the sender's.

    `end` is None until recorded; each field is set in one store, so the sender sees either
    nothing or a recorded event. `work` is the op's Work, kept for NCCL's own duration.
    """

    __slots__ = ("row", "start", "end", "work")

    def __init__(self, row: Row, start: Any) -> None:
        self.row = row
        self.start = start
        self.end: Any = None
        self.work: Any = None


@dataclass(slots=True)
class GpuStats:
    """What GPU timing did; never raised, only counted (`hook.gpu.stats`)."""

    spans: int = 0  # ops timed on the GPU
    resolved: int = 0  # ... whose GPU times reached a message
    unresolved: int = 0  # ... not done within the wait, or still in flight when the step
    #                      was sent: sent with host times and issue -1
    errors: int = 0
    first_error: str = ""

    def error(self, exc: BaseException) -> None:
        self.errors += 1
        if not self.first_error:
            self.first_error = f"{type(exc).__name__}: {exc}"


class GpuTimer:
    """Records GPU events around a rank's ops and resolves them into host-clock times.

    `clock` must be the op log's clock (the host times the GPU times replace). `nccl_timing`
    says NCCL times its own kernels (TORCH_NCCL_ENABLE_TIMING=1, read by the settings edge).
    The wait for a step's events is `wait_factor` x its host duration, within
    [`wait_min_s`, `wait_max_s`]; the cap keeps the sender's in-flight tables (how hangs are
    seen) at most that late. After one late step the next waits no more until one resolves
    in full: a GPU far behind (or hung) must not stall the sender once per queued step.
    `monotonic` and `sleep` are inputs so the wait is tested with a fake clock.
    """

    def __init__(
        self,
        backend: EventBackend,
        *,
        clock: Callable[[], int] = time.time_ns,
        nccl_timing: bool = False,
        wait_factor: float = 2.0,
        wait_min_s: float = 0.05,
        wait_max_s: float = 1.0,
        poll_s: float = 0.001,
        monotonic: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.backend = backend
        self.clock = clock
        self.nccl_timing = nccl_timing
        self.wait_factor = wait_factor
        self.wait_min_s = wait_min_s
        self.wait_max_s = wait_max_s
        self.poll_s = poll_s
        self.monotonic = monotonic
        self.sleep = sleep
        self.stats = GpuStats()
        # The current step's spans, behind one level of indirection like OpLog.rows_ref, so
        # `take` swaps the list in one store.
        self.spans_ref: list[list[GpuSpan]] = [[]]
        self._behind = False

    # -- training thread ---------------------------------------------------------------------
    def start(self, row: Row) -> GpuSpan | None:
        """Record `row`'s start event on the current stream; None if that failed (counted)."""
        b = self.backend
        try:
            event = b.new_event()
            b.record(event)
        except Exception as exc:
            self.stats.error(exc)
            return None
        span = GpuSpan(row, event)
        self.spans_ref[0].append(span)
        self.stats.spans += 1
        return span

    def stop(self, span: GpuSpan | None, stream: Any = None) -> None:
        """Record `span`'s end event (once; later calls, e.g. a second `wait()`, do nothing)."""
        if span is None or span.end is not None:
            return
        b = self.backend
        try:
            event = b.new_event()
            b.record(event, stream)
        except Exception as exc:
            self.stats.error(exc)
            return
        span.end = event

    def attach(self, span: GpuSpan | None, work: Any) -> None:
        """Keep an async op's Work for NCCL's own duration (only when NCCL times kernels)."""
        if span is not None and self.nccl_timing:
            span.work = work

    def take(self) -> list[GpuSpan]:
        """The finished step's spans (called with the op log's cut, on the training thread)."""
        spans = self.spans_ref[0]
        self.spans_ref[0] = []
        return spans

    # -- sender thread -----------------------------------------------------------------------
    def wait_budget_s(self, step_ns: int) -> float:
        """How long the sender waits for a step of `step_ns` (host time) to finish on the GPU."""
        if self._behind:
            return 0.0
        return min(self.wait_max_s, max(self.wait_min_s, self.wait_factor * step_ns / 1e9))

    def resolve(self, spans: list[GpuSpan], step_ns: int) -> GpuTimes:
        """GPU (start, end, issue latency) in host ns per row id, for the spans done in time.

        Runs on the sender thread; never raises (a failure leaves the rows their host times).
        """
        out: GpuTimes = {}
        if not spans:
            return out
        try:
            # An op whose end was never recorded is still in flight for the training thread
            # (an async op not yet waited for): no wait here would see it end.
            ended = [s for s in spans if s.end is not None or s.work is not None]
            todo = self._wait(ended, self.wait_budget_s(step_ns))
            self._behind = bool(todo)
            late = {id(s) for s in todo}
            anchors: Anchors = {}
            for span in ended:
                if id(span) not in late:
                    times = self._times(span, anchors)
                    if times is not None:
                        out[id(span.row)] = times
        except Exception as exc:
            self.stats.error(exc)
            out = {}
        self.stats.resolved += len(out)
        self.stats.unresolved += len(spans) - len(out)
        return out

    def _ready(self, span: GpuSpan) -> bool:
        q = self.backend.query
        if not q(span.start):
            return False
        if span.end is not None:
            return q(span.end)
        return span.work is not None and bool(span.work.is_completed())

    def _wait(self, spans: list[GpuSpan], budget_s: float) -> list[GpuSpan]:
        """Poll until every span is done or `budget_s` has passed; returns the ones not done."""
        deadline = self.monotonic() + budget_s
        todo = spans
        while True:
            todo = [s for s in todo if not self._ready(s)]
            left = deadline - self.monotonic()
            if not todo or left <= 0:
                return todo
            self.sleep(min(self.poll_s, left))

    def _anchor(self, device: Hashable, anchors: Anchors) -> tuple[Any, int]:
        got = anchors.get(device)
        if got is None:
            b = self.backend
            event = b.new_event()
            b.record(event, b.anchor_stream(device))
            b.synchronize(event)
            got = anchors[device] = (event, self.clock())
        return got

    def _host_ns(self, event: Any, anchors: Anchors) -> int:
        anchor, host_ns = self._anchor(self.backend.device_of(event), anchors)
        return host_ns - round(self.backend.elapsed_ms(event, anchor) * 1e6)

    def _duration_ns(self, work: Any) -> int | None:
        """NCCL's own duration of `work` (ms on its stream), None when it has none."""
        get = getattr(work, "get_duration", None) or getattr(work, "_get_duration", None)
        if get is None:
            return None
        try:
            ms = float(get())
        except Exception:  # timing off for this group, or the Work has no events
            return None
        return round(ms * 1e6) if ms >= 0 else None

    def _times(self, span: GpuSpan,
               anchors: Anchors) -> tuple[int, int, int] | None:
        start = self._host_ns(span.start, anchors)
        end = self._host_ns(span.end, anchors) if span.end is not None else None
        dur = self._duration_ns(span.work) if span.work is not None else None
        if dur is not None and end is not None:
            start = max(start, end - dur)
        elif dur is not None:
            end = start + dur
        elif end is None:
            return None
        end = max(end, start)
        # A GPU starts no work before the CPU issued it: a negative latency is anchor error.
        issue = max(0, start - span.row[START])
        return start, end, issue


def on_cuda(owner: Any) -> bool:
    """Whether a module's (or an optimizer's) first parameter is on a CUDA device. Asked per
    call, not once: a model may move to the GPU after it was instrumented.

    >>> import torch
    >>> on_cuda(torch.nn.Linear(2, 2)), on_cuda(torch.optim.SGD([torch.zeros(1)], lr=0.1))
    (False, False)
    """
    groups = getattr(owner, "param_groups", None)
    if groups is not None:
        first = next((p for g in groups for p in g["params"]), None)
    else:
        first = next(owner.parameters(), None)
    return bool(getattr(first, "is_cuda", False))


def gpu_timer(enabled: bool | Literal["auto"], *, nccl_timing: bool = False,
              clock: Callable[[], int] = time.time_ns) -> GpuTimer | None:
    """The GPU timer a hook should use: None when off, or when this process sees no CUDA
    device (then `enabled=True` changes nothing: there is nothing to time)."""
    if enabled is False:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
    except Exception:
        return None
    return GpuTimer(CudaEvents(), clock=clock, nccl_timing=nccl_timing)
