"""`flare eval`: a matrix of simulated faults and clean runs, scored against ground truth.

Every fault family × severity × layout (× seeds) plus clean runs with the noise that must
not become incidents (GC, checkpoints, eval steps, level shifts, MoE imbalance, clock skew).
Scenarios run the simulator's frames straight into `JobDiagnoser.on_frame` (the same code the
worker runs after assembly; a test shows the two paths agree) in a process pool.

Real-training conditions (`flare.eval_conditions`, `flare eval --conditions`) remake this
matrix under one named condition at a time; results carry their condition.

Scoring: the first device incident opened at or after the onset is the diagnosis; top-1 when
it names the true culprit. When the culprit is a rank that is not traced, top-1 (and top-3)
also accept its node: no data came from the rank, and its node is the narrowest entity the
traced peers can point at. Everything else (kind, false incidents, repeats) is scored the
same whatever is traced, with the rank and its node both counting as the culprit.

Cost: the scored incident's `lost_gpu_seconds`, when it names the true culprit, is checked
against the same scenario simulated without its fault (`flare.eval_cost`).
"""

from __future__ import annotations

import statistics
import traceback
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from detectors.config import DetectorConfig
from detectors.diagnoser import JobDiagnoser
from flare.eval_cost import (
    HANG_KIND,
    check_cost,
    cost_metrics,
    cost_scored,
    counterfactual_step_times,
    job_step_time,
)
from producers.simulator import (
    FAMILIES,
    SEVERITIES,
    Fault,
    Layout,
    Noise,
    Scenario,
    layout_for_gpus,
)
from schemas.frame import StepFrame
from schemas.wire import IncidentV1

HANG_FAMILIES = ("hang_rank", "comm_hang")
# The matrix of `flare eval` without --conditions, as it was before the real-training
# families; with --conditions every family of FAMILIES runs.
DEFAULT_FAMILIES: tuple[str, ...] = (
    "slow_gpu", "thermal", "slow_node", "host", "nic", "switch", "pp_link", "hang_rank",
    "comm_hang",
)  # fmt: skip
FAULT_STEPS_AFTER_ONSET = 30
CLEAN_STEPS_TOTAL = 10_000


@dataclass(slots=True)
class ScenarioResult:
    name: str
    family: str  # fault family or "clean"
    gpus: int
    steps: int
    truth_culprit: str | None
    truth_kind: str | None
    detected: bool = False
    top1: bool = False
    top3: bool = False
    kind_ok: bool = False
    latency_steps: float | None = None
    latency_s: float | None = None
    false_device: int = 0  # device incidents not matching the truth (or any, in clean runs)
    repeats: int = 0  # incidents on the true culprit after the first: one fault, several pages
    condition: str = ""  # the real-training condition of the run ("" without --conditions)
    culprit_traced: bool | None = None  # None: every rank traced, or not a rank/node culprit
    error: str | None = None  # the exception that ended the run early (scored up to there)
    found_all: bool | None = None  # two faults: an incident named each culprit
    two_faults: bool = False
    first: dict | None = None  # the scored incident
    incidents: list[dict] = field(default_factory=list)
    # what the scored incident says it cost, and what the fault cost against the same run
    # without it (GPU-seconds over the incident's evidence steps); None: not scored
    # (flare.eval_cost)
    cost_estimate: float | None = None
    cost_actual: float | None = None
    cost_job: float | None = None  # the job's GPU time over those steps without the fault


def _seed(*parts: object) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode()) & 0x7FFFFFFF


def fault_scenarios(
    gpus: Iterable[int],
    seeds: int,
    families: Iterable[str] = DEFAULT_FAMILIES,
    all_heartbeats: bool = False,
) -> list[Scenario]:
    """Every family × severity × layout × seed; heartbeats in hang runs (all_heartbeats: in
    every run, which is how a false hang shows)."""
    families = list(families)
    out = []
    for g in gpus:
        layout = layout_for_gpus(g)
        for family in FAMILIES:
            if family not in families:
                continue
            if not _can_happen(family, layout):
                continue
            for sev in SEVERITIES[family]:
                for s in range(seeds):
                    seed = _seed(family, sev, g, s)
                    onset = 20 + seed % 11
                    out.append(
                        Scenario(
                            job=f"{family}-x{sev}-{g}g-s{s}",
                            layout=layout,
                            steps=onset + FAULT_STEPS_AFTER_ONSET,
                            seed=seed,
                            fault=Fault(family=family, severity=sev, onset_step=onset),
                            heartbeats=all_heartbeats or family in HANG_FAMILIES,
                        )
                    )
    return out


