"""Resolve a `Fault` against a topology: who is hit, how, from when, and the ground truth.

The plan is the only place that knows fault semantics; the engine just applies the factors it
hands out (compute × factor per rank, transfer × factor per instance, extra launch gaps, a
stop). Fault randomness (thermal episodes, host delays, where a rank hangs) comes from its own
random stream so a faulty run shares every noise draw with the clean run of the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from producers.simulator.scenario import Fault
from producers.simulator.topology import G_PP_NEXT, Topology

COMPUTE_FAMILIES = ("slow_gpu", "thermal", "slow_node", "straggler")
LINK_FAMILIES = ("nic", "switch", "pp_link", "flapping_nic")
HANG_FAMILIES = ("hang_rank", "comm_hang")
# one rank's process slowed or stalled: what `cpu_transfers` stretches the transfers of
RANK_FAMILIES = ("slow_gpu", "thermal", "straggler", "rank_stall")


@dataclass
class FaultPlan:
    """A fault bound to concrete ranks / instances, with its ground-truth entity."""

    fault: Fault
    kind: str
    culprit: str
    ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # per group kind, per stage: which instances get transfer × severity (link families)
    link_hit: dict[int, list[np.ndarray]] | None = None
    # (steps + 1,) bool: when an intermittent fault (thermal episodes, a flapping NIC) is on
    schedule: np.ndarray | None = None
    # (steps + 1, 2): the part of each step's ops a burst covers, [from, to) as fractions of
    # the step (a flapping NIC's bursts start anywhere in a step and run across its end)
    window: np.ndarray | None = None
    hang_rank: int | None = None
    hang_at: float = 0.0  # where in its step the rank stops, as a fraction of its ops
    comm_group: tuple[int, int] | None = None  # (stage, tp index) of the hung dp group

    @property
    def family(self) -> str:
        return self.fault.family

    def active(self, step: int) -> bool:
        if step < self.fault.onset_step:
            return False
        if self.schedule is not None:
            return bool(self.schedule[min(step, len(self.schedule) - 1)])
        return True

    def covered(self, step: int) -> tuple[float, float]:
        """The part of `step` the fault is on, [from, to) as fractions of its ops: (0, 1)
        for a whole step."""
        if self.window is None:
            return (0.0, 1.0)
        lo, hi = self.window[min(step, len(self.window) - 1)]
        return (float(lo), float(hi))

    def compute_factor(self, step: int, world: int) -> np.ndarray | None:
        """(world,) compute multiplier of this step, None when the fault leaves compute alone."""
        if self.family not in COMPUTE_FAMILIES or not self.active(step):
            return None
        f = np.ones(world)
        f[self.ranks] = self.fault.severity
        return f


def _parse_int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"fault target {text!r} is not a {what}") from None


def _strip(target: str, prefix: str) -> str:
    return target[len(prefix) :] if target.startswith(prefix) else target


def _resolve_rank(topo: Topology, target: str | None, rng: np.random.Generator) -> int:
    if target is None:
        return int(rng.integers(topo.world))
    r = _parse_int(_strip(target, "rank:"), "rank (rank:<n>)")
    if not 0 <= r < topo.world:
        raise ValueError(f"fault target rank {r} is outside the world of {topo.world} ranks")
    return r


def _resolve_node(topo: Topology, target: str | None, rng: np.random.Generator) -> int:
    if target is None:
        return int(rng.integers(topo.n_nodes))
    name = _strip(target, "node:")
    if name in topo.node_names:
        return topo.node_names.index(name)
    raise ValueError(
        f"fault target {target!r} is not a node of this job "
        f"({topo.node_names[0]} … {topo.node_names[-1]})"
    )


def _resolve_switch(topo: Topology, target: str | None, rng: np.random.Generator) -> int:
    if topo.n_switches < 2:
        raise ValueError(
            "a switch fault needs at least 2 leaf switches; this layout has "
            f"{topo.n_nodes} node(s) and {topo.n_switches} switch"
        )
    if target is None:
        return int(rng.integers(topo.n_switches))
    name = _strip(target, "switch:")
    if name in topo.switch_names:
        return topo.switch_names.index(name)
    raise ValueError(f"fault target {target!r} is not a switch of this job")


def _resolve_link(topo: Topology, target: str | None, rng: np.random.Generator) -> tuple[int, int]:
    pairs = topo.p2p_node_pairs()
    if not pairs:
        raise ValueError("a pp_link fault needs pipeline p2p between different nodes (pp > 1)")
    if target is None:
        _, a, b, _ = pairs[int(rng.integers(len(pairs)))]
        return a, b
    ends = _strip(target, "link:").split("~")
    if len(ends) != 2 or not all(e in topo.node_names for e in ends):
        raise ValueError(f"fault target {target!r} is not link:<node>~<node> of this job")
    a, b = sorted(topo.node_names.index(e) for e in ends)
    if not any(p[1] == a and p[2] == b for p in pairs):
        raise ValueError(f"no pipeline p2p runs between {ends[0]} and {ends[1]}")
    return a, b


def _resolve_dp_group(
    topo: Topology, target: str | None, rng: np.random.Generator
) -> tuple[int, int]:
    lay = topo.layout
    if lay.dp < 2:
        raise ValueError("a comm_hang fault needs dp > 1 (it hangs a dp collective)")
    if target is None:
        return int(rng.integers(lay.pp)), int(rng.integers(lay.tp))
    name = _strip(target, "group:")
    if name in topo.group_index and name.startswith("dp."):
        s, t = name[3:].split("-")
        return int(s), int(t)
    raise ValueError(f"fault target {target!r} is not a dp group (group:dp.<pp>-<tp>)")


def _thermal_schedule(onset: int, steps: int, rng: np.random.Generator) -> np.ndarray:
    """On/off episodes of 6–12 steps each, "on" first at onset (throttling comes and goes)."""
    on = np.zeros(steps + 1, dtype=bool)
    i, state = onset, True
    while i < steps + 1:
        n = int(rng.integers(6, 13))
        on[i : i + n] = state
        i += n
        state = not state
    return on


def _flapping_schedule(onset: int, steps: int, rng: np.random.Generator) -> np.ndarray:
    """On for `on` steps, off for `off` steps, and so on from the onset: a NIC whose link
    renegotiates or flaps, so its evidence comes and goes at a steady period. `on` is seeded
    in 1–2 and `off` in 3–7: drills on real training (a tbf limit toggled every 2 s, 0.3 s
    steps) showed bursts of one or two steps in seven, where this simulator used to give an
    even on/off of 2–5 steps, which the rule for persistent faults (3 of 5) already finds."""
    on = int(rng.integers(1, 3))
    off = int(rng.integers(3, 8))
    k = np.arange(steps + 1) - onset
    return (k >= 0) & (k % (on + off) < on)


def _flapping_windows(onset: int, steps: int, rng: np.random.Generator) -> np.ndarray:
    """(steps + 1, 2): the part of each step a flapping NIC's bursts cover, [from, to) as
    fractions of the step. A NIC whose link renegotiates or flaps has a steady period of
    its own, so its evidence comes and goes: one burst every `period` steps (seeded in
    4–9, not a whole number: the NIC keeps its own time, not the job's), each `length`
    steps long (0.5–1.5), the first starting at a seeded point of the onset step. Drills on
    real training (a tbf limit toggled every 2 s, 0.3 s steps) showed bursts over one or two
    steps in seven, each starting anywhere in a step and running across its end into the
    next, and hitting whatever was in flight then. The default bursts
    (`_flapping_schedule`) are one or two whole steps, kinder than real ones.

    >>> w = _flapping_windows(2, 14, np.random.default_rng(2))
    >>> [s for s in range(15) if w[s, 1] > w[s, 0]]  # a burst every 5.3 steps
    [2, 3, 8, 13, 14]
    >>> [w[s].round(2).tolist() for s in (2, 3, 8)]  # the next burst falls elsewhere
    [[0.81, 1.0], [0.0, 0.61], [0.12, 0.92]]
    """
    period = float(rng.uniform(4.0, 9.0))
    length = float(rng.uniform(0.5, 1.5))
    phase = float(rng.uniform(0.0, 1.0))
    out = np.zeros((steps + 1, 2))
    start = onset + phase
    while start < steps + 1:
        end = start + length
        for step in range(int(start), min(int(np.ceil(end)), steps + 1)):
            out[step] = (max(start - step, 0.0), min(end - step, 1.0))
        start += period
    return out


def plan_fault(
    fault: Fault,
    topo: Topology,
    steps: int,
    target_rng: np.random.Generator,
    fault_rng: np.random.Generator,
    partial_bursts: bool = False,
    cpu_transfers: bool = False,
) -> FaultPlan:
    """Bind `fault` to this topology (clear ValueError when it cannot happen on it);
    `partial_bursts`: a flapping NIC's bursts cover parts of steps (`_flapping_windows`);
    `cpu_transfers`: a slow or stalled rank's cross-node transfers slow with it (its
    process drives them), by the fault's severity."""
    fam = fault.family
    if fam in RANK_FAMILIES:
        r = _resolve_rank(topo, fault.target, target_rng)
        plan = FaultPlan(fault, fault.kind, topo.rank_entity(r), ranks=np.array([r]))
        if fam == "thermal":
            plan.schedule = _thermal_schedule(fault.onset_step, steps, fault_rng)
        if cpu_transfers:
            hit = np.zeros(topo.world, dtype=bool)
            hit[r] = True
            plan.link_hit = topo.instances_of_ranks(hit)
        return plan
    if fam in ("slow_node", "host", "nic", "flapping_nic"):
        node = _resolve_node(topo, fault.target, target_rng)
        ranks = np.flatnonzero(topo.node_of == node)
        plan = FaultPlan(fault, fault.kind, topo.node_entity(node), ranks=ranks)
        if fam in ("nic", "flapping_nic"):
            if topo.n_nodes < 2:
                raise ValueError(f"a {fam} fault needs at least 2 nodes (cross-node traffic)")
            hit = np.zeros(topo.n_nodes, dtype=bool)
            hit[node] = True
            plan.link_hit = topo.instances_touching(hit)
        if fam == "flapping_nic" and partial_bursts:
            plan.window = _flapping_windows(fault.onset_step, steps, fault_rng)
            plan.schedule = plan.window[:, 1] > plan.window[:, 0]
        elif fam == "flapping_nic":
            plan.schedule = _flapping_schedule(fault.onset_step, steps, fault_rng)
        return plan
    if fam == "switch":
        w = _resolve_switch(topo, fault.target, target_rng)
        hit = topo.switch_of_node == w
        plan = FaultPlan(fault, fault.kind, topo.switch_entity(w))
        plan.link_hit = topo.instances_touching(hit)
        return plan
    if fam == "pp_link":
        a, b = _resolve_link(topo, fault.target, target_rng)
        plan = FaultPlan(fault, fault.kind, topo.link_entity(a, b))
        plan.link_hit = {G_PP_NEXT: topo.link_mask(a, b)}
        return plan
    if fam == "hang_rank":
        r = _resolve_rank(topo, fault.target, target_rng)
        plan = FaultPlan(fault, fault.kind, topo.rank_entity(r), ranks=np.array([r]))
        plan.hang_rank = r
        plan.hang_at = float(fault_rng.uniform(0.05, 0.95))
        return plan
    s, t = _resolve_dp_group(topo, fault.target, target_rng)
    plan = FaultPlan(fault, fault.kind, f"group:{topo.dp_group_name(s, t)}")
    plan.comm_group = (s, t)
    return plan


