"""Liveness and readiness: what an orchestrator (Kubernetes, compose, `flare up`) polls."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool

from api.deps import ReadyDep, StoreDep
from api.models import Status
from api.problems import ProblemError, responses

router = APIRouter(tags=["health"])


@router.head("/livez", include_in_schema=False)
@router.head("/healthz", include_in_schema=False)
@router.get("/livez", response_model=Status)
@router.get("/healthz", response_model=Status)
async def healthz() -> Status:
    """The process is up and serving HTTP (nothing else is checked): Kubernetes' liveness
    probe (`/livez`; `/healthz` is the same). HEAD answers the same without a body. (async:
    no thread, the fewest turns of a busy worker's loop, whose probe must not time out.)"""
    return Status(status="ok")


@router.head("/readyz", include_in_schema=False)
@router.get("/readyz", response_model=Status, responses=responses(503))
async def readyz(store: StoreDep, ready: ReadyDep) -> Status:
    """Ready to answer: the embedding process says so (e.g. the worker's liveness watchdog)
    and ClickHouse answers (the engine a query, a server its `/ping`, promptly: see
    `storage.client.ClickHouse.ping`). Otherwise 503 problem+json with the reason.

    The embedding process's check runs on the event loop (the worker's pipeline is read
    there, never from another thread); the ping runs on a thread, since a ClickHouse
    server that does not answer must not hold the loop that serves `/livez`."""
    detail = None
    if ready is not None:
        try:
            ok, detail = ready()
        except Exception as exc:  # a failing check means not ready, never a 500
            ok, detail = False, f"readiness check failed: {exc}"
        if not ok:
            raise ProblemError(503, detail or "not ready")
    if not await run_in_threadpool(store.ping):
        raise ProblemError(503, "ClickHouse does not answer")
    return Status(status="ready", detail=detail or None)
