"""Step assembly: a step leaves when whole or when its grace, in the job's own units, is over."""

from __future__ import annotations

import dataclasses

import numpy as np

from detectors.assembly import StepAssembler, sort_ops
from detectors.testing import rank_step
from schemas.clock import NS_PER_S

T0 = 10**18


def _step(rank: int, step: int, step_s: float, end_late_s: float = 0.0):
    """A rank-step of `step_s` seconds that starts `end_late_s` after the others."""
    return rank_step(rank, f"n{rank}", step, [("compute", "fwd", "", 0, 0.0, step_s * 1e3, 0)],
                     t0_ns=T0 + int((step * step_s + end_late_s) * NS_PER_S))


def _run(step_s: float, late_s: float, learn_steps: int = 2) -> list[tuple[int, list[int]]]:
    """Steps of `step_s`; from step `learn_steps` on, rank 1 reports `late_s` after rank 0."""
    asm = StepAssembler("j", grace_s=5.0, grace_steps=0.5)
    asm.world_size = 2
    out: list[tuple[int, list[int]]] = []
    for s in range(learn_steps + 1):
        lag = late_s if s == learn_steps else 0.0
        first = _step(0, s, step_s)
        frames = asm.add(first, first.t_end_ns)
        late = _step(1, s, step_s, lag)
        frames += asm.advance(first.t_end_ns + int(lag * NS_PER_S) - 1)
        frames += asm.add(late, late.t_end_ns)
        for f in frames:
            out.append((f.step, f.missing.tolist()))
            asm.set_step_time(step_s)  # what the diagnoser does after each step
    return out


def test_a_rank_six_seconds_behind_on_thirty_second_steps_is_waited_for() -> None:
    # a fixed 5 s grace dropped it (the rank then looked dark); half a step is 15 s
    assert _run(step_s=30.0, late_s=6.0)[-1] == (2, [])


def test_on_short_steps_the_floor_applies_and_a_rank_far_behind_is_missing() -> None:
    frames = _run(step_s=1.0, late_s=6.0)
    assert (2, [1]) in frames  # 6 s behind on 1 s steps: past the 5 s floor, left missing


def test_before_any_step_the_grace_scales_with_the_step_the_ranks_took() -> None:
    asm = StepAssembler("j", grace_s=5.0, grace_steps=0.5)
    asm.world_size = 2
    first = _step(0, 0, 40.0)
    assert asm.add(first, first.t_end_ns) == []
    assert asm.advance(first.t_end_ns + 15 * NS_PER_S) == []  # within 0.5 × 40 s
    [frame] = asm.advance(first.t_end_ns + 21 * NS_PER_S)
    assert frame.rank.tolist() == [0]


def test_ops_reported_in_completion_order_are_put_in_start_order_within_their_rank() -> None:
    from detectors.testing import frame_of

    def op(name: str, start_ms: float) -> tuple:
        return ("compute", name, "", 0, start_ms, 1.0, 0)

    in_order = frame_of([rank_step(0, "n0", 0, [op("a", 0.0), op("b", 5.0)]),
                         rank_step(1, "n0", 0, []),
                         rank_step(2, "n0", 0, [op("c", 1.0), op("d", 3.0)])])
    assert sort_ops(in_order).op_name is in_order.op_name  # a step back across ranks only
    swap = np.array([0, 1, 3, 2])  # rank 2's two ops as a completion-ordered producer sends
    shuffled = dataclasses.replace(in_order, **{
        c: getattr(in_order, c)[swap] for c in ("op_kind", "op_name", "op_group", "op_seq",
                                                 "op_start_ns", "op_dur_ns", "op_bytes")})
    assert [shuffled.names[i] for i in shuffled.op_name] == ["a", "b", "d", "c"]
    out = sort_ops(shuffled)
    assert [out.names[i] for i in out.op_name] == ["a", "b", "c", "d"]
    assert out.op_start_ns.tolist() == [0, 5_000_000, 1_000_000, 3_000_000]
