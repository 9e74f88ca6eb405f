"""Routing decoded messages to the JobDiagnoser of their job: the worker's pure core.

No Kafka here: the faust agent hands each record's coordinates and bytes to `JobRouter` and
acts on what comes back (rows to store, incidents to publish, a dead letter). That makes the
stream logic testable with plain calls and a fake clock.

State is owned by partition: all messages of a job share one partition (key = job), so the
diagnosers of partition p live in `_jobs[p]` and go away when p moves to another worker,
which rebuilds them by re-reading the partition's recent history (`rebuild.py`). A job that
falls silent is flushed and evicted after `idle_evict_s`, which keeps the state bounded
however many jobs come and go.

Time: a diagnoser's clock is the stream time of its job's messages. When messages stop
(a hung job, the end of a replay) `tick` extrapolates it with the worker's clock since the
job's last message, but only for partitions the caller says are caught up, so a fetch
stall is never mistaken for silence.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from schemas import InvalidMessage
from schemas.clock import NS_PER_S, NanoClock
from schemas.decode import decode_heartbeat, decode_job
from schemas.partial_frame import PartialFrame, decode_partial
from schemas.rankstep import RankStep
from schemas.report import DiagnoserOutput
from schemas.steps_decoder import StepsDecoder
from schemas.topics import HEARTBEATS, JOBS, PARTIALS, STEPS, STEPS_V2
from schemas.wire import DeadLetterV1, HeartbeatV1, JobV1
from streams.deadletter import (
    INTERNAL,
    DeadLetterCounts,
    cause_of,
    invalid_reason,
    make_dead_letter,
)

log = logging.getLogger(__name__)

InputMessage = RankStep | HeartbeatV1 | JobV1 | PartialFrame


class Diagnoser(Protocol):
    """What the router needs of `detectors.diagnoser.JobDiagnoser`."""

    def on_steps(self, msg: RankStep) -> DiagnoserOutput: ...

    def on_partial(self, part: PartialFrame) -> DiagnoserOutput: ...

    def on_heartbeat(self, hb: HeartbeatV1) -> DiagnoserOutput: ...

    def on_job(self, ev: JobV1) -> DiagnoserOutput: ...

    def tick(self, now_ns: int) -> DiagnoserOutput: ...

    def flush(self) -> DiagnoserOutput: ...


def decode_input(topic: str, value: bytes, steps: StepsDecoder) -> InputMessage:
    """Decode one input message by its topic: the one topic -> decoder table.

    The worker and `flare diagnose` both decode through here, so a recording read offline
    and the same stream read from Kafka are understood alike. Heartbeats and job events get
    the steps decoder's size limit. InvalidMessage for a bad message or a topic that is not
    an input.
    """
    if topic == STEPS:
        return steps.decode(value)
    if topic == STEPS_V2:
        return steps.decode_v2(value)
    if topic == HEARTBEATS:
        return decode_heartbeat(value, steps.max_bytes)
    if topic == JOBS:
        return decode_job(value, steps.max_bytes)
    if topic == PARTIALS:
        if len(value) > steps.max_bytes:
            raise InvalidMessage("$", f"{len(value)} bytes, over the limit of {steps.max_bytes}")
        return decode_partial(value)
    raise InvalidMessage("$topic", f"{topic!r} is not an input topic of this worker")


def feed(diagnoser: Diagnoser, msg: InputMessage) -> DiagnoserOutput:
    """Hand a decoded message to the diagnoser method of its kind: the one message ->
    handler table, shared by the worker and `flare diagnose`."""
    if isinstance(msg, RankStep):
        return diagnoser.on_steps(msg)
    if isinstance(msg, HeartbeatV1):
        return diagnoser.on_heartbeat(msg)
    if isinstance(msg, PartialFrame):
        return diagnoser.on_partial(msg)
    return diagnoser.on_job(msg)


@dataclass(slots=True)
class Routed:
    """The result of one message: the diagnoser's output, or a dead letter."""

    output: DiagnoserOutput = field(default_factory=DiagnoserOutput)
    dead_letter: DeadLetterV1 | None = None
    job: str | None = None


