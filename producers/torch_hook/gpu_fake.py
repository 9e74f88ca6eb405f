"""`FakeEvents`: a stand-in for CUDA events that records every call it is asked to make.

No GPU is lent to this project, so the GPU timing path (`gpu_timing`) is tested against this
fake, which ships with the code like `storage.testing`. It keeps a GPU timeline the test
sets: an event recorded on a training stream runs at the next time of `plan(...)` (else at
the host clock plus `lag_ns`); an event on an anchor stream runs at once (an idle stream);
`progress_ns` says how far the GPU has got (None: everything recorded is done). Times are
given on the host's scale and kept on a GPU clock `offset_ns` away, as a real device's clock
is, so a test sees the mapping to host time do its work. Every call is kept in `calls` with
the thread that made it, so a test can tell which thread recorded and which one read.

>>> t = [1_000]
>>> gpu = FakeEvents(lambda: t[0])
>>> gpu.plan(5_000)
>>> e = gpu.new_event(); gpu.record(e)
>>> gpu.progress_ns = 4_000; gpu.query(e)
False
>>> gpu.progress_ns = None; a = gpu.new_event(); gpu.record(a, gpu.anchor_stream(0))
>>> gpu.synchronize(a); gpu.elapsed_ms(e, a)   # the anchor ran at host 1_000
-0.004
>>> [c.op for c in gpu.calls]
['new', 'record', 'query', 'new', 'anchor_stream', 'record', 'synchronize', 'elapsed']
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass(slots=True)
class FakeEvent:
    name: int
    gpu_ns: int | None = None  # on the fake GPU clock; None until recorded
    stream: str = ""
    device: Hashable = 0


@dataclass(frozen=True, slots=True)
class FakeStream:
    name: str
    device: Hashable = 0


@dataclass(frozen=True, slots=True)
class Call:
    op: str  # new, record, query, elapsed, synchronize, anchor_stream
    event: int  # the event's name (-1: none)
    thread: int  # threading.get_ident() of the caller
    stream: str = ""


class FakeEvents:
    """`gpu_timing.EventBackend` with a GPU timeline the test controls."""

    def __init__(self, host_clock: Callable[[], int], *, offset_ns: int = -7_000_000_000,
                 lag_ns: int = 0) -> None:
        self.host_clock = host_clock
        self.offset_ns = offset_ns  # GPU clock = host scale + offset
        self.lag_ns = lag_ns
        self.progress_ns: int | None = None  # host scale; None: all recorded work is done
        self.calls: list[Call] = []
        self._planned: deque[int] = deque()
        self._n = 0

    def plan(self, *host_ns: int) -> None:
        """The host-scale times at which the next events recorded on a training stream run."""
        self._planned.extend(host_ns)

    def _call(self, op: str, event: FakeEvent | None, stream: str = "") -> None:
        name = event.name if event is not None else -1
        self.calls.append(Call(op, name, threading.get_ident(), stream))

    def ops_by(self, thread: int) -> set[str]:
        """The operations `thread` asked for."""
        return {c.op for c in self.calls if c.thread == thread}

    # -- EventBackend --------------------------------------------------------------------------
    def new_event(self) -> FakeEvent:
        self._n += 1
        event = FakeEvent(self._n)
        self._call("new", event)
        return event

    def record(self, event: FakeEvent, stream: FakeStream | None = None) -> None:
        name = stream.name if stream is not None else "current"
        self._call("record", event, name)
        if stream is not None and stream.name.startswith("anchor"):
            at = self.host_clock()
        elif self._planned:
            at = self._planned.popleft()
        else:
            at = self.host_clock() + self.lag_ns
        event.gpu_ns, event.stream = at + self.offset_ns, name
        event.device = stream.device if stream is not None else 0

    def _done(self, event: FakeEvent) -> bool:
        if event.gpu_ns is None:
            return False
        if event.stream.startswith("anchor") or self.progress_ns is None:
            return True
        return event.gpu_ns - self.offset_ns <= self.progress_ns

    def query(self, event: FakeEvent) -> bool:
        self._call("query", event)
        return self._done(event)

    def elapsed_ms(self, first: FakeEvent, second: FakeEvent) -> float:
        self._call("elapsed", first)
        if not (self._done(first) and self._done(second)):
            raise RuntimeError("CUDA error: device not ready")  # what CUDA says
        assert first.gpu_ns is not None and second.gpu_ns is not None
        return (second.gpu_ns - first.gpu_ns) / 1e6

    def synchronize(self, event: FakeEvent) -> None:
        self._call("synchronize", event)
        if not self._done(event):
            raise AssertionError("synchronize on work the test's GPU never finishes")

    def device_of(self, event: FakeEvent) -> Hashable:
        return event.device

    def anchor_stream(self, device: Hashable) -> FakeStream:
        self._call("anchor_stream", None)
        return FakeStream(f"anchor{device}", device)
