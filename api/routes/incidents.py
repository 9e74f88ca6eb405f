"""/v1/incidents: the incidents Flare opened, filtered and paged, and one with its evidence."""

from __future__ import annotations

import math
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field

from api.deps import Offset, StoreDep, decode_cursor, encode_cursor, parse_time
from api.models import Evidence, Incident, IncidentDetail, IncidentPage, IncidentStatus
from api.problems import bad_parameter, not_found, responses
from schemas.chrome_trace import choose_steps, chrome_trace
from schemas.wire import IncidentKind
from storage.reader import Row

router = APIRouter(prefix="/incidents", tags=["incidents"])

TIME_HELP = "integer nanoseconds since the epoch, or ISO 8601 (UTC when no offset is given)"


@router.get("", response_model=IncidentPage, responses=responses(422, 503))
def list_incidents(
    store: StoreDep,
    job: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
    status: IncidentStatus | None = None,
    kind: IncidentKind | None = None,
    since: Annotated[
        str | None, Query(max_length=64, description=f"opened at or after; {TIME_HELP}")
    ] = None,
    until: Annotated[
        str | None, Query(max_length=64, description=f"opened before; {TIME_HELP}")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
    cursor: Annotated[
        str | None, Query(max_length=1024, description="`next_cursor` of the previous page")
    ] = None,
) -> IncidentPage:
    """Incidents, newest opening first. Page with `cursor` (stable while new incidents
    arrive) or with `offset`."""
    since_ns = parse_time("since", since)
    until_ns = parse_time("until", until)
    if since_ns is not None and until_ns is not None and since_ns >= until_ns:
        raise bad_parameter("until", "must be later than since")
    before = decode_cursor(cursor)
    if before is not None and offset:
        raise bad_parameter("offset", "give either offset or cursor, not both")
    rows = store.incidents(
        job=job, status=status, kind=kind, since_ns=since_ns, until_ns=until_ns,
        limit=limit, offset=offset, before=before,
    )
    last = rows[-1] if len(rows) == limit else None
    return IncidentPage(
        items=[Incident.model_validate(r) for r in rows], limit=limit, offset=offset,
        next_cursor=encode_cursor(last["opened_ts_ns"], last["id"]) if last else None,
    )


def _evidence_range(inc: Row) -> tuple[int, int]:
    """The incident's steps: onset to the last step seen, or to the resolving step."""
    lo = max(int(inc["onset_step"]), 0)
    return lo, max(int(inc["last_step"]), int(inc["resolved_step"] or 0), lo)


TRACE_MAX_STEPS = 50
TRACE_MAX_OPS = 200_000  # op rows read for one trace: a few hundred MB of API memory at most


class ChromeTrace(BaseModel):
    """A Chrome / Perfetto trace (Trace Event Format, JSON object form); its layout is in
    `schemas.chrome_trace`. Documents the answer only: the route sends the JSON as built."""

    model_config = ConfigDict(populate_by_name=True)

    trace_events: list[dict[str, Any]] = Field(alias="traceEvents")
    display_time_unit: str = Field("ms", alias="displayTimeUnit")
    other_data: dict[str, Any] = Field(alias="otherData", description=(
        "the incident (incident, job, kind, culprit, status), the step range searched, the "
        "steps included, more_steps, truncated, origin_ns (ts 0 on the nodes' clocks), "
        "ranks and ops"))


# Before get_incident: its `{incident_id:path}` would otherwise take ".../trace" as an id.
@router.get(
    "/{incident_id:path}/trace", response_model=ChromeTrace, response_model_by_alias=True,
    responses=responses(404, 422, 503),
)
def get_incident_trace(
    incident_id: str,
    store: StoreDep,
    steps: Annotated[int, Query(ge=1, le=TRACE_MAX_STEPS, description=(
        "at most this many steps: the first ones from the onset whose raw ops are stored"
    ))] = 5,
) -> Response:
    """The incident's evidence steps as a Chrome trace for ui.perfetto.dev: one track per
    rank, collectives grouped by communicator. Raw ops are kept only for irregular and sampled
    steps, for 7 days, and at most 200,000 ops go into one trace (whole steps; a first step
    larger than that is cut, `truncated`). An incident with no stored ops in its range is
    still a 200: an empty trace whose `otherData.steps` is [], since the incident exists and
    the absence of ops is an answer (expired, or not sampled), not an error; 404 is for an
    unknown incident only."""
    inc = store.incident(incident_id)
    if inc is None:
        raise not_found(f"no incident with id {incident_id!r}")
    lo, hi = _evidence_range(inc)
    plan = choose_steps(store.op_steps(inc["job"], lo, hi, limit=steps + 1), steps,
                        TRACE_MAX_OPS)
    ops = store.ops(inc["job"], plan.steps, limit=plan.ops) if plan.steps else []
    trace = chrome_trace(ops, {
        "incident": inc["id"], "job": inc["job"], "kind": inc["kind"],
        "culprit": inc["culprit"], "status": inc["status"], "from_step": lo, "to_step": hi,
        "steps": plan.steps, "more_steps": plan.more_steps, "truncated": plan.truncated,
    })
    return Response(orjson.dumps(trace), media_type="application/json")


@router.get(
    "/{incident_id:path}", response_model=IncidentDetail, responses=responses(404, 422, 503)
)
def get_incident(
    incident_id: str,
    store: StoreDep,
    max_points: Annotated[
        int, Query(ge=10, le=10_000, description="at most this many steps in the series")
    ] = 2000,
) -> IncidentDetail:
    """One incident with its evidence: the job's step time and δ from the onset to the last
    step (every stride-th step when longer than `max_points`), the suspects, and the culprit's
    per-step detections."""
    inc = store.incident(incident_id)
    if inc is None:
        raise not_found(f"no incident with id {incident_id!r}")
    lo, hi = _evidence_range(inc)
    stride = max(1, math.ceil((hi - lo + 1) / max_points))
    steps = store.steps(inc["job"], from_step=lo, to_step=hi, limit=max_points, stride=stride)
    detections = store.detections(inc["job"], inc["culprit"], lo, hi, limit=10_000)
    evidence = Evidence(
        from_step=lo, to_step=hi, stride=stride, steps=steps,
        culprit_detections=detections, suspects=inc["suspects"],
    )
    return IncidentDetail.model_validate({**inc, "evidence": evidence})
