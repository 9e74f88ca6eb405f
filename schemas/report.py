"""What the diagnoser hands to the outside world after each step: rows to store, incidents.

These are plain columnar containers; the stream worker writes them to ClickHouse
(rank_steps, job_steps, group_steps, ops, detections) and publishes the incidents. Keeping
them here, free of I/O, lets `flare diagnose` and the worker share one code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

import numpy as np

from schemas.frame import StepFrame
from schemas.wire import IncidentV1


@dataclass(slots=True)
class RankRows:
    """Per-rank figures of one step (all arrays (R,), seconds unless said)."""

    rank: np.ndarray  # int64
    node: list[str]
    step_s: np.ndarray  # t_end - t_start
    compute_s: np.ndarray  # sum of compute op durations
    comm_s: np.ndarray  # sum of coll + p2p durations
    gap_s: np.ndarray  # idle time between ops (host / launch)
    wait_s: np.ndarray  # time spent waiting for later peers inside collectives
    caused_wait_s: np.ndarray  # time peers spent waiting for this rank
    compute_ratio: np.ndarray  # compute vs comparable peers (1.0 = like its peers)
    n_ops: np.ndarray  # int64


@dataclass(slots=True)
class GroupRows:
    """Per-group aggregates of one step (arrays (G,))."""

    group: list[str]
    n_members: np.ndarray  # int64
    n_instances: np.ndarray  # int64 collective / p2p instances this step
    comm_s: np.ndarray  # summed copy durations of all members
    transfer_s: np.ndarray  # summed transfer estimates (last arrival to end)
    wait_s: np.ndarray  # summed waits of all members
    transfer_ratio: np.ndarray  # transfer vs comparable instances (1.0 = normal)


# The classes a step can get (`StepReport.irregular`): the first steps only fill the window.
IrregularClass = Literal["warmup", "normal", "spike", "fluctuation", "persistent"]
IRREGULAR_CLASSES: tuple[str, ...] = get_args(IrregularClass)


@dataclass(slots=True)
class Detection:
    """One suspect's evidence in one step (only suspects above the noise are reported)."""

    entity: str
    kind: str
    score: float  # significance of this step's excess (robust z, capped)
    excess_s: float  # seconds per step attributable to the entity


@dataclass(slots=True)
class StepReport:
    """Everything one assembled step produced."""

    job: str
    step: int
    ts_ns: int  # latest t_end_ns of the step (the node clock of the last rank)
    n_ranks: int
    n_missing: int
    step_time_s: float  # median over ranks of t_end - t_start
    baseline_s: float  # the window's normal step time
    delta: float  # step_time_s / baseline_s
    irregular: str  # one of IRREGULAR_CLASSES (detectors.irregularity sets it)
    level_shift: bool  # a confirmed change point at this step (baseline re-set)
    ranks: RankRows
    groups: GroupRows
    detections: list[Detection]
    frame: StepFrame | None = None  # kept for raw op storage on sampled or irregular steps


@dataclass(slots=True)
class DiagnoserOutput:
    """What one call into the diagnoser produced: zero or more reports and incident events."""

    reports: list[StepReport] = field(default_factory=list)
    incidents: list[IncidentV1] = field(default_factory=list)

    def extend(self, other: DiagnoserOutput) -> DiagnoserOutput:
        self.reports.extend(other.reports)
        self.incidents.extend(other.incidents)
        return self
