"""/v1/jobs: jobs with their health, a job's step series and its per-rank scores.

Job ids may contain `/` (namespace/name), so the job is a `path` parameter; the routes with
a suffix are declared first so `/v1/jobs/a/b/steps` reads as job `a/b`.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.deps import Offset, Step, StoreDep
from api.models import JobHealth, JobPage, RankScores, StepPoint, StepSeries
from api.problems import bad_parameter, not_found, responses
from schemas.report import IrregularClass
from storage.reader import RankSort, Reader, Row

router = APIRouter(prefix="/jobs", tags=["jobs"])

HEALTHY = ("normal", "warmup")


def _health(row: Row) -> JobHealth:
    if row["open_incidents"]:
        health = "incident"
    elif row["irregular"] not in HEALTHY:
        health = "irregular"
    else:
        health = "ok"
    return JobHealth.model_validate({**row, "health": health})


def _last_step(store: Reader, job: str) -> int:
    last = store.last_step(job)
    if last is None:
        raise not_found(f"no steps stored for job {job!r}")
    return last


@router.get("", response_model=JobPage, responses=responses(422, 503))
def list_jobs(
    store: StoreDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> JobPage:
    """Every job with stored steps (by name): newest step, its time and δ, open incidents."""
    rows = store.jobs(limit=limit, offset=offset)
    return JobPage(items=[_health(r) for r in rows], limit=limit, offset=offset)


@router.get(
    "/{job:path}/steps", response_model=StepSeries, responses=responses(404, 422, 503)
)
def job_steps(
    job: str,
    store: StoreDep,
    from_step: Step | None = None,
    to_step: Step | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 1000,
    irregular: Annotated[
        list[IrregularClass] | None,
        Query(max_length=16, description="keep only these classes (repeat the parameter)"),
    ] = None,
) -> StepSeries:
    """A job's step series (step time, baseline, δ, irregular class). Without `from_step`:
    the newest `limit` steps up to `to_step`; with it, pages forward via `next_from_step`."""
    if from_step is not None and to_step is not None and from_step > to_step:
        raise bad_parameter("to_step", "must not be before from_step")
    _last_step(store, job)
    rows = store.steps(
        job, from_step=from_step, to_step=to_step, limit=limit + 1,
        irregular=list(irregular) if irregular is not None else None,
    )
    next_from = None
    if len(rows) > limit:
        if from_step is not None:
            next_from, rows = rows[limit]["step"], rows[:limit]
        else:
            rows = rows[1:]
    return StepSeries(
        job=job, steps=[StepPoint.model_validate(r) for r in rows], next_from_step=next_from
    )


@router.get(
    "/{job:path}/ranks", response_model=RankScores, responses=responses(404, 422, 503)
)
def job_ranks(
    job: str,
    store: StoreDep,
    last: Annotated[
        int | None, Query(ge=1, le=100_000, description="the job's newest N steps (default 100)")
    ] = None,
    step: Annotated[Step | None, Query(description="one step instead of the newest N")] = None,
    sort: RankSort = "rank",
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> RankScores:
    """Per-rank compute ratio, idle gap, wait and caused wait, averaged over the job's newest
    `last` steps or taken at one `step`."""
    if last is not None and step is not None:
        raise bad_parameter("step", "give either last or step, not both")
    newest = _last_step(store, job)
    if step is not None:
        lo = hi = step
    else:
        hi = newest
        lo = max(0, hi - (last or 100) + 1)
    rows = store.rank_scores(job, lo, hi, sort=sort, limit=limit)
    if step is not None and not rows:
        raise not_found(f"no rank rows stored for job {job!r} at step {step}")
    return RankScores(job=job, from_step=lo, to_step=hi, ranks=rows)


@router.get("/{job:path}", response_model=JobHealth, responses=responses(404, 422, 503))
def get_job(job: str, store: StoreDep) -> JobHealth:
    """One job's health: newest step, its time and δ, open incidents."""
    row = store.job(job)
    if row is None:
        raise not_found(f"no steps stored for job {job!r}")
    return _health(row)