def fault_nodes(plan: FaultPlan, topo: Topology) -> set[int]:
    """The nodes a fault acts on (for a switch: all under it; a dp hang: its members')."""
    if plan.ranks.size:
        return set(topo.node_of[plan.ranks].tolist())
    kind, _, name = plan.culprit.partition(":")
    if kind == "switch":
        w = topo.switch_names.index(name)
        return set(np.flatnonzero(topo.switch_of_node == w).tolist())
    if kind == "link":
        return {topo.node_names.index(n) for n in name.split("~")}
    s, t = plan.comm_group  # type: ignore[misc]
    lay = topo.layout
    members = s * topo.stage_size + np.arange(lay.dp) * lay.tp + t
    return set(topo.node_of[members].tolist())


def _collide(a: FaultPlan, b: FaultPlan, topo: Topology) -> bool:
    """Whether two faults share a node, or (two single-rank faults) a DP group."""
    if fault_nodes(a, topo) & fault_nodes(b, topo):
        return True
    if a.ranks.size == 1 and b.ranks.size == 1:
        ra, rb = int(a.ranks[0]), int(b.ranks[0])
        same_dp = (topo.pp_of[ra], topo.tp_of[ra]) == (topo.pp_of[rb], topo.tp_of[rb])
        return bool(same_dp)
    return False


def plan_second_fault(
    fault: Fault,
    first: FaultPlan,
    topo: Topology,
    steps: int,
    target_rng: np.random.Generator,
    fault_rng: np.random.Generator,
    tries: int = 1000,
    cpu_transfers: bool = False,
) -> FaultPlan:
    """Bind a second, simultaneous fault in a different group than `first` (no node shared,
    nor a DP group when both hit one rank): without a target, drawn until it is
    (`cpu_transfers` as for `plan_fault`)."""
    for _ in range(tries if fault.target is None else 1):
        plan = plan_fault(fault, topo, steps, target_rng, fault_rng,
                          cpu_transfers=cpu_transfers)
        if not _collide(first, plan, topo):
            return plan
    raise ValueError(
        f"the second fault ({plan.culprit}) must not share a node or DP group with the first "
        f"({first.culprit})"
    )
