"""GET /incidents/{id}: one incident's page, for a person with a browser (an alert's link).

Outside /v1 and the OpenAPI schema: it is HTML for people, not an interface for programs
(those read /v1/incidents/{id}). An unknown id is a 404 page; a bad `metric` is the API's
usual 422 problem. The Content-Security-Policy lets the browser load nothing at all beyond
the page itself: everything it shows is inline.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse

from api.deps import StoreDep
from api.page.data import RankMetric, load
from api.page.incident import render_incident, render_problem

router = APIRouter(tags=["pages"])
CSP = "default-src 'none'; style-src 'unsafe-inline'"


@router.get("/incidents/{incident_id:path}", response_class=HTMLResponse,
            include_in_schema=False)
def incident_page(
    incident_id: str,
    store: StoreDep,
    metric: Annotated[
        RankMetric | None, Query(description="the per-rank figure the heatmap colours")
    ] = None,
) -> HTMLResponse:
    """What broke, since when, what it costs, the suspects, step time with the onset marked,
    the per-rank heatmap and a hang's stacks."""
    headers = {"Content-Security-Policy": CSP}
    data = load(store, incident_id, metric)
    if data is None:
        page = render_problem(404, "Not Found", f"no incident with id {incident_id!r}")
        return HTMLResponse(page, status_code=404, headers=headers)
    return HTMLResponse(render_incident(data), headers=headers)
