"""The real-training conditions of `flare eval --conditions`: named remakes of the matrix.

The kind simulator scores 100%; production recordings do not look like it (issue #11). Each
condition remakes the whole matrix (every fault family, the straggler and the flapping NIC
included, and the clean runs) under one real-training condition: long or short steps,
partial tracing, communication-only logging, workload imbalance, a second simultaneous
fault, the 1F1B pipeline schedule (a rank's ops overlap). Heartbeats are on in every run, so
that false hangs show. Conditions combine with "+" (`step30+tp0`). A condition run keeps the
seed of its base run (same fault target, same noise), so conditions differ by the condition
only; under 1F1B a step has more op slots (one reduce_scatter per bucket), so its noise
comes from the same seed but not draw for draw.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from flare.evaluation import clean_scenarios, fault_scenarios
from producers.simulator import FAMILIES, Fault, Scenario
from producers.simulator.faults import RANK_FAMILIES


@dataclass(frozen=True)
class Condition:
    """A named transformation of the matrix: scenario fields to set in every run.

    `fault2` is given as (family, severity): a second fault at the first one's onset, in a
    different group (the simulator draws where); such a condition has no clean runs.
    """

    name: str
    help: str
    changes: tuple[tuple[str, Any], ...] = ()

    def apply(self, sc: Scenario) -> Scenario:
        changes = dict(self.changes)
        second = changes.pop("fault2", None)
        if second is not None and sc.fault is not None:
            changes["fault2"] = Fault(second[0], second[1], sc.fault.onset_step)
        return replace(sc, job=f"{sc.job}@{self.name}", **changes)

    def applies_to(self, sc: Scenario) -> bool:
        """A node cannot go dark on a one-node job (nobody would be left to report). A second
        fault needs a first one, and a node the first does not touch: a pipeline link holds
        two nodes, so a two-node job has none left (`flare eval --gpus 16` stopped there)."""
        changes = dict(self.changes)
        if changes.get("traced") == "node_dark" and sc.layout.n_nodes < 2:
            return False
        if changes.get("partial_bursts") and (sc.fault is None
                                              or sc.fault.family != "flapping_nic"):
            return False  # nothing else flaps: the other runs would be the base's again
        if changes.get("oneway_nic") and (sc.fault is None
                                          or sc.fault.family not in ("nic", "flapping_nic")):
            return False  # no other fault has a NIC to be slow one way
        if changes.get("cpu_transfers") and (sc.fault is None
                                             or sc.fault.family not in RANK_FAMILIES):
            return False  # no other fault slows one rank's process
        return "fault2" not in changes or (sc.fault is not None and sc.layout.n_nodes >= 3)


# Values in the ranges real jobs show (issue #11): steps of 0.5-60 s, a last stage 1.2-1.6×,
# sequence-length imbalance of tens of % between replicas.
CONDITIONS: tuple[Condition, ...] = (
    Condition("base", "the kind simulator: ~2 s steps, every rank traced, compute logged"),
    Condition("step05", "0.5 s steps", (("step_time_s", 0.5),)),
    Condition("step30", "30 s steps", (("step_time_s", 30.0),)),
    Condition("step60", "60 s steps", (("step_time_s", 60.0),)),
    Condition("tp0", "one rank per TP group traced (tp 0)", (("traced", "tp0"),)),
    Condition("half", "a seeded random half of the ranks traced", (("traced", "half"),)),
    Condition("node_dark", "one seeded node's agent down", (("traced", "node_dark"),)),
    Condition("comm_only", "no compute ops logged, only coll and p2p", (("comm_only", True),)),
    Condition(
        "seq", "sequence-length imbalance σ=0.2 between DP replicas", (("seq_imbalance", 0.2),)
    ),  # fmt: skip
    Condition("stage", "last pipeline stage 1.4× by design", (("stage_imbalance", 1.4),)),
    Condition(
        "two_faults",
        "a second fault at the same onset in another group: a slow GPU ×1.5",
        (("fault2", ("slow_gpu", 1.5)),),
    ),  # fmt: skip
    Condition(
        "1f1b",
        "1F1B pipeline schedule (forwards and backwards interleaved); the DP gradient "
        "reduce_scatter runs in buckets overlapped with the last backward",
        (("schedule", "1f1b"),),
    ),  # fmt: skip
    Condition(
        "bursts",
        "a flapping NIC's bursts start anywhere in a step and run 0.5-1.5 steps across its "
        "end, at a period of its own (drills); flapping NIC runs only",
        (("partial_bursts", True),),
    ),  # fmt: skip
    Condition(
        "oneway",
        "a NIC slow only sending (drills: a rate limit on its egress): its own copies end on "
        "time, its partners' late; NIC and flapping NIC runs only",
        (("oneway_nic", True),),
    ),  # fmt: skip
    Condition(
        "cpu_sends",
        "a slow or stalled rank's cross-node transfers slow with it, by its severity (its "
        "process drives them: gloo, NCCL's proxy; drills); rank fault runs only",
        (("cpu_transfers", True),),
    ),  # fmt: skip
)
CONDITION_NAMES = tuple(c.name for c in CONDITIONS)


def parse_conditions(text: str) -> list[Condition]:
    """'base,step30,tp0+comm_only' (or 'all') → conditions; '+' combines two into one."""
    by_name = {c.name: c for c in CONDITIONS}
    out: list[Condition] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item == "all":
            out += [c for c in CONDITIONS if c not in out]
            continue
        parts = [p.strip() for p in item.split("+")]
        unknown = [p for p in parts if p not in by_name]
        if unknown:
            raise ValueError(f"unknown condition {unknown[0]!r}; known: all, "
                             f"{', '.join(CONDITION_NAMES)} (combine with +)")  # fmt: skip
        changes: dict[str, Any] = {}
        for part in parts:
            for key, value in by_name[part].changes:
                if key in changes:
                    raise ValueError(f"conditions in {item!r} both set {key}: pick one")
                changes[key] = value
        cond = (
            by_name[item]
            if len(parts) == 1
            else Condition(
                item, " and ".join(by_name[p].help for p in parts), tuple(changes.items())
            )
        )
        if cond.name not in {c.name for c in out}:
            out.append(cond)
    if not out:
        raise ValueError("--conditions needs at least one condition")
    return out


def condition_scenarios(
    conditions: Iterable[Condition],
    gpus: Iterable[int],
    seeds: int,
    clean_steps: int,
    families: Iterable[str] = FAMILIES,
) -> list[tuple[str, Scenario]]:
    """(condition, scenario) of the matrix under each condition: every fault family (the
    straggler and the flapping NIC included), the clean runs, heartbeats in every run."""
    gpus, families = list(gpus), list(families)
    base = fault_scenarios(gpus, seeds, families, all_heartbeats=True)
    if clean_steps:
        base += clean_scenarios(gpus, clean_steps, all_heartbeats=True)
    return [(c.name, c.apply(sc)) for c in conditions for sc in base if c.applies_to(sc)]
