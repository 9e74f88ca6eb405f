"""Consumer lag and the liveness watchdog, from the worker's own processed offsets.

Why not ask the broker for end offsets? tansu answers ListOffsets(latest) off by a batch,
and any broker's answer is a separate round trip. The fetch responses already carry each
partition's high watermark, and we know exactly which offset we processed last, so
lag = high watermark - (processed + 1), per topic-partition, for free.

The watchdog guards against faust's known silent failures (an agent dead on an exception,
a consumer that stops fetching after a rebalance): if there is input left to read and
nothing was processed for `stall_after_s`, the worker is not ready and `/readyz` says why.
An idle worker (no lag) is healthy however long it has been quiet.

A broker outage shows no lag at all: the worker hears of no new input, so the rule above
never fires. The consumer marks each partition with the time of the last fetch response
that carried it (an empty one too: a quiet partition is answered every fetch wait), and the
worker hands us those marks (`fetched`). A mark that changed means the broker answered;
when it was is read off our own clock, so the consumer's wall clock never mixes with ours.
No answer for `stall_after_s` while nothing was processed either is an outage. Both
conditions, because a worker busy draining what it already fetched sends no fetch for its
partitions, and that is not an outage. A worker with no partitions fetches nothing, so the
broker rule does not apply to it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from schemas.clock import SecondsClock

TP = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    reason: str


class Progress:
    """Processed offsets, high watermarks and processing times per topic-partition."""

    def __init__(self, now: SecondsClock, stall_after_s: float = 30.0) -> None:
        self.now = now
        self._now = now
        self.stall_after_s = stall_after_s
        self._processed: dict[TP, int] = {}
        self._acked: dict[TP, int] = {}  # stored and handed to the consumer to commit
        self._highwater: dict[TP, int] = {}
        self._assigned: set[TP] = set()
        self._fetch_marks: dict[TP, object] = {}
        self._last_progress = now()
        self._last_answer = now()
        self.started = False  # set once the consumer group assigned us partitions
        self.stopping = False

    # ---- events ---------------------------------------------------------------------------
    def assigned(self, tps: Iterable[TP]) -> None:
        """A rebalance gave us these topic-partitions (the full new assignment)."""
        self._assigned = set(tps)
        for tp in list(self._processed):
            if tp not in self._assigned:
                del self._processed[tp]
                self._highwater.pop(tp, None)
        for tp in list(self._acked):
            if tp not in self._assigned:
                del self._acked[tp]
        for tp in list(self._fetch_marks):
            if tp not in self._assigned:
                del self._fetch_marks[tp]
        self.started = True
        self._last_progress = self._now()  # a rebalance restarts the stall clock
        self._last_answer = self._now()  # ... and the group's coordinator just answered

    def processed(self, topic: str, partition: int, offset: int) -> None:
        tp = (topic, partition)
        if offset > self._processed.get(tp, -1):
            self._processed[tp] = offset
        hw = self._highwater.get(tp)
        if hw is None or hw < offset + 1:
            self._highwater[tp] = offset + 1
        self._last_progress = self._now()

    def acked(self, topic: str, partition: int, offset: int) -> None:
        """A record was stored and acked (the consumer commits past it once every earlier
        one is acked too). Processed but not acked means held for order or being stored."""
        tp = (topic, partition)
        if offset > self._acked.get(tp, -1):
            self._acked[tp] = offset

    def received(self, tp: TP) -> int:
        """The last offset received of a topic-partition (-1: none)."""
        return self._processed.get(tp, -1)

    def set_highwater(self, topic: str, partition: int, highwater: int | None) -> None:
        """The high watermark the last fetch response reported (None: not fetched yet)."""
        if highwater is None or highwater < 0:
            return
        tp = (topic, partition)
        self._highwater[tp] = max(highwater, self._highwater.get(tp, 0))

    def fetched(self, topic: str, partition: int, mark: object | None) -> None:
        """The consumer's mark of the last fetch response that carried this partition
        (aiokafka: its wall-clock ms; None: not fetched yet). Marks are only compared: one
        that changed since the last call means the broker answered in between."""
        if mark is None:
            return
        tp = (topic, partition)
        if self._fetch_marks.get(tp) != mark:
            self._fetch_marks[tp] = mark
            self.answered()

    def answered(self) -> None:
        """The broker answered a fetch just now (as far as the sampling can tell)."""
        self._last_answer = self._now()

    # ---- questions ------------------------------------------------------------------------
    @property
    def assignment(self) -> set[TP]:
        return set(self._assigned)

    def lag(self, tp: TP) -> int:
        """Messages fetched by nobody yet, as far as we know (0 if never fetched)."""
        hw = self._highwater.get(tp)
        if hw is None:
            return 0
        return max(0, hw - (self._processed.get(tp, -1) + 1))

    def total_lag(self) -> int:
        return sum(self.lag(tp) for tp in self._assigned)

    def caught_up_partitions(self) -> list[int]:
        """Partition numbers whose every assigned topic has no lag (time may pass there)."""
        by_part: dict[int, bool] = {}
        for tp in self._assigned:
            by_part[tp[1]] = by_part.get(tp[1], True) and self.lag(tp) == 0
        return sorted(p for p, ok in by_part.items() if ok)

    def seconds_since_progress(self) -> float:
        return max(0.0, self._now() - self._last_progress)

    def seconds_since_answer(self) -> float:
        """Since the broker last answered a fetch (or the last assignment, if later)."""
        return max(0.0, self._now() - self._last_answer)

    def readiness(self) -> Readiness:
        """Not ready while shutting down, before the first assignment, when input waits and
        nothing moves (stalled), or when the broker is silent and nothing moves (outage);
        when both of the last two hold, the reason names both."""
        if self.stopping:
            return Readiness(False, "the worker is shutting down")
        if not self.started:
            return Readiness(False, "waiting for the consumer group to assign partitions")
        idle = self.seconds_since_progress()
        if idle <= self.stall_after_s:
            return Readiness(True, "ok")
        reasons = []
        lag = self.total_lag()
        if lag > 0:
            reasons.append(f"stalled: {lag} messages waiting and nothing processed for "
                           f"{idle:.0f} s")
        silent = self.seconds_since_answer()
        if self._assigned and silent > self.stall_after_s:
            reasons.append(f"no answer from the broker for {silent:.0f} s, and nothing "
                           f"processed for {idle:.0f} s")
        if reasons:
            return Readiness(False, "; ".join(reasons))
        return Readiness(True, "ok")

    def snapshot(self) -> dict[str, object]:
        """Lag per topic-partition and totals, for logs and the API."""
        return {
            "assigned": sorted(f"{t}[{p}]" for t, p in self._assigned),
            "lag": {f"{t}[{p}]": self.lag((t, p)) for t, p in sorted(self._assigned)},
            "total_lag": self.total_lag(),
            "processed": {f"{t}[{p}]": o for (t, p), o in sorted(self._processed.items())},
            "acked": {f"{t}[{p}]": o for (t, p), o in sorted(self._acked.items())},
            "seconds_since_progress": round(self.seconds_since_progress(), 3),
            "seconds_since_broker_answer": round(self.seconds_since_answer(), 3),
        }
