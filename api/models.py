"""Response models of the API, split from the storage rows they are built from.

Storage may change (columns added, Float32 vs Float64, arrays vs JSON) without changing what
clients see; the models also turn NaN and ±inf (a δ during warm-up, an average over nothing)
into null, because JSON has no NaN and a serializer error would be a 500.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, Field


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


Num = Annotated[float | None, BeforeValidator(_finite)]
IncidentStatus = Literal["open", "resolved"]
IncidentKind = Literal["gpu", "node", "host", "link", "switch", "hang", "job"]


class Suspect(BaseModel):
    entity: str = Field(
        description="rank:<n>, node:<name>, link:<a>~<b>, group:<g>, switch:<s> or job"
    )
    confidence: Num


class Incident(BaseModel):
    """Incident v1 (DESIGN §3), the newest state stored."""

    v: int = 1
    id: str
    job: str
    status: IncidentStatus
    kind: IncidentKind
    culprit: str
    suspects: list[Suspect]
    onset_step: int = Field(description="first step of the evidence: when the problem began")
    opened_step: int = Field(description="the step whose processing opened the incident")
    opened_ts_ns: int
    last_step: int
    resolved_step: int | None
    slowdown: Num
    lost_gpu_seconds: Num
    evidence_steps: int
    summary: str


class IncidentPage(BaseModel):
    items: list[Incident]
    limit: int
    offset: int
    next_cursor: str | None = Field(
        description="pass as `cursor` for the next page; null on the last page"
    )


class StepPoint(BaseModel):
    """One job step: its time, the window's normal and the ratio δ between them."""

    step: int
    ts_ns: int
    step_time_s: Num
    baseline_s: Num
    delta: Num
    irregular: str = Field(description="normal | spike | persistent | fluctuation | pause | warmup")
    level_shift: bool
    n_ranks: int
    n_missing: int
    n_detections: int


class DetectionPoint(BaseModel):
    step: int
    kind: str
    score: Num
    excess_s: Num = Field(description="seconds per step attributed to the entity")


class Evidence(BaseModel):
    from_step: int
    to_step: int
    stride: int = Field(description="every stride-th step of the range is in `steps`")
    steps: list[StepPoint]
    culprit_detections: list[DetectionPoint]
    suspects: list[Suspect]


class IncidentDetail(Incident):
    evidence: Evidence


class JobHealth(BaseModel):
    """A job as the on-call sees it: where it is, how fast, and whether something is wrong."""

    job: str
    health: Literal["ok", "irregular", "incident"]
    steps: int
    last_step: int
    last_ts_ns: int
    step_time_s: Num
    baseline_s: Num
    delta: Num
    irregular: str
    n_ranks: int
    open_incidents: int
    incidents: int


class JobPage(BaseModel):
    items: list[JobHealth]
    limit: int
    offset: int


class StepSeries(BaseModel):
    job: str
    steps: list[StepPoint]
    next_from_step: int | None = Field(
        description="pass as `from_step` for the next page; null when the range is done"
    )


class RankScore(BaseModel):
    """One rank over a step range; compute_ratio 1.0 = like its peers, above = slower."""

    rank: int
    node: str
    steps: int
    step_s: Num
    compute_s: Num
    comm_s: Num
    gap_s: Num = Field(description="idle time between ops (host / launch stalls)")
    wait_s: Num = Field(description="time waiting for later peers inside collectives")
    caused_wait_s: Num = Field(description="time peers waited for this rank, per step")
    caused_wait_total_s: Num
    compute_ratio: Num
    min_compute_ratio: Num


class RankScores(BaseModel):
    job: str
    from_step: int
    to_step: int
    ranks: list[RankScore]


class Status(BaseModel):
    status: str
    detail: str | None = None
