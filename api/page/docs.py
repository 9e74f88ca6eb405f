"""/docs from files that ship in a pinned package, so the API's documentation opens offline.

FastAPI's own /docs loads Swagger UI from a CDN: on an air-gapped cluster, or a laptop on a
plane, the page stays blank. The `fastapi-offline` package ships Swagger UI 5's bundle and
stylesheet (5 is the first to read OpenAPI 3.1, which FastAPI writes); we serve those two
files under /static/swagger-ui and build the page with FastAPI's own `get_swagger_ui_html`.
Nothing of Swagger is copied into this repository. The online validator badge is off (it
would send the schema to swagger.io), and the Content-Security-Policy keeps the browser from
loading anything from elsewhere.
"""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html, swagger_ui_default_parameters
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(fastapi_offline.__file__).parent / "static"
STATIC_URL = "/static/swagger-ui"
CSP = ("default-src 'self'; script-src 'self' 'unsafe-inline'; "
       "style-src 'self' 'unsafe-inline'; img-src 'self' data:")


def install(app: FastAPI, docs_url: str = "/docs") -> None:
    """Serve Swagger UI at `docs_url` over the app's /openapi.json, with local assets only.
    The app must be built with `docs_url=None` (FastAPI's CDN page)."""
    app.mount(STATIC_URL, StaticFiles(directory=ASSETS), name="swagger-ui")
    parameters = {**swagger_ui_default_parameters, "validatorUrl": None}

    @app.get(docs_url, include_in_schema=False)
    def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        page = get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{root}{STATIC_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{STATIC_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{STATIC_URL}/favicon.png",
            swagger_ui_parameters=parameters,
        )
        page.headers["Content-Security-Policy"] = CSP
        return page
