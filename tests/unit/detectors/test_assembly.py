"""Step assembly: a step leaves when whole or when its grace, in the job's own units, is over."""

from __future__ import annotations

from detectors.assembly import StepAssembler
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
