"""Incident lifecycle: open, update, resolve, with deterministic ids and numbers that matter.

An SRE needs one stable object per problem: the id is a hash of job, kind, culprit and the
opening step, so a replay after a crash reproduces the same ids (ClickHouse then replaces
instead of duplicating). Slowdown and lost GPU-seconds are what the problem costs.

>>> book = IncidentBook("j", resolve_after=2)
>>> inc = book.open_incident("gpu", "rank:2", [], 40, 42, 0, "rank 2 computes 50% slower")
>>> inc.add_evidence(42, slowdown=1.25, step_time_s=2.0, world=8)
>>> inc.slowdown, round(inc.lost_gpu_seconds, 6)  # 2 s × (1 - 1/1.25) × 8 GPUs
(1.25, 3.2)
>>> book.quiet_step(set(), 43), [i.resolved_step for i in book.quiet_step(set(), 44)]
([], [44])
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from detectors.base import Stateful
from schemas.clock import NS_PER_S
from schemas.wire import IncidentV1, StackGroup, Suspect


def incident_id(job: str, kind: str, culprit: str, opened_step: int) -> str:
    """Stable id of an incident: the same job, kind, culprit and opening step, the same id."""
    raw = f"{job}|{kind}|{culprit}|{opened_step}".encode()
    return hashlib.sha1(raw).hexdigest()[:20]


@dataclass(slots=True)
class OpenIncident:
    """Mutable state behind one incident id."""

    id: str
    kind: str
    culprit: str
    suspects: list[Suspect]
    onset_step: int
    opened_step: int
    opened_ts_ns: int
    last_step: int
    summary: str
    slowdown_sum: float = 0.0
    lost_gpu_seconds: float = 0.0
    lost_gpu_seconds_per_step: float = 0.0  # the latest step's
    evidence_steps: int = 0
    quiet: int = 0
    resolved_step: int | None = None
    since_ns: int = 0  # a hang: stream time of the job's last progress
    held_ns: int = 0  # a hang: stream time its cost was last brought up to date
    stacks: list[StackGroup] | None = None  # a hang: the ranks' stacks merged
    # quiet steps that resolve it, when not the book's: an intermittent fault is quiet
    # between its bursts, and resolving in one of those gaps pages the same fault twice
    resolve_after: int | None = None
    _net_lost: float = 0.0  # Σ of the steps' estimates, negative ones included (`_lose`)
    priced_step: int = -1  # the last evidence step its what-if was replayed on ...
    priced_slowdown: float = 1.0  # ... and the slowdown it gave (`JobDiagnoser._evidence`)

    @property
    def slowdown(self) -> float:
        """The job's mean slowdown over the evidence steps (never shown below 1)."""
        return max(self.slowdown_sum / self.evidence_steps, 1.0) if self.evidence_steps else 1.0

    def add_evidence(self, step: int, slowdown: float, step_time_s: float, world: int) -> None:
        """The step showed the fault and, by the what-if estimate, slowed the job by
        `slowdown`: `world` GPUs each lost the part of the step beyond step / slowdown."""
        self.last_step = step
        self.evidence_steps += 1
        self.quiet = 0
        self.slowdown_sum += slowdown
        self._lose(step_time_s * (1.0 - 1.0 / slowdown) * world if slowdown > 0 else 0.0)

    def add_cost(self, slowdown: float, step_time_s: float, world: int) -> None:
        """A step the incident cost without being evidence of it (a job-wide shift keeps
        costing while it is open, but nothing new is learned)."""
        self._lose(step_time_s * (1.0 - 1.0 / slowdown) * world if slowdown > 0 else 0.0)

    def hold(self, since_ns: int, now_ns: int, step_time_s: float, world: int) -> None:
        """A hang: the whole job has made no progress since `since_ns`."""
        self.lost_gpu_seconds = max(now_ns - since_ns, 0) / NS_PER_S * world
        self.lost_gpu_seconds_per_step = step_time_s * world

    def _lose(self, gpu_seconds: float) -> None:
        """Add one step's loss. A step's estimate is a difference of two noisy step times,
        so it can come out below zero (the job ran a little faster than its what-if): the
        sum keeps those, so the noise of the steps cancels instead of adding up, and only
        the figures shown are floored at zero."""
        self._net_lost += gpu_seconds
        self.lost_gpu_seconds = max(self._net_lost, 0.0)
        self.lost_gpu_seconds_per_step = max(gpu_seconds, 0.0)

    def to_v1(self, job: str) -> IncidentV1:
        return IncidentV1(
            v=1,
            id=self.id,
            job=job,
            status="resolved" if self.resolved_step is not None else "open",
            kind=self.kind,  # type: ignore[arg-type]
            culprit=self.culprit,
            suspects=list(self.suspects),
            onset_step=self.onset_step,
            opened_step=self.opened_step,
            opened_ts_ns=self.opened_ts_ns,
            last_step=self.last_step,
            resolved_step=self.resolved_step,
            slowdown=round(self.slowdown, 4),
            lost_gpu_seconds=round(self.lost_gpu_seconds, 1),
            lost_gpu_seconds_per_step=round(self.lost_gpu_seconds_per_step, 2),
            evidence_steps=self.evidence_steps,
            summary=self.summary,
            stacks=self.stacks,
        )


class IncidentBook(Stateful):
    """Open incidents of one job, keyed by (kind, culprit)."""

    def __init__(self, job: str, resolve_after: int = 10) -> None:
        self.job = job
        self.resolve_after = resolve_after
        self.open: dict[tuple[str, str], OpenIncident] = {}

    def get(self, kind: str, culprit: str) -> OpenIncident | None:
        return self.open.get((kind, culprit))

    def open_incident(
        self,
        kind: str,
        culprit: str,
        suspects: list[Suspect],
        onset_step: int,
        step: int,
        ts_ns: int,
        summary: str,
    ) -> OpenIncident:
        inc = OpenIncident(
            id=incident_id(self.job, kind, culprit, step),
            kind=kind,
            culprit=culprit,
            suspects=suspects,
            onset_step=onset_step,
            opened_step=step,
            opened_ts_ns=ts_ns,
            last_step=step,
            summary=summary,
        )
        self.open[(kind, culprit)] = inc
        return inc

    def quiet_step(self, touched: set[tuple[str, str]], step: int) -> list[OpenIncident]:
        """Count a step without evidence for untouched incidents; return those now resolved."""
        done = []
        for key, inc in list(self.open.items()):
            if key in touched:
                continue
            inc.quiet += 1
            if inc.quiet >= (inc.resolve_after or self.resolve_after):
                inc.resolved_step = step
                done.append(inc)
                del self.open[key]
        return done

    def resolve(self, kind: str, culprit: str, step: int) -> OpenIncident | None:
        inc = self.open.pop((kind, culprit), None)
        if inc is not None:
            inc.resolved_step = step
        return inc
