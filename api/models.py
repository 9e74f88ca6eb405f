"""Response models of the API, split from the storage rows they are built from.

Storage may change (columns added, Float32 vs Float64, arrays vs JSON) without changing what
clients see; floats that are NaN or ±inf become null, because JSON has no NaN and a
serializer error would be a 500. The models that show a source shape whole are derived from
it (`api.derive`): an incident from `schemas.wire.IncidentV1`, a step point from a
`job_steps` row, a rank score from the reader's rank aggregates; their class bodies hold only
descriptions and the field order clients have always seen.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from api.derive import Num, derived_from
from schemas.wire import IncidentV1
from schemas.wire import StackGroup as WireStackGroup
from schemas.wire import Suspect as WireSuspect
from storage.reader import RANK_SCORE_FIELDS, STEP_FIELDS

IncidentStatus = Literal["open", "resolved"]  # IncidentV1.status (a test holds them equal)


@derived_from(WireSuspect)
class Suspect(BaseModel):
    entity: str = Field(
        description="rank:<n>, node:<name>, link:<a>~<b>, group:<g>, switch:<s> or job"
    )


@derived_from(WireStackGroup)
class StackGroup(BaseModel):
    """One distinct Python stack of a hung job's ranks (hang forensics)."""

    ranks: str = Field(description="the ranks whose thread is at this stack, as ranges: 0-3,5")
    not_ranks: str = Field(description="the job's ranks that are not there, as ranges")
    note: str = Field(default="", description="for a group without frames: why these ranks "
                      "sent no stack (a stopped or frozen process, or no answer)")


@derived_from(IncidentV1)
class Incident(BaseModel):
    """Incident v1 (DESIGN §3), the newest state stored."""

    v: int = 1  # shown as an integer with a default, as it always was
    onset_step: int = Field(description="first step of the evidence: when the problem began")
    opened_step: int = Field(description="the step whose processing opened the incident")
    # What the incident costs, described here because the numbers are what-if estimates an
    # SRE weighs against a budget, and `slowdown` once meant the culprit's own ratio.
    slowdown: Num = Field(
        description="the job's step time over its step time without the culprit (1.0 = no "
        "effect on the job)"
    )
    lost_gpu_seconds: Num = Field(
        description="GPU-seconds the job lost to the incident so far, summed over its steps"
    )
    lost_gpu_seconds_per_step: Num = Field(
        default=0.0,
        description="GPU-seconds the job lost to the incident in its latest step (0 in "
        "incidents stored before it was recorded)",
    )
    stacks: list[StackGroup] | None = Field(
        default=None,
        description="a hang: every rank's Python stacks merged, one entry per distinct stack, "
        "the rarest first (the odd one out leads); null for other incidents",
    )


class IncidentPage(BaseModel):
    items: list[Incident]
    limit: int
    offset: int
    next_cursor: str | None = Field(
        description="pass as `cursor` for the next page; null on the last page"
    )


@derived_from(STEP_FIELDS)
class StepPoint(BaseModel):
    """One job step: its time, the window's normal and the ratio δ between them."""

    step: int
    ts_ns: int
    step_time_s: Num
    baseline_s: Num
    delta: Num
    irregular: str = Field(description="warmup | normal | spike | fluctuation | persistent")
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


@derived_from(RANK_SCORE_FIELDS)
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


class DeadLetter(BaseModel):
    """An input that could not be used (`flare.deadletter.v1`, as stored)."""

    topic: str
    partition: int
    offset: int
    reason: str = Field(description="why it was refused: the field and what was wrong")
    payload_b64: str = Field(description="the original bytes, base64")


class Status(BaseModel):
    status: str
    detail: str | None = None
