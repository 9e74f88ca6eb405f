"""Dependencies and parameter types shared by the routers (`Annotated` aliases).

The store and the readiness callable are put on `app.state` by `create_app`; routes receive
them through these aliases, so a test builds an app around any store it likes. Parameter
parsing that FastAPI cannot express (ns-or-ISO times, cursors) lives here and fails with a
problem naming the field.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated

from fastapi import Depends, Query, Request

from api.problems import bad_parameter
from storage.reader import Reader

I64_MAX = 2**63 - 1
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_INT = re.compile(r"[+-]?\d{1,30}")
Ready = Callable[[], tuple[bool, str]]


# async: they only read app.state, and a plain function would be run on the thread pool,
# two more turns of the event loop per request (the worker serves the API from the loop
# that diagnoses, where a turn can wait behind a pipeline call)
async def get_store(request: Request) -> Reader:
    store: Reader = request.app.state.store
    return store


async def get_ready(request: Request) -> Ready | None:
    ready: Ready | None = request.app.state.ready
    return ready


StoreDep = Annotated[Reader, Depends(get_store)]
ReadyDep = Annotated[Ready | None, Depends(get_ready)]

Step = Annotated[int, Query(ge=0, le=I64_MAX)]
Offset = Annotated[int, Query(ge=0, le=10**9, description="rows to skip")]


def parse_time(field: str, value: str | None) -> int | None:
    """Nanoseconds since the epoch from an integer (ns) or an ISO 8601 time (UTC if naive)."""
    if value is None:
        return None
    text = value.strip()
    if _INT.fullmatch(text):
        ns = int(text)
        if not 0 <= ns <= I64_MAX:
            raise bad_parameter(field, "nanoseconds must be between 0 and 2^63-1")
        return ns
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise bad_parameter(
            field, "expected integer nanoseconds or an ISO 8601 time such as 2026-01-31T12:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    try:
        ns = (when - _EPOCH) // timedelta(microseconds=1) * 1000
    except OverflowError:
        ns = -1
    if not 0 <= ns <= I64_MAX:
        raise bad_parameter(field, "time out of range (1970 .. 2262)")
    return ns


def encode_cursor(opened_ts_ns: int, incident_id: str) -> str:
    raw = json.dumps([opened_ts_ns, incident_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(value: str | None) -> tuple[int, str] | None:
    """The (opened_ts_ns, id) a previous page ended at; anything else is a 422."""
    if value is None:
        return None
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        ts, incident_id = json.loads(raw)
    except (binascii.Error, ValueError, TypeError, RecursionError):
        raise bad_parameter("cursor", "not a cursor returned by this API") from None
    if not (isinstance(ts, int) and 0 <= ts <= I64_MAX and isinstance(incident_id, str)):
        raise bad_parameter("cursor", "not a cursor returned by this API")
    return ts, incident_id