def clean_scenarios(
    gpus: Iterable[int], total_steps: int = CLEAN_STEPS_TOTAL, all_heartbeats: bool = False
) -> list[Scenario]:
    """Clean runs whose steps add up to `total_steps`, spread over the layouts and noises."""
    gpus = list(gpus)
    variants: list[tuple[str, Callable[[Layout], tuple[Layout, Noise]]]] = [
        ("noise", lambda lay: (lay, Noise())),
        ("shift", lambda lay: (lay, Noise(level_shift_step=60))),
        ("evalsteps", lambda lay: (lay, Noise(eval_every=25, checkpoint_every=50))),
        ("moe", lambda lay: (replace(lay, ep=min(8, lay.dp)), Noise(moe_imbalance=0.4))),
        ("skew", lambda lay: (lay, Noise(clock_skew_ms=50.0, data_jitter=0.03))),
    ]
    per_run = 250
    # clean steps per layout ∝ 1/gpus (a large step costs proportionally more to simulate
    # and diagnose), at least one run per layout; the total reaches `total_steps`
    weights = [1.0 / g for g in gpus]
    runs_per = [max(1, round(total_steps / per_run * w / sum(weights))) for w in weights]
    out: list[Scenario] = []

    def clean(name: str, g: int, k: int) -> Scenario:
        vname, make = variants[k % len(variants)]
        layout, noise = make(layout_for_gpus(g))
        return Scenario(
            job=f"clean-{vname}-{g}g-{name}{k}",
            layout=layout,
            steps=per_run,
            seed=_seed("clean", k, g) if name == "r" else _seed("clean", name, k, g),
            noise=noise,
            heartbeats=all_heartbeats,
        )

    for g, n_runs in zip(gpus, runs_per, strict=True):
        out += [clean("r", g, k) for k in range(n_runs)]
    k = 0
    while sum(sc.steps for sc in out) < total_steps:  # rounding: top up on the smallest
        out.append(clean("extra", min(gpus), k))
        k += 1
    return out


