"""Stage 1 of a job split across workers: assemble each shard's step, send it on as one frame.

A job too large for one worker (issue #17) publishes its ranks' step messages keyed by
`<job>/<shard>` (`schemas.shard_key`). Whichever worker holds a shard's partition decodes its
messages and assembles the shard's step with the same `StepAssembler` a whole job uses, then
sends the shard's frame to `flare.partials.v1` keyed by job (`schemas.partial_frame`), where
the job's worker merges the shards (`detectors.shard_merge`) and diagnoses the step. The
per-op work (JSON decoding, string interning, concatenation, sorting, stall splitting) is
done here, spread over as many workers as the job's shards have partitions.

At-least-once: a message's offset may be committed only once the step it belongs to was
sent, so `committable` gives, per partition, the oldest offset still held in a pending step.
A restarted or reassigned stage 1 re-reads from there and may send a shard's step again;
stage 2 keeps the fuller of two frames of one shard, and drops a step it already merged.

Time: a shard's clock is the latest end of its ranks' steps; with nothing left to read it
moves on by the worker's clock (`tick`), so a step whose rank went silent leaves after its
grace, missing that rank, as it does in one worker.

Like `routing.JobRouter`, no Kafka here: records in, messages out, with a fake clock in tests.

>>> import orjson
>>> from detectors.testing import rank_step
>>> stage = ShardStage(max_message_bytes=2**20, now_ns=lambda: 0, shard_ranks=2)
>>> def record(rank, step, offset):
...     msg = rank_step(rank, "n0", step, [("compute", "fwd", "", 0, 0.0, 9.0, 0)], t0_ns=10**18)
...     return offset, f"j/{rank // 2}".encode(), orjson.dumps(msg.to_wire())
>>> [stage.on_record(0, *record(r, 0, offset)).sent for r, offset in ((0, 7), (1, 8))]
[[], []]
>>> stage.committable(0)  # the shard's first step waits: how many ranks it has is not known
7
>>> [(t, k) for t, k, _ in stage.on_record(0, *record(0, 1, 9)).sent], stage.committable(0)
([('flare.partials.v1', b'j')], 9)
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from detectors.assembly import StepAssembler
from schemas import InvalidMessage
from schemas.clock import NS_PER_S, NanoClock
from schemas.frame import StepFrame
from schemas.partial_frame import GONE, encode_partial, encode_watermark
from schemas.shard_key import shard_of_key
from schemas.steps_decoder import StepsDecoder
from schemas.topics import DEADLETTER, PARTIALS, SHARD_STEPS
from streams.deadletter import (
    INTERNAL,
    DeadLetterCounts,
    cause_of,
    invalid_reason,
    make_dead_letter,
)

log = logging.getLogger(__name__)

Message = tuple[str, bytes, bytes]  # (topic, key, value)
_encode = msgspec.json.Encoder().encode


@dataclass(slots=True)
class _Shard:
    """One (job, shard): its assembler, its clock, and the offsets its pending steps hold."""

    partition: int
    assembler: StepAssembler
    stream_ns: int = 0  # latest end of a step of its ranks
    arrival_ns: int = 0  # worker clock at its last message
    held: dict[int, int] = field(default_factory=dict)  # pending step → its oldest offset
    mark_ns: int = 0  # the last watermark sent

    def watermark(self, now_ns: int) -> int:
        """Stage 2 may take the shard as read up to here: its clock, but not past the
        oldest step it still holds (that step is on its way)."""
        held = self.assembler.held_since_ns()
        return now_ns if held is None else min(now_ns, held)


@dataclass(slots=True)
class StageOutput:
    """What records or a tick produced: messages to send (partials and dead letters)."""

    sent: list[Message] = field(default_factory=list)

    def extend(self, other: StageOutput) -> StageOutput:
        self.sent.extend(other.sent)
        return self


class ShardStage:
    """The shards a stage-1 worker holds, by (job, shard)."""

    def __init__(self, *, max_message_bytes: int, now_ns: NanoClock, shard_ranks: int,
                 grace_s: float = 5.0, grace_steps: float = 0.5, idle_evict_s: float = 600.0,
                 decoder_max_ranks: int = 16_384) -> None:
        if shard_ranks < 1:
            raise ValueError(f"shard_ranks must be >= 1, got {shard_ranks}")
        self.shard_ranks = shard_ranks
        self.grace_s, self.grace_steps = grace_s, grace_steps
        self.decoder = StepsDecoder(max_message_bytes, max_ranks=decoder_max_ranks)
        self._now_ns = now_ns
        self._idle_ns = int(idle_evict_s * NS_PER_S)
        self._mark_every_ns = int(grace_s * NS_PER_S / 4)  # watermarks alone, at most this often
        self.shards: dict[tuple[str, int], _Shard] = {}
        self.next_offset: dict[int, int] = {}  # partition → the offset after the last read
        self.dead_letters = DeadLetterCounts()
        self.partials_sent = 0

    # ---- records --------------------------------------------------------------------------
    def on_record(self, partition: int, offset: int, key: bytes | None,
                  value: bytes | None) -> StageOutput:
        """One record of `flare.shardsteps.v1`. Never raises: a bad one is dead-lettered."""
        self.next_offset[partition] = max(self.next_offset.get(partition, 0), offset + 1)
        if value is None:
            return self._dead(partition, offset, "$", "$: empty message (no value)", None, key)
        try:
            job, shard = shard_of_key(key)
            msg = self.decoder.decode(value)
            if msg.job != job or msg.rank // self.shard_ranks != shard:
                raise InvalidMessage("$key", f"{key!r} is not the key of job {msg.job!r} rank "
                                     f"{msg.rank} in shards of {self.shard_ranks} ranks")
        except InvalidMessage as exc:
            return self._dead(partition, offset, cause_of(exc.field), invalid_reason(exc), value,
                              key)
        except Exception as exc:  # a decoder bug must not take the batch's other records down
            log.exception("decoding %s[%d]@%d failed", SHARD_STEPS, partition, offset)
            return self._dead(partition, offset, INTERNAL,
                              f"{INTERNAL}: the decoder raised {type(exc).__name__}: {exc}", value,
                              key)
        sh = self.shards.get((job, shard))
        if sh is None:
            asm = StepAssembler(job, grace_s=self.grace_s, grace_steps=self.grace_steps)
            sh = self.shards[(job, shard)] = _Shard(partition, asm)
        sh.stream_ns = max(sh.stream_ns, msg.t_end_ns)
        sh.arrival_ns = self._now_ns()
        if msg.step > sh.assembler.emitted_upto:
            sh.held[msg.step] = min(sh.held.get(msg.step, offset), offset)
        frames = sh.assembler.add(msg, sh.stream_ns)
        return self._send(shard, sh, frames, sh.watermark(sh.stream_ns))

    def _dead(self, partition: int, offset: int, cause: str, reason: str,
              payload: bytes | None, key: bytes | None) -> StageOutput:
        self.dead_letters.add(SHARD_STEPS, cause)
        dl = make_dead_letter(SHARD_STEPS, partition, offset, reason, payload)
        return StageOutput([(DEADLETTER, key or b"", _encode(dl))])

    def _send(self, shard: int, sh: _Shard, frames: list[StepFrame], mark_ns: int
              ) -> StageOutput:
        out = StageOutput()
        for f in frames:
            if f.n_ranks == 0:
                continue
            out.sent.append((PARTIALS, f.job.encode("utf-8"), encode_partial(
                f, shard=shard, shard_ranks=self.shard_ranks, watermark_ns=mark_ns)))
            sh.mark_ns = max(sh.mark_ns, mark_ns)
            self.partials_sent += 1
        for step in [s for s in sh.held if s <= sh.assembler.emitted_upto]:
            del sh.held[step]  # sent, or let go of (the assembler's max_pending)
        return out

    # ---- offsets --------------------------------------------------------------------------
    def committable(self, partition: int) -> int | None:
        """The offset to commit for `partition`: the oldest one a pending step holds, else
        the one after the last record read (None: nothing read)."""
        held = [o for sh in self.shards.values() if sh.partition == partition
                for o in sh.held.values()]
        if held:
            return min(held)
        return self.next_offset.get(partition)

    # ---- time -----------------------------------------------------------------------------
    def tick(self, caught_up: Iterable[int]) -> StageOutput:
        """Let time pass for the shards of partitions with nothing left to read: steps whose
        grace is over leave, and shards silent past `idle_evict_s` are flushed and dropped."""
        now = self._now_ns()
        parts = set(caught_up)
        out = StageOutput()
        for key, sh in list(self.shards.items()):
            if sh.partition not in parts:
                continue
            idle = max(0, now - sh.arrival_ns)
            clock = sh.stream_ns + idle
            frames = sh.assembler.advance(clock)
            mark = sh.watermark(clock)
            out.extend(self._send(key[1], sh, frames, mark))
            if mark - sh.mark_ns >= self._mark_every_ns:
                # nothing of the shard to send: say how far it was read, so a step waiting
                # on it in stage 2 leaves after its grace, as one waiting on a silent rank does
                out.sent.append(self._watermark_alone(key, mark))
                sh.mark_ns = mark
            if idle > self._idle_ns:
                out.extend(self._send(key[1], sh, sh.assembler.flush(), clock))
                out.sent.append(self._watermark_alone(key, GONE))
                del self.shards[key]
                self.decoder.forget(key[0])
        return out

    def _watermark_alone(self, key: tuple[str, int], mark_ns: int) -> Message:
        job, shard = key
        return (PARTIALS, job.encode("utf-8"), encode_watermark(
            job, shard=shard, shard_ranks=self.shard_ranks, watermark_ns=mark_ns))

    def revoke(self, partitions: Iterable[int]) -> int:
        """Drop the shards of partitions another worker now owns (it re-reads their pending
        steps from the committed offsets); returns how many were dropped."""
        gone = set(partitions)
        drop = [k for k, sh in self.shards.items() if sh.partition in gone]
        for k in drop:
            del self.shards[k]
        for p in gone:
            self.next_offset.pop(p, None)
        self.decoder.forget(*{k[0] for k in drop})
        return len(drop)
