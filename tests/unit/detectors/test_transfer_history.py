"""Each transfer's own past (`detectors/transfer_history.py`, `network_suspects.OwnPast`)."""

from __future__ import annotations

import numpy as np

from detectors.features import Instances, step_features
from detectors.network_suspects import OwnPast, reference_and_peers
from detectors.testing import frame_of, rank_step
from detectors.transfer_history import TransferHistory
from schemas.frame import StepFrame


def _step(ms_dp1: float, ms_dp0: float = 10.0) -> tuple[StepFrame, Instances]:
    """Four nodes, two data-parallel pairs across them: one all-reduce each."""
    def ops(r: int) -> list[tuple[str, str, str, int, float, float, int]]:
        ms = ms_dp1 if r % 2 else ms_dp0
        return [("coll", "all_reduce", f"dp.{r % 2}", 1, 0.0, ms, 1 << 20)]
    frame = frame_of([rank_step(r, f"n{r}", 0, ops(r)) for r in range(4)])
    return frame, step_features(frame).inst


def _feed(history: TransferHistory, values: list[float]) -> None:
    for ms in values:
        frame, inst = _step(ms)
        history.observe(frame, inst, *reference_and_peers(inst))


def _dp1(history: TransferHistory, ms: float) -> tuple[float, bool]:
    """dp.1's reference (ms) and whether `ms` is slow against its own past."""
    frame, inst = _step(ms)
    own = history.observe(frame, inst, *reference_and_peers(inst), learn=False)
    i = [frame.groups[g] for g in inst.group.tolist()].index("dp.1")
    return round(float(own.ref[i] * 1e3), 3), bool(own.slow(inst.transfer_s)[i])


def test_a_step_is_remembered_only_after_delay_more_steps():
    history = TransferHistory(delay=5)
    _feed(history, [10.0] * 5)
    assert np.isnan(_dp1(history, 10.0)[0])  # five steps seen, none remembered yet
    _feed(history, [10.0] * 5)
    assert _dp1(history, 10.0)[0] == 10.0


def test_the_steps_not_yet_remembered_are_dropped_while_an_incident_is_open():
    """A fault's first steps come before its incident opens: they must not become its
    instances' usual."""
    history = TransferHistory(delay=3)
    _feed(history, [10.0] * 8)
    _feed(history, [400.0] * 3)  # the fault, before its incident
    history.drop_recent()
    _feed(history, [10.0] * 3)  # three healthy steps again, still waiting
    ref, slow = _dp1(history, 400.0)
    assert ref == 10.0 and slow


def test_a_flapping_burst_never_becomes_the_usual():
    """Twice the slowest past transfer is not remembered, however often it comes."""
    history = TransferHistory(delay=0)
    _feed(history, [10.0, 11.0, 9.0, 10.0, 12.0] * 2)
    _feed(history, [300.0, 10.0, 10.0] * 8)  # a burst every third step
    ref, slow = _dp1(history, 300.0)
    assert ref == 10.0 and slow


def test_a_transfer_within_its_own_past_is_not_slow_however_far_from_its_usual():
    """On a busy host a small transfer is 0.2 ms or, when its thread was descheduled, a few
    ms: a spike as long as earlier ones is the job's own noise."""
    history = TransferHistory(delay=0)
    _feed(history, [0.2, 0.2, 0.2, 3.0, 0.2, 0.2, 2.0, 0.2, 0.2, 0.2])
    assert _dp1(history, 2.6) == (0.2, False)
    assert _dp1(history, 270.0)[1]  # a NIC held to a tenth: beyond anything it ever took


def test_without_enough_past_nothing_is_slow():
    history = TransferHistory(delay=0)
    _feed(history, [10.0] * 4)
    ref, slow = _dp1(history, 1000.0)
    assert np.isnan(ref) and not slow
    own = OwnPast(*(np.full(2, np.nan) for _ in range(3)))
    assert not own.slow(np.array([1.0, 2.0])).any()


def _pairs_step(ms_dp1: float) -> tuple[StepFrame, Instances]:
    """Eight nodes, four data-parallel pairs: the step compares their all-reduces too."""
    def ops(r: int) -> list[tuple[str, str, str, int, float, float, int]]:
        ms = ms_dp1 if r % 4 == 1 else 10.0 + r % 4 * 0.1
        return [("coll", "all_reduce", f"dp.{r % 4}", 1, 0.0, ms, 1 << 20)]
    frame = frame_of([rank_step(r, f"n{r}", 0, ops(r)) for r in range(8)])
    return frame, step_features(frame).inst


def test_a_moderate_burst_its_peers_do_not_share_is_not_learned():
    """A NIC at half speed now and then: each burst is ×2, under twice the slowest healthy
    transfer, but slow against both the instance's past and the step's peers. Learned, it
    would raise the past's slowest to itself and hide the next bursts."""
    history = TransferHistory(delay=0)
    for ms in [10.0, 10.5, 9.8, 10.2, 10.4, 10.1] + [20.0, 10.0, 10.3] * 6:
        frame, inst = _pairs_step(ms)
        history.observe(frame, inst, *reference_and_peers(inst))
    frame, inst = _pairs_step(20.0)
    own = history.observe(frame, inst, *reference_and_peers(inst), learn=False)
    i = [frame.groups[g] for g in inst.group.tolist()].index("dp.1")
    assert own.top[i] < 0.0111 and own.slow(inst.transfer_s)[i]
