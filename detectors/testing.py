"""Tiny hand-made steps for detector unit tests and examples: ops listed per rank, built as
real messages and assembled by the real `StepAssembler`, so a test exercises the same frames
the worker builds.

>>> f = frame_of([rank_step(r, "n0", 3, [("compute", "fwd", "", 0, 0.0, 2.5, 0)])
...               for r in range(2)])
>>> f.step, f.rank.tolist(), f.op_dur_ns.tolist()
(3, [0, 1], [2500000, 2500000])
"""

from __future__ import annotations

import numpy as np

from detectors.assembly import StepAssembler
from schemas.frame import StepFrame
from schemas.rankstep import KIND_CODE, RankStep

MS = 1_000_000


def rank_step(
    rank: int,
    node: str,
    step: int,
    ops: list[tuple[str, str, str, int, float, float, int]],
    job: str = "j",
    t0_ns: int = 10**18,
    coords: dict[str, int] | None = None,
) -> RankStep:
    """ops: (kind, name, group, seq, start_ms, dur_ms, bytes) in start order."""
    start = np.array([round(o[4] * MS) for o in ops], dtype=np.int64)
    dur = np.array([round(o[5] * MS) for o in ops], dtype=np.int64)
    end = int((start + dur).max()) if ops else 0
    return RankStep(
        job=job,
        rank=rank,
        node=node,
        step=step,
        t_start_ns=t0_ns,
        t_end_ns=t0_ns + end,
        kind=np.array([KIND_CODE[o[0]] for o in ops], dtype=np.uint8),
        name=[o[1] for o in ops],
        group=[o[2] for o in ops],
        seq=np.array([o[3] for o in ops], dtype=np.int64),
        start_ns=start,
        dur_ns=dur,
        bytes=np.array([o[6] for o in ops], dtype=np.int64),
        coords=coords or {},
    )


def frame_of(msgs: list[RankStep]) -> StepFrame:
    """The one frame of a step's messages (every rank of the step, so nothing waits)."""
    asm = StepAssembler(msgs[0].job)
    asm.world_size = len(msgs)
    frames = []
    for m in msgs:
        frames += asm.add(m, m.t_end_ns)
    assert len(frames) == 1
    return frames[0]
