"""Cluster simulator with fault injection and ground truth: the test bench of the detectors.

A `Scenario` (layout, steps, seed, optional `Fault`, clean `Noise`) becomes a stream of
physically faithful steps: per-rank clocks, launch gaps, compute, collectives that end when
their last member arrives, p2p rendezvous, GPipe or 1F1B pipelining. `ClusterSimulator.run()` yields
`StepFrame`s and heartbeats for the fast path, `events()` the same run as wire-v1 messages,
`write_recording()` a `.jsonl` recording with its `<stem>.truth.json`.

Real-training conditions are scenario options too (`Scenario.step_time_s`, `traced`,
`comm_only`, `seq_imbalance`, `stage_imbalance`, `schedule`; the `straggler`,
`flapping_nic` and `rank_stall` fault families): production recordings have them, and the
detectors must hold under them.
"""

from producers.simulator.recording import read_truth, truth_path, write_recording
from producers.simulator.scenario import (
    FAMILIES,
    FAMILY_KIND,
    SEVERITIES,
    TRACED,
    Fault,
    GroundTruth,
    Layout,
    Noise,
    Scenario,
    layout_for_gpus,
)
from producers.simulator.simulator import ClusterSimulator

__all__ = [
    "FAMILIES",
    "FAMILY_KIND",
    "SEVERITIES",
    "TRACED",
    "ClusterSimulator",
    "Fault",
    "GroundTruth",
    "Layout",
    "Noise",
    "Scenario",
    "layout_for_gpus",
    "read_truth",
    "truth_path",
    "write_recording",
]
