"""Hand-made StepReport / StepFrame / incident objects for the storage and API tests.

No detector is involved: every number is chosen here, so a test can state what it expects
to read back. (This module holds builders only; pytest collects no tests from it.)
"""

from __future__ import annotations

import numpy as np

from schemas.frame import StepFrame
from schemas.rankstep import COLL, COMPUTE, COORD_DIMS
from schemas.report import Detection, GroupRows, RankRows, StepReport
from schemas.wire import DeadLetterV1, IncidentV1, Suspect

T0_NS = 1_790_000_000 * 10**9  # a node-clock time; TTLs run on the server clock instead
STEP_NS = 2 * 10**9


def step_ts(step: int) -> int:
    return T0_NS + step * STEP_NS


def make_frame(job: str, step: int, n_ranks: int = 4, ops_per_rank: int = 2) -> StepFrame:
    """Two ranks per node; each rank: one compute op, then all_reduces on dp.0."""
    rank = np.arange(n_ranks, dtype=np.int64)
    n = n_ranks * ops_per_rank
    kinds = np.tile(np.array([COMPUTE] + [COLL] * (ops_per_rank - 1), np.uint8), n_ranks)
    return StepFrame(
        job=job,
        step=step,
        rank=rank,
        node=(rank // 2).astype(np.int32),
        nodes=[f"node-{i}" for i in range((n_ranks + 1) // 2)] + ["node-unused"],
        local_rank=(rank % 2).astype(np.int32),
        coords=np.full((n_ranks, len(COORD_DIMS)), -1, np.int32),
        t_start_ns=np.full(n_ranks, step_ts(step), np.int64),
        t_end_ns=np.full(n_ranks, step_ts(step) + STEP_NS // 2, np.int64),
        off=np.arange(0, n + 1, ops_per_rank, dtype=np.int64),
        op_kind=kinds,
        op_name=np.tile(np.arange(ops_per_rank, dtype=np.int32), n_ranks),
        op_group=(kinds == COLL).astype(np.int32),
        op_seq=np.tile(np.arange(ops_per_rank, dtype=np.int64), n_ranks) + 100 * step,
        op_start_ns=np.tile(np.arange(ops_per_rank, dtype=np.int64) * 1000, n_ranks),
        op_dur_ns=np.full(n, 900, np.int64),
        op_bytes=np.where(kinds == COLL, 1 << 20, 0).astype(np.int64),
        names=["fwd", "all_reduce", "bwd", "optimizer"][:ops_per_rank]
        + [f"op{i}" for i in range(4, ops_per_rank)],
        groups=["", "dp.0"],
        missing=np.zeros(0, np.int64),
    )


def make_report(
    job: str,
    step: int,
    *,
    n_ranks: int = 4,
    step_time_s: float = 1.0,
    baseline_s: float = 1.0,
    irregular: str = "normal",
    slow_rank: int | None = None,
    detections: list[Detection] | None = None,
    with_frame: bool = False,
) -> StepReport:
    """One step: every rank computes 0.6 s; `slow_rank` computes 50% more and makes the
    others wait; rank r's gap is 0.01 * r so per-rank sorting has a known order."""
    rank = np.arange(n_ranks, dtype=np.int64)
    compute = np.full(n_ranks, 0.6)
    caused = np.zeros(n_ranks)
    wait = np.zeros(n_ranks)
    if slow_rank is not None:
        compute[slow_rank] = 0.9
        caused[slow_rank] = 0.3 * (n_ranks - 1)
        wait[:] = 0.3
        wait[slow_rank] = 0.0
    return StepReport(
        job=job,
        step=step,
        ts_ns=step_ts(step),
        n_ranks=n_ranks,
        n_missing=0,
        step_time_s=step_time_s,
        baseline_s=baseline_s,
        delta=step_time_s / baseline_s,
        irregular=irregular,
        level_shift=False,
        ranks=RankRows(
            rank=rank,
            node=[f"node-{r // 2}" for r in range(n_ranks)],
            step_s=np.full(n_ranks, step_time_s),
            compute_s=compute,
            comm_s=np.full(n_ranks, 0.3) + wait,
            gap_s=0.01 * rank,
            wait_s=wait,
            caused_wait_s=caused,
            compute_ratio=compute / 0.6,
            n_ops=np.full(n_ranks, 2, np.int64),
        ),
        groups=GroupRows(
            group=["dp.0", "tp.0"],
            n_members=np.array([n_ranks, 2], np.int64),
            n_instances=np.array([1, 3], np.int64),
            comm_s=np.array([0.3 * n_ranks, 0.1]),
            transfer_s=np.array([0.2 * n_ranks, 0.1]),
            wait_s=np.array([wait.sum(), 0.0]),
            transfer_ratio=np.array([1.0, 1.0]),
        ),
        detections=detections or [],
        frame=make_frame(job, step, n_ranks) if with_frame else None,
    )


def make_incident(
    job: str,
    *,
    culprit: str = "rank:1",
    kind: str = "gpu",
    onset_step: int = 10,
    opened_step: int = 12,
    last_step: int = 20,
    status: str = "open",
    resolved_step: int | None = None,
    opened_ts_ns: int | None = None,
    incident_id: str | None = None,
) -> IncidentV1:
    return IncidentV1(
        v=1,
        id=incident_id or f"{job}/{kind}/{culprit}/{onset_step}",
        job=job,
        status=status,  # type: ignore[arg-type]
        kind=kind,  # type: ignore[arg-type]
        culprit=culprit,
        suspects=[Suspect(culprit, 0.9), Suspect("node:node-0", 0.1)],
        onset_step=onset_step,
        opened_step=opened_step,
        opened_ts_ns=step_ts(opened_step) if opened_ts_ns is None else opened_ts_ns,
        last_step=last_step,
        resolved_step=resolved_step,
        slowdown=1.3,
        lost_gpu_seconds=12.5,
        evidence_steps=last_step - onset_step + 1,
        summary=f"{culprit} computes 50% slower than its peers",
    )


def make_dead_letter(offset: int, reason: str = "$.v: unsupported version") -> DeadLetterV1:
    return DeadLetterV1(
        v=1, topic="flare.steps.v1", partition=0, offset=offset, reason=reason, payload_b64="e30="
    )
