"""Scenarios, layouts and faults validate themselves, so a bad one fails at once with a
sentence."""

from __future__ import annotations

from dataclasses import replace

import pytest

from producers.simulator import ClusterSimulator, Fault, Layout, layout_for_gpus
from tests.unit.producers.simulator.support import scenario


def test_layout_presets_and_generic_powers_of_two():
    assert (layout_for_gpus(8).tp, layout_for_gpus(8).pp, layout_for_gpus(8).dp) == (2, 2, 2)
    assert (layout_for_gpus(64).tp, layout_for_gpus(64).pp, layout_for_gpus(64).dp) == (8, 2, 4)
    assert (layout_for_gpus(1024).pp, layout_for_gpus(1024).dp) == (8, 16)
    assert (layout_for_gpus(8192).pp, layout_for_gpus(8192).dp) == (8, 128)
    assert (layout_for_gpus(16384).pp, layout_for_gpus(16384).dp) == (16, 128)
    for k in range(3, 17):
        lay = layout_for_gpus(2**k)
        assert lay.world == 2**k
        assert lay.pp > 1 or 2**k < 32
    assert layout_for_gpus(256).n_switches == 2


@pytest.mark.parametrize("bad", [4, 100, 0, -8])
def test_layout_for_gpus_rejects_non_powers_of_two(bad):
    with pytest.raises(ValueError, match="power of two"):
        layout_for_gpus(bad)


def test_invalid_layout_fault_and_scenario_say_why():
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        Layout(tp=2, pp=2, dp=4, ep=3)
    with pytest.raises(ValueError, match="family"):
        Fault("melted", 1.5, 1)
    with pytest.raises(ValueError, match="onset_step"):
        scenario(steps=3, fault=Fault("slow_gpu", 1.5, 3))
    with pytest.raises(ValueError, match="2 leaf switches"):
        ClusterSimulator(scenario(layout=layout_for_gpus(8), fault=Fault("switch", 3.0, 1)))
    with pytest.raises(ValueError, match="not a node"):
        ClusterSimulator(scenario(fault=Fault("slow_node", 1.5, 1, "node:node-9999")))
    with pytest.raises(ValueError, match="outside the world"):
        ClusterSimulator(scenario(fault=Fault("slow_gpu", 1.5, 1, "rank:16")))


def test_cadence_fields_are_validated():
    with pytest.raises(ValueError, match="keepalive_s must be a finite number"):
        scenario(keepalive_s=-1.0)
    with pytest.raises(ValueError, match="long_op_s must be a finite number"):
        scenario(long_op_s=float("inf"))


@pytest.mark.parametrize(
    "field,value,message",
    [("traced", "tp1", "traced must be one of all, tp0, half, node_dark"),
     ("comm_only", 1, "comm_only must be True or False"),
     ("seq_imbalance", -0.1, r"seq_imbalance must be a number in \[0.0, 2.0\]"),
     ("seq_imbalance", float("nan"), "seq_imbalance must be a number"),
     ("stage_imbalance", 0.8, r"stage_imbalance must be a number in \[1.0, 10.0\]"),
     ("stage_imbalance", True, "stage_imbalance must be a number"),
     ("schedule", "interleaved", "schedule must be one of gpipe, 1f1b")],
)  # fmt: skip
def test_real_training_conditions_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        scenario(**{field: value})


def test_conditions_and_their_truth_fields_appear_only_when_set():
    plain = ClusterSimulator(scenario(fault=Fault("slow_gpu", 1.5, 1, "rank:3")))
    assert plain.scenario.conditions() == {}
    assert "conditions" not in plain.truth.to_dict()  # old truth files stay byte-identical
    assert "culprit_traced" not in plain.truth.to_dict()
    sc = scenario(traced="tp0", comm_only=True, stage_imbalance=1.3,
                  fault=Fault("slow_gpu", 1.5, 1, "rank:3"))  # fmt: skip
    assert sc.conditions() == {"traced": "tp0", "comm_only": True, "stage_imbalance": 1.3}
    truth = ClusterSimulator(sc).truth.to_dict()
    assert truth["conditions"] == sc.conditions()
    assert truth["culprit_traced"] is False  # rank 3 has tp coordinate 1
    assert replace(sc, schedule="1f1b").conditions()["schedule"] == "1f1b"


def test_a_single_node_cannot_go_dark():
    one_node = Layout(tp=2, pp=2, dp=2, gpus_per_node=8)
    with pytest.raises(ValueError, match="node_dark' needs at least 2 nodes"):
        ClusterSimulator(scenario(layout=one_node, traced="node_dark"))


def test_a_second_fault_needs_a_first_and_one_hang_at_most():
    with pytest.raises(ValueError, match="fault2 is a second fault: it needs Scenario.fault"):
        scenario(fault2=Fault("slow_gpu", 1.5, 1))
    with pytest.raises(ValueError, match="cannot both be hangs"):
        scenario(fault=Fault("hang_rank", 1.0, 1), fault2=Fault("comm_hang", 1.0, 1))
    with pytest.raises(ValueError, match="onset_step=4 must be below steps=4"):
        scenario(fault=Fault("slow_gpu", 1.5, 1), fault2=Fault("slow_gpu", 1.5, 4))


def test_without_faults_is_the_same_scenario_with_no_fault():
    sc = scenario(steps=30, fault=Fault("slow_gpu", 1.5, 10), fault2=Fault("nic", 3.0, 12),
                  traced="half", seq_imbalance=0.1)  # fmt: skip
    plain = sc.without_faults()
    assert plain.fault is None and plain.fault2 is None
    assert plain == replace(sc, fault=None, fault2=None)  # nothing else changes, the seed too