@dataclass(slots=True)
class _JobState:
    diagnoser: Diagnoser
    stream_ns: int = 0  # latest stream time seen in the job's messages
    arrival_ns: int = 0  # worker clock when its last message was processed
    ticked_ns: int = 0  # latest stream time passed to tick()


class Decoded(NamedTuple):
    """A valid input message with its Kafka coordinates (and raw bytes, for dead letters).

    A named tuple, as one is built per consumed message.
    """

    topic: str
    partition: int
    offset: int
    payload: bytes
    msg: InputMessage

    @property
    def job(self) -> str:
        return self.msg.job

    @property
    def time_ns(self) -> int:
        """Event time: when a rank-step (or a shard's step) ended, when a heartbeat or job
        event was sent."""
        m = self.msg
        return m.t_end_ns if isinstance(m, RankStep | PartialFrame) else m.ts_ns


class JobRouter:
    """One diagnoser per job, grouped by the partition that owns the job."""

    def __init__(
        self,
        make_diagnoser: Callable[[str], Diagnoser],
        *,
        max_message_bytes: int,
        now_ns: NanoClock,
        idle_evict_s: float = 600.0,
        decoder_max_ranks: int = 16_384,
    ) -> None:
        self._make = make_diagnoser
        # Steps are decoded with a per-(job, rank) cache of what repeats step after step; it
        # is the router's, so it follows the jobs' lifetime here (forget on evict/revoke).
        self.steps_decoder = StepsDecoder(max_message_bytes, max_ranks=decoder_max_ranks)
        self._now_ns = now_ns
        self._idle_ns = int(idle_evict_s * NS_PER_S)
        self._jobs: dict[int, dict[str, _JobState]] = {}
        self.dead_letters = DeadLetterCounts()

    # ---- introspection --------------------------------------------------------------------
    def jobs(self, partition: int | None = None) -> list[str]:
        """Jobs with live state (in one partition, or all)."""
        parts = [partition] if partition is not None else sorted(self._jobs)
        return sorted(j for p in parts for j in self._jobs.get(p, {}))

    # ---- messages -------------------------------------------------------------------------
    def _dead(self, topic: str, partition: int, offset: int, cause: str, reason: str,
              payload: bytes | None, job: str | None = None, count: bool = True) -> Routed:
        if count:
            self.dead_letters.add(topic, cause)
        return Routed(dead_letter=make_dead_letter(topic, partition, offset, reason, payload),
                      job=job)

    def decode(self, topic: str, partition: int, offset: int, key: bytes | None,
               value: bytes | None, *, count: bool = True) -> Decoded | Routed:
        """Decode and check one record: a `Decoded` message, or a `Routed` dead letter.

        `count=False` (re-reading history) leaves the counters alone: those dead letters
        were counted by whoever read the messages first.
        """
        if value is None:
            return self._dead(topic, partition, offset, "$", "$: empty message (no value)", None,
                              count=count)
        try:
            msg = decode_input(topic, value, self.steps_decoder)
        except InvalidMessage as exc:
            return self._dead(topic, partition, offset, cause_of(exc.field), invalid_reason(exc),
                              value, count=count)
        except Exception as exc:  # a decoder bug must not take the batch's other records down
            log.exception("decoding %s[%d]@%d failed", topic, partition, offset)
            reason = f"{INTERNAL}: the decoder raised {type(exc).__name__}: {exc}"
            return self._dead(topic, partition, offset, INTERNAL, reason, value, count=count)
        job = msg.job
        if key is None or key != job.encode("utf-8"):
            shown = "missing" if key is None else repr(key.decode("utf-8", "replace"))
            reason = (f"$key: {shown} is not the job id {job!r}; messages must be keyed by "
                      "job so that one worker sees the whole job")
            return self._dead(topic, partition, offset, "$key", reason, value, job, count)
        return Decoded(topic, partition, offset, value, msg)

    def dispatch(self, d: Decoded, *, count: bool = True) -> Routed:
        """Feed one decoded message to its job's diagnoser. Never raises."""
        msg = d.msg
        job = msg.job
        state = self._state(d.partition, job)
        now = self._now_ns()
        try:
            out = feed(state.diagnoser, msg)
        except InvalidMessage as exc:  # valid alone, not for its job (a rank past its world)
            return self._dead(d.topic, d.partition, d.offset, cause_of(exc.field),
                              invalid_reason(exc), d.payload, job, count)
        except Exception as exc:  # a detector bug must not kill the worker nor lose the input
            log.exception("diagnoser of job %s failed on %s[%d]@%d", job, d.topic, d.partition,
                          d.offset)
            reason = f"{INTERNAL}: the diagnoser raised {type(exc).__name__}: {exc}"
            return self._dead(d.topic, d.partition, d.offset, INTERNAL, reason, d.payload, job,
                              count)
        finally:
            state.stream_ns = max(state.stream_ns, d.time_ns)
            state.arrival_ns = now
        return Routed(output=out, job=job)

    def handle(self, topic: str, partition: int, offset: int, key: bytes | None,
               value: bytes | None) -> Routed:
        """`decode` then `dispatch`, for callers that already deliver in event-time order."""
        d = self.decode(topic, partition, offset, key, value)
        return d if isinstance(d, Routed) else self.dispatch(d)

    def _state(self, partition: int, job: str) -> _JobState:
        jobs = self._jobs.setdefault(partition, {})
        state = jobs.get(job)
        if state is None:
            state = jobs[job] = _JobState(self._make(job))
        return state

    # ---- time -----------------------------------------------------------------------------
    def tick_each(self, caught_up: Iterable[int]) -> Iterator[DiagnoserOutput]:
        """Let time pass for the jobs of partitions with nothing left to read, one job per
        item: a worker with a thousand jobs in flight hands its loop back between them.

        A job's stream clock moves on by the worker time elapsed since its last message, so
        grace periods and hang timeouts fire when a job goes quiet. Jobs silent for longer
        than `idle_evict_s` are flushed and dropped. Between items the caller may do other
        work: a job that is gone by then (its partition revoked) is skipped.
        """
        now = self._now_ns()
        for p in list(caught_up):
            jobs = self._jobs.get(p)
            if not jobs:
                continue
            for job, state in list(jobs.items()):
                if self._jobs.get(p) is not jobs or jobs.get(job) is not state:
                    continue  # revoked or evicted while the caller was away
                yield self._tick_job(jobs, job, state, now)

    def _tick_job(self, jobs: dict[str, _JobState], job: str, state: _JobState,
                  now: int) -> DiagnoserOutput:
        out = DiagnoserOutput()
        idle = now - state.arrival_ns
        stream_now = state.stream_ns + max(0, idle)
        try:
            # an ended job still ticks: its end is final after a grace, and its diagnoser
            # knows that a job that ended is silent, not hung
            if stream_now > state.ticked_ns:
                state.ticked_ns = stream_now
                out.extend(state.diagnoser.tick(stream_now))
            if idle > self._idle_ns:
                out.extend(state.diagnoser.flush())
                del jobs[job]
                self.steps_decoder.forget(job)
        except Exception:
            log.exception("diagnoser of job %s failed on tick; dropping its state", job)
            del jobs[job]
            self.steps_decoder.forget(job)
        return out

    # ---- ownership ------------------------------------------------------------------------
    def revoke(self, partitions: Iterable[int]) -> list[str]:
        """Drop the state of partitions another worker now owns; returns the jobs dropped.

        Nothing is flushed into the output: the new owner rebuilds the state from the history
        before the last committed offset and reads on from there, so anything pending here is
        diagnosed there.
        """
        dropped: list[str] = []
        for p in partitions:
            dropped.extend(self._jobs.pop(p, {}))
        self.steps_decoder.forget(*dropped)
        return dropped
