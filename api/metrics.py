"""The API's own Prometheus metrics: requests by route and status, and how long they took.

Counted by a middleware on the route template (`/v1/incidents/{incident_id}`), never the raw
path, so an id in a URL cannot grow the series without bound. The page at `/metrics` is this
plus whatever the embedding process adds (the worker adds its own, `streams.metrics`).

>>> m = RequestMetrics()
>>> m.observe("GET", "/v1/incidents", 200, 0.004)
>>> 'flare_api_requests_total{code="200",method="GET",route="/v1/incidents"} 1' in m.render("1")
True
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from schemas.prometheus import Exposition

SECONDS_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class RequestMetrics:
    """Request counts and durations of one API process."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str, str]] = Counter()  # method, route, code
        self._buckets: dict[str, np.ndarray] = {}  # route -> count per bucket (+Inf last)
        self._sums: dict[str, float] = {}

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests[(method, route, str(status))] += 1
        b = self._buckets.get(route)
        if b is None:
            b = self._buckets[route] = np.zeros(len(SECONDS_BOUNDS) + 1, dtype=np.int64)
        b[int(np.searchsorted(SECONDS_BOUNDS, seconds))] += 1
        self._sums[route] = self._sums.get(route, 0.0) + seconds

    def render(self, version: str) -> str:
        page = Exposition()
        page.family("flare_api_build_info", "gauge", "The API's version, as a label; always 1.")
        page.sample("flare_api_build_info", {"version": version}, 1)
        page.family("flare_api_requests_total", "counter",
                    "HTTP requests answered, by method, route template and status code.")
        for (method, route, code), n in sorted(self.requests.items()):
            page.sample("flare_api_requests_total",
                        {"method": method, "route": route, "code": code}, n)
        page.family("flare_api_request_seconds", "histogram",
                    "Seconds to answer a request, by route template.")
        for route, b in sorted(self._buckets.items()):
            page.histogram_samples("flare_api_request_seconds", {"route": route},
                                   SECONDS_BOUNDS, np.cumsum(b[:-1]).tolist(),
                                   float(self._sums[route]), int(b.sum()))
        return page.text()


def install(app: FastAPI, metrics: RequestMetrics) -> None:
    """Count every request the app answers (problems included) by its route template."""
    app.add_middleware(_CountRequests, metrics=metrics)


class _CountRequests:
    """A plain ASGI middleware, not Starlette's `BaseHTTPMiddleware`: that one runs the app
    in a task of its own behind memory streams, eight more turns of the event loop per
    request, and the worker serves the API from the loop that diagnoses."""

    def __init__(self, app: ASGIApp, metrics: RequestMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        await self.app(scope, receive, send_counted)
        # the template with the routers' prefixes (FastAPI keeps it on the effective route
        # of an included router; a plain route carries it itself)
        inner = scope.get("fastapi")
        where = (inner.get("effective_route_context") if isinstance(inner, dict) else None
                 ) or scope.get("route")
        template = getattr(where, "path_format", None) or "unmatched"
        self.metrics.observe(scope["method"], template, status, time.perf_counter() - t0)
