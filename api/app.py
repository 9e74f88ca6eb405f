"""The FastAPI application: SRE questions about incidents and jobs, answered from ClickHouse.

`create_app` takes a built store (and optionally a readiness check from the embedding
process), so the same app runs standalone (`flare api`), inside the worker's process (which
owns an embedded chDB) and in tests; it builds no clients and reads no settings itself.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Depends, FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import SecretStr

from api import auth, metrics, problems
from api.deps import Ready
from api.page import docs as offline_docs
from api.page import routes as pages
from api.routes import dead_letters, health, incidents, jobs
from api.routes import sql as sql_routes
from schemas.prometheus import CONTENT_TYPE
from storage.adhoc import ReadOnlySQL
from storage.client import ClickHouse
from storage.reader import Queries, Reader


def _version() -> str:
    try:
        return version("flare-diagnosis")
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "0+unknown"


def create_app(store: Reader | ClickHouse, ready: Ready | None = None,
               more_metrics: Callable[[], str] | None = None,
               api_key: str | SecretStr | None = None,
               sql: ReadOnlySQL | None = None) -> FastAPI:
    """The API over `store`: any `Reader` (`Queries` over ClickHouse, or the in-memory one
    of `storage.testing` in tests), or a ClickHouse client to read through `Queries`.
    `ready()` -> (ok, reason) joins /readyz when given; `more_metrics()` is appended to the
    API's own Prometheus page at /metrics (the worker's, when it embeds the API). With an
    `api_key` (FLARE_API_KEY), everything under /v1 needs it (`api.auth`); probes, /metrics
    and the OpenAPI stay open. `sql` (a read-only session, `storage.adhoc`) serves
    POST /v1/sql; without it that route answers 404."""
    if isinstance(store, ClickHouse):
        store = Queries(store)
    app = FastAPI(
        title="Flare",
        version=_version(),
        description="Always-on diagnosis of slow GPUs, nodes, hosts and links in distributed "
        "training: incidents, job health, step series and per-rank scores. Errors are RFC "
        "9457 problem+json.",
        openapi_url="/openapi.json",
        docs_url=None,  # served from local files below (api.page.docs): no CDN
        redoc_url=None,
    )
    app.state.store = store
    app.state.ready = ready
    app.state.sql = sql
    auth.set_api_key(app.state, api_key)
    problems.install(app)
    requests = metrics.RequestMetrics()
    metrics.install(app, requests)

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    def prometheus_metrics() -> PlainTextResponse:
        """Prometheus metrics of this process (text format 0.0.4): the API's requests, and
        the worker's own when the worker serves the API."""
        page = requests.render(app.version)
        if more_metrics is not None:
            page += more_metrics()
        return PlainTextResponse(page, media_type=CONTENT_TYPE)

    app.include_router(health.router)
    # the key guards the router, so every route put under /v1 is guarded
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(auth.require_api_key)])
    v1.include_router(incidents.router)
    v1.include_router(jobs.router)
    v1.include_router(dead_letters.router)
    v1.include_router(sql_routes.router)
    app.include_router(v1)
    # the incident page shows /v1 data: the same key guards it
    app.include_router(pages.router, dependencies=[Depends(auth.require_api_key)])
    offline_docs.install(app)
    return app
