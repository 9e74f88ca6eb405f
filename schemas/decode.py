"""Decoding raw v1 messages in one pass, with a precise reason for every rejection.

A steps message becomes a `RankStep` with numpy columns; heartbeats and job events stay msgspec
structs (they are small). Every failure is an `InvalidMessage`, which the worker turns into a
dead letter; nothing here ever raises another exception type on bad bytes.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec
import numpy as np

from schemas.errors import InvalidMessage
from schemas.rankstep import GROUP_KINDS, KIND_CODE, RankStep
from schemas.wire import HeartbeatV1, JobV1, StepsV1

DEFAULT_MAX_BYTES = 8 * 1024 * 1024
_OP_FIELDS = ("kind", "name", "group", "seq", "start_ns", "dur_ns", "bytes")
_PATH = re.compile(r"at `(\$[^`]*)`")
_steps_decoder = msgspec.json.Decoder(StepsV1)
_heartbeat_decoder = msgspec.json.Decoder(HeartbeatV1)
_job_decoder = msgspec.json.Decoder(JobV1)
_I64 = np.iinfo(np.int64)
T = TypeVar("T")


def _invalid_from(exc: msgspec.DecodeError) -> InvalidMessage:
    """msgspec says 'Expected `int`, got `str` - at `$.ops.seq[2]`'; split path and reason."""
    text = str(exc)
    m = _PATH.search(text)
    field = m.group(1) if m else "$"
    reason = text[: m.start()].rstrip(" -") if m else text
    if field == "$.v":
        reason = f"unsupported or missing contract version ({reason}); this worker accepts v=1"
    return InvalidMessage(field, reason or "malformed JSON")


def decode_json(decoder: msgspec.json.Decoder[T], raw: bytes) -> T:
    """`decoder.decode(raw)`, every failure an InvalidMessage.

    msgspec raises UnicodeDecodeError, not a DecodeError, for a string that is not UTF-8;
    left uncaught it escaped the worker's per-message handling and took the whole batch
    with it (found by the malformed-input fuzz tests).
    """
    try:
        return decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise _invalid_from(exc) from None
    except UnicodeDecodeError as exc:
        raise InvalidMessage("$", f"a string is not valid UTF-8 ({exc.reason})") from None


def _check_size(raw: bytes, max_bytes: int) -> None:
    if len(raw) > max_bytes:
        raise InvalidMessage("$", f"message of {len(raw)} bytes exceeds the {max_bytes}-byte limit")


def _group_ok(g: str) -> bool:
    kind, dot, ident = g.partition(".")
    return bool(dot) and bool(ident) and kind in GROUP_KINDS


def decode_steps(raw: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> RankStep:
    """Decode and validate one `flare.steps.v1` message into columnar numpy arrays."""
    _check_size(raw, max_bytes)
    m = decode_json(_steps_decoder, raw)
    ops = m.ops
    n = len(ops.kind)
    for f in _OP_FIELDS[1:]:
        if len(getattr(ops, f)) != n:
            raise InvalidMessage(
                f"$.ops.{f}", f"has {len(getattr(ops, f))} entries but ops.kind has {n}"
            )
    if ops.issue_ns is not None and len(ops.issue_ns) != n:  # optional, additive in v1
        raise InvalidMessage(
            "$.ops.issue_ns", f"has {len(ops.issue_ns)} entries but ops.kind has {n}"
        )
    if m.t_end_ns < m.t_start_ns:
        raise InvalidMessage("$.t_end_ns", "is before t_start_ns")
    try:
        seq = np.array(ops.seq, dtype=np.int64)
        start = np.array(ops.start_ns, dtype=np.int64)
        dur = np.array(ops.dur_ns, dtype=np.int64)
        nbytes = np.array(ops.bytes, dtype=np.int64)
        if ops.issue_ns is not None:  # validated, not carried: no consumer reads it yet
            np.array(ops.issue_ns, dtype=np.int64)
    except OverflowError:
        raise InvalidMessage("$.ops", "an integer does not fit in 64 bits") from None
    for fname, arr in (("dur_ns", dur), ("start_ns", start), ("bytes", nbytes)):
        if n and int(arr.min()) < 0:
            i = int(np.argmin(arr))
            raise InvalidMessage(f"$.ops.{fname}[{i}]", f"is negative ({int(arr[i])})")
    kind = np.fromiter((KIND_CODE[k] for k in ops.kind), dtype=np.uint8, count=n)
    for g in set(ops.group):
        if g == "":
            continue
        if not _group_ok(g):
            i = ops.group.index(g)
            raise InvalidMessage(
                f"$.ops.group[{i}]",
                f"{g!r} is not '<kind>.<id>' with kind in {sorted(GROUP_KINDS)}",
            )
    if n:
        non_compute = kind != 0
        has_group = np.fromiter((g != "" for g in ops.group), dtype=bool, count=n)
        bad = non_compute & ~has_group
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidMessage(f"$.ops.group[{i}]", "a coll or p2p op needs a group")
    coords: dict[str, int] = {}
    if m.coords is not None:
        coords = {k: v for k, v in msgspec.structs.asdict(m.coords).items() if v is not None}
    return RankStep(
        job=m.job,
        rank=m.rank,
        node=m.node,
        step=m.step,
        t_start_ns=m.t_start_ns,
        t_end_ns=m.t_end_ns,
        kind=kind,
        name=ops.name,
        group=ops.group,
        seq=seq,
        start_ns=start,
        dur_ns=dur,
        bytes=nbytes,
        local_rank=m.local_rank,
        coords=coords,
    )


def decode_heartbeat(raw: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> HeartbeatV1:
    """Decode and validate one `flare.heartbeats.v1` message."""
    _check_size(raw, max_bytes)
    return decode_json(_heartbeat_decoder, raw)


def decode_job(raw: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> JobV1:
    """Decode and validate one `flare.jobs.v1` message."""
    _check_size(raw, max_bytes)
    m = decode_json(_job_decoder, raw)
    if m.event == "start" and m.world_size is None:
        raise InvalidMessage("$.world_size", "a start event needs world_size")
    return m