def _nodes(layout: Layout) -> int:
    return -(-(layout.tp * layout.pp * layout.dp) // layout.gpus_per_node)


def _can_happen(family: str, layout: Layout) -> bool:
    """Whether the family's fault exists on the layout, and is a device fault there: a
    switch fault needs two leaf switches; on a single node there is no cross-node traffic,
    and a slow or starved node is the whole job (a job-wide shift, not a culprit)."""
    if family == "switch":
        return _nodes(layout) > layout.nodes_per_switch
    if family in ("slow_node", "host", "nic", "pp_link"):
        return _nodes(layout) >= 2
    return True


def accepted_culprits(sim: Any) -> list[frozenset[str]]:
    """Per true culprit (the truth's, then a second fault's): the entities that count as it,
    the culprit itself and the narrowest entity the data can support when that is not it:
    for a rank that is not traced, its node; for a NIC or switch of a job of two nodes, the
    link between them (every transfer across nodes goes through both NICs, both switches
    and the path between)."""
    truth = sim.truth
    topo = sim.topology
    only_link = topo.link_entity(0, 1) if len(topo.node_names) == 2 else None
    culprits = [(truth.culprit, truth.culprit_traced)]
    if truth.second:
        culprits.append((truth.second["culprit"], truth.second["culprit_traced"]))
    out = []
    for culprit, traced in culprits:
        if culprit is None:
            continue
        names = {culprit}
        if traced is False and culprit.startswith("rank:"):
            node = int(topo.node_of[int(culprit[5:])])
            names.add(topo.node_entity(node))
        if only_link and culprit.startswith(("switch:", "node:")) and truth.kind in (
                "link", "switch"):
            names.add(only_link)
        out.append(frozenset(names))
    return out


def run_scenario(sc: Scenario, config: DetectorConfig | None = None) -> ScenarioResult:
    """Simulate one scenario into a fresh diagnoser and score what it reported."""
    from producers.simulator import ClusterSimulator

    sim = ClusterSimulator(sc)
    diag = JobDiagnoser(sc.job, config)
    events: list[IncidentV1] = []
    times: dict[int, float] = {}
    error = None
    try:
        events += diag.on_job(sim.job_start()).incidents
        for item in sim.run():
            if isinstance(item, StepFrame):
                times[item.step] = job_step_time(item)
                events += diag.on_frame(item).incidents
            else:
                events += diag.on_heartbeat(item).incidents
        events += diag.flush().incidents
    except Exception as exc:  # a crash is a result of the run, not the end of the evaluation
        where = traceback.extract_tb(exc.__traceback__)[-1]
        error = f"{type(exc).__name__}: {exc} ({where.filename}:{where.lineno})"
    res = score(sc, sim.truth, events, accepted_culprits(sim))
    res.error = error
    _score_cost(res, sc, events, times)
    return res


def _score_cost(
    res: ScenarioResult, sc: Scenario, events: list[IncidentV1], times: dict[int, float]
) -> None:
    """Fill in the scored incident's cost against the run without the fault. Run here, in
    the worker that ran the fault, so the extra simulation spreads over `--jobs` too."""
    if res.first is None or not cost_scored(res.truth_kind, res.two_faults, res.top1):
        return
    check = check_cost(events, res.first["id"], times, counterfactual_step_times(sc), res.gpus)
    if check is not None:
        res.cost_estimate, res.cost_actual = check.estimate, check.actual
        res.cost_job = check.job


def score(
    sc: Scenario,
    truth,  # noqa: ANN001
    events: list[IncidentV1],
    accept: list[frozenset[str]] | None = None,
) -> ScenarioResult:
    """Score the incidents of one run; `accept`: per true culprit, the entities that count
    as it (default: the truth's culprit alone). With two culprits (a second fault), top-1
    and top-3 accept either, the kind is the named one's, repeats are the incidents beyond
    one per culprit, and `found_all` says whether both were named."""
    final: dict[str, IncidentV1] = {}
    for ev in events:
        final[ev.id] = ev
    incs = sorted(final.values(), key=lambda i: (i.opened_step, i.opened_ts_ns))
    device = [i for i in incs if i.kind != "job"]
    res = ScenarioResult(
        name=sc.job,
        family=truth.family or "clean",
        gpus=sc.layout.tp * sc.layout.pp * sc.layout.dp,
        steps=sc.steps,
        truth_culprit=truth.culprit,
        truth_kind=truth.kind,
        incidents=[_brief(i) for i in incs],
        culprit_traced=getattr(truth, "culprit_traced", None),
        two_faults=bool(getattr(truth, "second", None)),
    )
    if truth.family is None:
        res.false_device = len(device)
        return res
    groups = accept or [frozenset((truth.culprit,))]
    ok = frozenset().union(*groups)
    kinds = [truth.kind] + ([truth.second["kind"]] if getattr(truth, "second", None) else [])
    onset = truth.onset_step if truth.onset_step is not None else 0
    after = [i for i in device if i.opened_step >= onset]
    res.false_device = sum(1 for i in device if i.opened_step < onset or i.culprit not in ok)
    if not after:
        return res
    first = after[0]
    on_culprit = [sum(1 for i in after if i.culprit in g) for g in groups]
    if len(groups) == 1:
        res.repeats = on_culprit[0] - (first.culprit in ok)
    else:
        res.repeats = sum(max(0, n - 1) for n in on_culprit)
        res.found_all = all(n > 0 for n in on_culprit)
    res.first = _brief(first)
    res.detected = True
    res.top1 = first.culprit in ok
    ranked = [first.culprit] + [s.entity for s in first.suspects if s.entity != first.culprit]
    res.top3 = any(e in ok for e in ranked[:3])
    named = next((k for g, k in zip(groups, kinds, strict=False) if first.culprit in g), kinds[0])
    res.kind_ok = first.kind == named
    res.latency_steps = float(first.opened_step - onset)
    if truth.onset_ts_ns is not None:
        res.latency_s = (first.opened_ts_ns - truth.onset_ts_ns) / 1e9
    return res


def _brief(i: IncidentV1) -> dict:
    return {
        "id": i.id,
        "kind": i.kind,
        "culprit": i.culprit,
        "opened_step": i.opened_step,
        "onset_step": i.onset_step,
        "status": i.status,
        "slowdown": i.slowdown,
        "summary": i.summary,
        "lost_gpu_seconds": i.lost_gpu_seconds,
        "suspects": [(s.entity, s.confidence) for s in i.suspects],
    }


def run_all(
    scenarios: list[Scenario],
    jobs: int = 2,
    progress: Callable[[ScenarioResult], None] | None = None,
    conditions: list[str] | None = None,
) -> list[ScenarioResult]:
    """Run and score every scenario (in order); `conditions[i]` labels result i."""
    results = []
    names = conditions or [""] * len(scenarios)
    if jobs <= 1:
        outcomes: Iterable[ScenarioResult] = map(run_scenario, scenarios)
        for r, name in zip(outcomes, names, strict=True):
            r.condition = name
            results.append(r)
            if progress:
                progress(r)
        return results
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        for r, name in zip(pool.map(run_scenario, scenarios), names, strict=True):
            r.condition = name
            results.append(r)
            if progress:
                progress(r)
    return results


def _metrics(rs: list[ScenarioResult]) -> dict:
    faults = [r for r in rs if r.truth_culprit is not None]
    clean = [r for r in rs if r.truth_culprit is None]
    n = len(faults)
    lat = [r.latency_steps for r in faults if r.top1 and r.latency_steps is not None]
    lat_s = [r.latency_s for r in faults if r.top1 and r.latency_s is not None]
    clean_steps = sum(r.steps for r in clean)
    two = [r for r in faults if r.two_faults]
    return {
        "scenarios": len(rs),
        "top1": sum(r.top1 for r in faults) / n if n else None,
        "top3": sum(r.top3 for r in faults) / n if n else None,
        "kind": sum(r.kind_ok for r in faults) / n if n else None,
        "false_per_10k_clean_steps": (
            sum(r.false_device for r in clean) / clean_steps * 10_000 if clean_steps else None
        ),
        "latency_steps_median": statistics.median(lat) if lat else None,
        "latency_s_median": statistics.median(lat_s) if lat_s else None,
        "detected": sum(r.detected for r in faults) / n if n else None,
        "repeats_per_fault_run": sum(r.repeats for r in faults) / n if n else None,
        "clean_steps": clean_steps,
        "false_device_in_fault_runs": sum(r.false_device for r in faults),
        "errors": sum(r.error is not None for r in rs),
        "found_all": (sum(bool(r.found_all) for r in two) / len(two) if two else None),
        **_cost(faults),
    }


def _cost(faults: list[ScenarioResult]) -> dict[str, object]:
    """The cost columns of some fault runs: those with a cost check, and n/a for hangs."""
    checks = [(r.cost_estimate, r.cost_actual, r.cost_job or 0.0) for r in faults
              if r.cost_estimate is not None and r.cost_actual is not None]  # fmt: skip
    hangs_only = bool(faults) and all(r.truth_kind == HANG_KIND for r in faults)
    return cost_metrics(checks, hangs_only)


def _by_family(results: list[ScenarioResult]) -> dict[str, dict]:
    fams: dict[str, list[ScenarioResult]] = {}
    for r in results:
        fams.setdefault(r.family, []).append(r)
    return {f: _metrics(rs) for f, rs in sorted(fams.items())}


def summarize_results(
    results: list[ScenarioResult],
    gpus: list[int],
    seeds: int,
    conditions: list[str] | None = None,
) -> dict:
    """The `--json` document: overall and per-family metrics (rates are fractions 0–1);
    with `conditions`, also `by_condition` → {condition → {overall, families}}."""
    clean = [r for r in results if r.family == "clean"]
    overall = _metrics(results)
    doc: dict[str, Any] = {
        "overall": overall,
        "families": _by_family(results),
        "by_gpus": {str(g): _metrics([r for r in results if r.gpus == g]) for g in gpus},
        "gpus": gpus,
        "seeds": seeds,
        "clean_steps": sum(r.steps for r in clean),
        "misses": [asdict(r) for r in results if r.truth_culprit is not None and not r.top1][:50],
        "false_alarms": [asdict(r) for r in results if r.truth_culprit is None and r.false_device][
            :50
        ],
    }
    doc["errors"] = [{"name": r.name, "error": r.error} for r in results if r.error][:50]
    if conditions:
        doc["conditions"] = conditions
        doc["by_condition"] = {}
        for c in conditions:
            mine = [r for r in results if r.condition == c]
            doc["by_condition"][c] = {
                "overall": _metrics(mine),
                "families": _by_family(mine),
                "misses": [asdict(r) for r in mine if r.truth_culprit and not r.top1][:20],
                "false_alarms": [asdict(r) for r in mine if not r.truth_culprit and r.false_device][
                    :20
                ],
            }
    return doc
