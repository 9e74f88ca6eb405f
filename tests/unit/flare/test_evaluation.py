"""Scoring of one scenario: the first incident after the onset counts; repeats are counted."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest

from flare.evaluation import ScenarioResult, fault_scenarios, run_scenario, score, summarize_results
from producers.simulator import Fault, Scenario, layout_for_gpus
from producers.simulator.scenario import GroundTruth
from schemas.wire import IncidentV1, Suspect


def _inc(culprit: str, opened: int, status: str = "resolved") -> IncidentV1:
    return IncidentV1(
        v=1, id=f"{culprit}@{opened}", job="j", status=status,  # type: ignore[arg-type]
        kind="gpu", culprit=culprit,
        suspects=[Suspect(entity=culprit, confidence=1.0)], onset_step=opened,
        opened_step=opened, opened_ts_ns=opened, last_step=opened + 5, resolved_step=None,
        slowdown=1.5, lost_gpu_seconds=1.0, evidence_steps=3, summary="",
    )


def test_incidents_on_the_culprit_after_the_first_are_repeats_others_are_false():
    sc = Scenario(job="j", layout=layout_for_gpus(64), steps=40, seed=1,
                  fault=Fault("slow_gpu", 1.5, 20))
    truth = GroundTruth(job="j", family="slow_gpu", kind="gpu", culprit="rank:5",
                        onset_step=20, onset_ts_ns=None, severity=1.5, layout={}, gpus=64,
                        steps=40, seed=1, step_time_s=1.0)
    events = [_inc("rank:5", 22), _inc("rank:5", 30), _inc("rank:9", 31),
              _inc("rank:5", 36, "open")]
    r = score(sc, truth, events)
    assert r.top1 and r.kind_ok and r.latency_steps == 2
    assert r.repeats == 2 and r.false_device == 1
    once = score(sc, truth, [_inc("rank:5", 22)])
    assert once.repeats == 0 and once.false_device == 0


def test_a_single_node_layout_is_evaluated_on_the_faults_it_can_have():
    """`flare eval --gpus 8` used to stop on the first cross-node fault it could not build;
    one node has no NIC traffic, no pipeline link and no peer node or host."""
    families = {sc.fault.family for sc in fault_scenarios([8], 1) if sc.fault}
    assert families == {"slow_gpu", "thermal", "hang_rank", "comm_hang"}
    slow = next(sc for sc in fault_scenarios([8], 1)
                if sc.fault and sc.fault.family == "slow_gpu" and sc.fault.severity == 2.0)
    assert run_scenario(slow).top1


def test_conditions_parse_combine_and_say_what_is_wrong():
    import pytest

    from flare.eval_conditions import CONDITION_NAMES, parse_conditions

    assert [c.name for c in parse_conditions("all")] == list(CONDITION_NAMES)
    assert {"base", "step30", "tp0", "half", "node_dark", "comm_only", "seq", "stage"} <= set(
        CONDITION_NAMES
    )
    (both,) = parse_conditions("step30+tp0")
    assert both.name == "step30+tp0"
    assert dict(both.changes) == {"step_time_s": 30.0, "traced": "tp0"}
    assert [c.name for c in parse_conditions("base, base,tp0")] == ["base", "tp0"]
    with pytest.raises(ValueError, match="unknown condition 'tp9'"):
        parse_conditions("base,tp9")
    with pytest.raises(ValueError, match="both set traced"):
        parse_conditions("tp0+half")


def test_condition_scenarios_remake_the_whole_matrix_with_heartbeats_everywhere():
    from flare.eval_conditions import condition_scenarios, parse_conditions
    from flare.evaluation import DEFAULT_FAMILIES, clean_scenarios

    pairs = condition_scenarios(parse_conditions("base,comm_only,node_dark"), [8, 64], 1, 500)
    by = {}
    for c, sc in pairs:
        by.setdefault(c, []).append(sc)
    base, comm = by["base"], by["comm_only"]
    assert len(base) == len(comm) and all(sc.heartbeats for sc in base)
    assert all(sc.comm_only and sc.job.endswith("@comm_only") for sc in comm)
    assert [replace(sc, job="x", comm_only=False) for sc in comm] == [
        replace(sc, job="x") for sc in base
    ]  # the same runs, seeds included: conditions differ by the condition only
    fams = {sc.fault.family for sc in base if sc.fault}
    assert fams == set(DEFAULT_FAMILIES) | {"straggler", "flapping_nic", "rank_stall"}
    assert sum(sc.steps for sc in base if sc.fault is None) == sum(
        sc.steps for sc in clean_scenarios([8, 64], 500)
    )
    assert all(sc.layout.world >= 64 for sc in by["node_dark"])  # one node cannot go dark


def test_the_bursts_condition_remakes_the_flapping_nic_runs_only():
    from flare.eval_conditions import condition_scenarios, parse_conditions

    pairs = condition_scenarios(parse_conditions("base,bursts"), [16], 1, 500)
    base = [sc for c, sc in pairs if c == "base" and sc.fault
            and sc.fault.family == "flapping_nic"]  # fmt: skip
    bursts = [sc for c, sc in pairs if c == "bursts"]
    assert bursts and all(sc.partial_bursts for sc in bursts)
    assert [replace(sc, job="x", partial_bursts=False) for sc in bursts] == [
        replace(sc, job="x") for sc in base
    ]  # nothing else flaps: no other run, clean runs included, is made again


def test_the_oneway_condition_remakes_the_nic_runs_only():
    from flare.eval_conditions import condition_scenarios, parse_conditions

    pairs = condition_scenarios(parse_conditions("oneway"), [16], 1, 500)
    assert pairs and all(sc.oneway_nic and sc.fault is not None
                         and sc.fault.family in ("nic", "flapping_nic") for _, sc in pairs)
    assert {sc.fault.family for _, sc in pairs if sc.fault} == {"nic", "flapping_nic"}


def test_the_cpu_sends_condition_remakes_the_rank_fault_runs_only():
    from flare.eval_conditions import condition_scenarios, parse_conditions

    pairs = condition_scenarios(parse_conditions("cpu_sends"), [16], 1, 500)
    assert pairs and all(sc.cpu_transfers and sc.fault is not None for _, sc in pairs)
    assert {sc.fault.family for _, sc in pairs if sc.fault} == {
        "slow_gpu", "thermal", "straggler", "rank_stall"}


def _truth(culprit: str, traced: bool | None) -> GroundTruth:
    return GroundTruth(job="j", family="slow_gpu", kind="gpu", culprit=culprit, onset_step=20,
                       onset_ts_ns=None, severity=1.5, layout={}, gpus=64, steps=40, seed=1,
                       step_time_s=1.0, culprit_traced=traced)  # fmt: skip


def test_an_untraced_culprit_rank_is_found_when_its_rank_or_node_is_named():
    from flare.evaluation import accepted_culprits
    from producers.simulator import ClusterSimulator

    sc = Scenario(job="j", layout=layout_for_gpus(64), steps=40, seed=1, traced="tp0",
                  fault=Fault("slow_gpu", 1.5, 20, "rank:13"))  # fmt: skip
    sim = ClusterSimulator(sc)
    ok = accepted_culprits(sim)
    assert ok == [{"rank:13", "node:node-0001"}]
    node = _inc("node:node-0001", 22)
    r = score(sc, _truth("rank:13", False), [node, _inc("node:node-0001", 30)], ok)
    assert r.top1 and r.top3 and r.false_device == 0 and r.repeats == 1
    assert r.culprit_traced is False
    wrong = score(sc, _truth("rank:13", False), [_inc("node:node-0002", 22)], ok)
    assert not wrong.top1 and wrong.false_device == 1
    traced = replace(sc, fault=Fault("slow_gpu", 1.5, 20, "rank:8"))
    assert accepted_culprits(ClusterSimulator(traced)) == [{"rank:8"}]  # traced: the rank only
    assert not score(traced, _truth("rank:8", True), [_inc("node:node-0001", 22)]).top1


def test_condition_results_are_summarized_per_condition_and_a_crash_is_a_result(monkeypatch):
    from detectors.diagnoser import JobDiagnoser
    from flare.eval_conditions import condition_scenarios, parse_conditions
    from flare.evaluation import run_all, summarize_results

    pairs = condition_scenarios(parse_conditions("base,tp0"), [64], 1, 0, ["slow_gpu"])
    pairs = [(c, sc) for c, sc in pairs if sc.fault and sc.fault.severity == 2.0]
    results = run_all([sc for _, sc in pairs], jobs=1, conditions=[c for c, _ in pairs])
    assert [r.condition for r in results] == ["base", "tp0"]
    doc = summarize_results(results, [64], 1, ["base", "tp0"])
    assert set(doc["by_condition"]) == {"base", "tp0"}
    for part in doc["by_condition"].values():
        assert part["overall"]["scenarios"] == 1 and set(part["families"]) == {"slow_gpu"}
    assert doc["by_condition"]["base"]["overall"]["top1"] == 1.0

    def boom(self, frame):  # noqa: ANN001
        raise RuntimeError("detector bug")

    monkeypatch.setattr(JobDiagnoser, "on_frame", boom)
    (crashed,) = run_all([pairs[0][1]], jobs=1)
    assert crashed.error.startswith("RuntimeError: detector bug") and not crashed.top1
    assert summarize_results([crashed], [64], 1)["overall"]["errors"] == 1


def test_two_faults_score_either_culprit_first_and_whether_both_were_named():
    from flare.eval_conditions import condition_scenarios, parse_conditions

    pairs = condition_scenarios(parse_conditions("two_faults"), [64], 1, 500)
    assert pairs and all(sc.fault is not None for _, sc in pairs)  # no clean runs
    assert all(sc.fault2 == Fault("slow_gpu", 1.5, sc.fault.onset_step) for _, sc in pairs)
    sc = pairs[0][1]
    truth = replace(_truth("rank:5", None), second={"kind": "link", "culprit": "node:node-0003"})
    ok = [frozenset({"rank:5"}), frozenset({"node:node-0003"})]
    link = msgspec.structs.replace(_inc("node:node-0003", 21), kind="link")
    r = score(sc, truth, [link, _inc("rank:5", 23), _inc("rank:5", 30)], ok)
    assert r.top1 and r.kind_ok and r.found_all and r.two_faults
    assert r.repeats == 1 and r.false_device == 0
    only = score(sc, truth, [_inc("rank:5", 22)], ok)
    assert only.top1 and only.found_all is False


def test_the_1f1b_condition_runs_the_same_matrix_under_the_1f1b_schedule():
    from flare.eval_conditions import CONDITION_NAMES, condition_scenarios, parse_conditions

    assert "1f1b" in CONDITION_NAMES
    (one,) = parse_conditions("1f1b")
    assert dict(one.changes) == {"schedule": "1f1b"} and "1F1B" in one.help
    (both,) = parse_conditions("1f1b+comm_only")
    assert dict(both.changes) == {"schedule": "1f1b", "comm_only": True}
    pairs = condition_scenarios(parse_conditions("base,1f1b"), [64], 1, 500)
    base = [sc for c, sc in pairs if c == "base"]
    f1b = [sc for c, sc in pairs if c == "1f1b"]
    assert all(sc.schedule == "gpipe" for sc in base)
    assert all(sc.schedule == "1f1b" and sc.job.endswith("@1f1b") for sc in f1b)
    assert [replace(sc, job="x", schedule="gpipe") for sc in f1b] == [
        replace(sc, job="x") for sc in base
    ]  # clean runs included: the schedule is the only difference


def _result(family: str, kind: str, estimate: float | None = None,
            actual: float | None = None, job: float = 100.0) -> ScenarioResult:  # fmt: skip
    return ScenarioResult(f"{family}-{estimate}-{actual}", family, 64, 50, "rank:1", kind,
                          top1=True, cost_estimate=estimate, cost_actual=actual,
                          cost_job=job)  # fmt: skip


def test_cost_errors_are_summarized_per_family_and_a_hang_family_reads_n_a():
    from flare.commands.evaluate import _cells

    results = [
        _result("slow_gpu", "gpu", 12.0, 10.0),  # error 0.2
        _result("slow_gpu", "gpu", 6.0, 10.0),  # error 0.4
        _result("slow_gpu", "gpu", 6.0, 0.0),  # the fault cost nothing: counted apart
        _result("nic", "link", 30.0, 20.0, job=4000.0),  # error 0.5, but 0.5% of the job
        _result("hang_rank", "hang"),
        ScenarioResult("c", "clean", 64, 250, None, None),
    ]
    doc = summarize_results(results, [64], 1)
    gpu, hang = doc["families"]["slow_gpu"], doc["families"]["hang_rank"]
    assert gpu["cost_err_median"] == pytest.approx(0.3)
    assert (gpu["cost_runs"], gpu["cost_skipped"], gpu["cost_na"]) == (2, 1, False)
    assert hang["cost_na"] and hang["cost_runs"] == 0 and hang["cost_err_median"] is None
    assert doc["overall"]["cost_err_median"] == pytest.approx(0.4)
    assert doc["overall"]["cost_runs"] == 3 and not doc["overall"]["cost_na"]
    # the NIC's loss is under 1% of the job: out of the material figures, and its error
    # reads as a share of the job's GPU time instead (10 GPU-s of 4,000)
    assert doc["overall"]["cost_material_runs"] == 2
    assert doc["overall"]["cost_material_p90"] == pytest.approx(0.38)
    assert doc["overall"]["cost_small_share_p90"] == pytest.approx(10.0 / 4000.0)
    assert _cells(hang)[-4:] == ["n/a", "n/a", "n/a", "n/a"]
    assert _cells(gpu)[-4:] == ["0.300", "0.380", "0.380", "2"]
    assert _cells(doc["families"]["clean"])[-4:] == ["-", "-", "-", "0"]  # nothing to cost


def test_a_fault_run_is_scored_for_cost_against_the_same_run_without_its_fault():
    """End to end: the scored incident's own estimate, and a positive actual cost from the
    counterfactual run (its accuracy is the estimator's business, not this test's)."""
    sc = next(s for s in fault_scenarios([8], 1, ["slow_gpu"]) if s.fault.severity == 2.0)
    r = run_scenario(sc)
    assert r.top1 and r.first is not None
    assert r.cost_estimate == r.first["lost_gpu_seconds"]
    assert r.cost_actual is not None and r.cost_actual > 0
    hang = run_scenario(next(iter(fault_scenarios([8], 1, ["hang_rank"]))))
    assert hang.top1 and hang.cost_estimate is None and hang.cost_actual is None


def test_a_second_fault_is_drawn_only_where_a_node_is_left_for_it():
    """At 16 GPUs (two nodes) a slow pipeline link holds both nodes: the simulator found no
    place for the second fault and `flare eval --gpus 16 --conditions all` stopped there."""
    from flare.eval_conditions import condition_scenarios, parse_conditions
    from producers.simulator import ClusterSimulator

    pairs = condition_scenarios(parse_conditions("two_faults"), [16, 32], 1, 0)
    assert pairs and {sc.layout.n_nodes for _c, sc in pairs} == {4}
    for _c, sc in pairs:
        sim = ClusterSimulator(sc)  # draws where the second fault goes
        assert len(sim.plans) == 2


def test_a_network_fault_of_a_two_node_job_is_found_when_the_link_is_named():
    """Two nodes: every transfer across them goes through both NICs and the path between,
    so the link is the narrowest entity a NIC or switch fault can be named by; a slow node
    is not a network fault, and a larger job's NIC is its node only."""
    from flare.evaluation import accepted_culprits
    from producers.simulator import ClusterSimulator

    def accepted(gpus: int, family: str, target: str) -> list[frozenset[str]]:
        sc = Scenario(job="j", layout=layout_for_gpus(gpus), steps=30, seed=1,
                      fault=Fault(family, 3.0, 20, target))
        return accepted_culprits(ClusterSimulator(sc))

    link = "link:node-0000~node-0001"
    assert accepted(16, "nic", "node:node-0001") == [{"node:node-0001", link}]
    assert accepted(16, "switch", "switch:leaf-00") == [{"switch:leaf-00", link}]
    assert accepted(16, "slow_node", "node:node-0001") == [{"node:node-0001"}]
    assert accepted(32, "nic", "node:node-0001") == [{"node:node-0001"}]
