"""Conformance of the stateful detectors: inputs untouched, state pickles, deterministic."""

from __future__ import annotations

import pickle

import numpy as np

from detectors.diagnoser import JobDiagnoser
from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus
from schemas.frame import StepFrame


def _frames(steps: int = 30) -> list[StepFrame]:
    sc = Scenario(
        job="c",
        layout=layout_for_gpus(64),
        steps=steps,
        seed=5,
        fault=Fault("slow_gpu", 1.5, 10),
        heartbeats=False,
    )
    return [f for f in ClusterSimulator(sc).run() if isinstance(f, StepFrame)]


def _snapshot(f: StepFrame) -> dict[str, np.ndarray]:
    return {
        k: getattr(f, k).copy()
        for k in StepFrame.__slots__
        if isinstance(getattr(f, k), np.ndarray)
    }


def test_frames_are_not_mutated():
    d = JobDiagnoser("c")
    for f in _frames(15):
        before = _snapshot(f)
        d.on_frame(f)
        for k, arr in before.items():
            assert np.array_equal(arr, getattr(f, k)), k


def test_state_pickles_mid_run_and_continues_identically():
    frames = _frames()
    a = JobDiagnoser("c")
    for f in frames[:12]:
        a.on_frame(f)
    b = pickle.loads(pickle.dumps(a))
    out_a = [i for f in frames[12:] for i in a.on_frame(f).incidents]
    out_b = [i for f in frames[12:] for i in b.on_frame(f).incidents]
    assert out_a and out_a == out_b


def test_same_input_same_output():
    frames = _frames()
    runs = []
    for _ in range(2):
        d = JobDiagnoser("c")
        runs.append(
            [
                (r.step, r.delta, [x.entity for x in r.detections])
                for f in frames
                for r in d.on_frame(f).reports
            ]
        )
    assert runs[0] == runs[1]
