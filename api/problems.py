"""RFC 9457 problem details for every error the API gives.

Clients (dashboards, scripts, on-call tools) get one error shape whatever went wrong:
`application/problem+json` with type, title, status, detail, instance, and for bad parameters
an `errors` list naming each field and what is wrong with it. Bad input is always a 4xx;
storage trouble is a 503; a 500 means a bug in Flare, and its detail says nothing internal.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from storage.client import StorageError

MEDIA_TYPE = "application/problem+json"
log = logging.getLogger(__name__)


class FieldError(BaseModel):
    field: str
    message: str


class Problem(BaseModel):
    """RFC 9457 problem details (the body of every error response)."""

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    instance: str | None = None
    errors: list[FieldError] | None = None


class ProblemError(Exception):
    """Raised by routes for an answer that is an error (404 unknown job, 422 bad cursor)."""

    def __init__(self, status: int, detail: str, errors: list[FieldError] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.errors = errors


def bad_parameter(field: str, message: str) -> ProblemError:
    """A 422 naming one parameter, for checks FastAPI's own validation cannot express."""
    return ProblemError(422, f"{field}: {message}", [FieldError(field=field, message=message)])


def not_found(detail: str) -> ProblemError:
    return ProblemError(404, detail)


def problem_response(
    request: Request,
    status: int,
    detail: str | None,
    errors: list[FieldError] | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    body = Problem(
        title=HTTPStatus(status).phrase,
        status=status,
        detail=detail,
        instance=request.url.path,
        errors=errors,
    )
    return JSONResponse(
        body.model_dump(exclude_none=True), status_code=status, media_type=MEDIA_TYPE,
        headers=dict(headers) if headers else None,
    )


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    """('query', 'limit') -> 'limit'; body paths keep their dots."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("query", "path", "header", "cookie", "body"):
        parts = parts[1:]
    return ".".join(parts) or "request"


async def _on_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ProblemError)
    return problem_response(request, exc.status, exc.detail, exc.errors)


async def _on_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = [FieldError(field=_field(e.get("loc", ())), message=e.get("msg", "invalid"))
              for e in exc.errors()]
    detail = "; ".join(f"{e.field}: {e.message}" for e in errors) or "invalid request"
    return problem_response(request, 422, detail, errors)


async def _on_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else None
    return problem_response(request, exc.status_code, detail, headers=exc.headers)


async def _on_storage(request: Request, exc: Exception) -> JSONResponse:
    log.warning("storage unavailable: %s", exc)
    return problem_response(request, 503, "storage unavailable; retry later")


async def _on_bug(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return problem_response(request, 500, "internal error; this is a bug in Flare")


def install(app: FastAPI) -> None:
    """Route every error through problem+json."""
    app.add_exception_handler(ProblemError, _on_problem)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http)
    app.add_exception_handler(StorageError, _on_storage)
    app.add_exception_handler(Exception, _on_bug)


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` entries documenting the problem+json errors of a route."""
    return {
        s: {"model": Problem, "description": HTTPStatus(s).phrase,
            "content": {MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}}}
        for s in statuses
    }
