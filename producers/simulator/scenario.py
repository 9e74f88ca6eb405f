"""What to simulate: the cluster layout, the fault, the clean noise, and the ground truth.

These are plain frozen dataclasses so a scenario is hashable, printable and easy to put in an
evaluation matrix; every constructor validates its fields, so a bad scenario fails at once with
a sentence instead of producing a silently wrong recording.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from producers.agent.cadence import KEEPALIVE_S, LONG_OP_S

FAMILIES: tuple[str, ...] = (
    "slow_gpu",
    "thermal",
    "slow_node",
    "host",
    "nic",
    "switch",
    "pp_link",
    "hang_rank",
    "comm_hang",
    "straggler",
    "flapping_nic",
    "rank_stall",
)

# Severity grids of the evaluation matrix. Compute faults are slowdown factors (Holmes found
# that below δ≈1.04 jitter dominates, hence 1.05 as the smallest slow GPU); link faults are
# bandwidth divisors (DESIGN §8: NIC/link ÷1.5–10); host is the step time lost in launch gaps
# (1.3 = the node's ranks lose 30% of a step); hangs have no severity (1.0). A straggler is
# a GPU so slow (5–20×) that its peers' waits outlast a hang timeout while it still makes
# progress; a flapping NIC needs a clear divisor (÷2–10) since its evidence comes and goes.
# A rank stall is one process idle between its ops while its GPU is healthy (a GC pause every
# step, a starved data loader): the step time that rank alone loses, as for a host.
SEVERITIES: dict[str, tuple[float, ...]] = {
    "slow_gpu": (1.05, 1.2, 1.5, 2.0),
    "thermal": (1.2, 1.5, 2.0),
    "slow_node": (1.1, 1.3, 1.5),
    "host": (1.1, 1.3, 1.5),
    "nic": (1.5, 3.0, 10.0),
    "switch": (1.5, 3.0, 6.0),
    "pp_link": (1.5, 3.0, 10.0),
    "hang_rank": (1.0,),
    "comm_hang": (1.0,),
    "straggler": (5.0, 10.0, 20.0),
    "flapping_nic": (2.0, 4.0, 10.0),
    "rank_stall": (1.1, 1.3, 1.5),
}

# Incident kind (DESIGN §3) that a correct diagnosis of each family reports.
FAMILY_KIND: dict[str, str] = {
    "slow_gpu": "gpu",
    "thermal": "gpu",
    "slow_node": "node",
    "host": "host",
    "nic": "link",
    "switch": "switch",
    "pp_link": "link",
    "hang_rank": "hang",
    "comm_hang": "hang",
    "straggler": "gpu",
    "flapping_nic": "link",
    "rank_stall": "host",
}

# Which ranks report (`Scenario.traced`): every rank; one rank per TP group (tp coordinate 0,
# what production tracers often record); a seeded random half; every rank but those of one
# seeded node (its agent is down).
TRACED: tuple[str, ...] = ("all", "tp0", "half", "node_dark")

# Pipeline schedules (`Scenario.schedule`, `producers.simulator.engine`): GPipe (all forwards,
# then all backwards, dp communication after them) or Megatron's 1F1B with the dp gradient
# reduce_scatter overlapped with the last microbatch's backward.
Schedule = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b")

# Presets (tp, pp, dp): TP inside a node (8 GPUs), PP across nodes, DP the rest.
_PRESETS: dict[int, tuple[int, int, int]] = {
    8: (2, 2, 2),
    16: (4, 2, 2),
    32: (4, 2, 4),
    64: (8, 2, 4),
    128: (8, 2, 8),
    256: (8, 4, 8),
    512: (8, 4, 16),
    1024: (8, 8, 16),
    2048: (8, 8, 32),
    4096: (8, 8, 64),
    8192: (8, 8, 128),
    16384: (8, 16, 128),
}


def _positive_int(owner: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Layout:
    """3-D parallel layout; world = tp*pp*dp; ep (MoE all_to_all groups) divides dp."""

    tp: int
    pp: int
    dp: int
    ep: int = 1
    gpus_per_node: int = 8
    nodes_per_switch: int = 16

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "ep", "gpus_per_node", "nodes_per_switch"):
            _positive_int("Layout", name, getattr(self, name))
        if self.dp % self.ep:
            raise ValueError(f"Layout.ep={self.ep} must divide dp={self.dp}")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def n_nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)

    @property
    def n_switches(self) -> int:
        return -(-self.n_nodes // self.nodes_per_switch)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def layout_for_gpus(gpus: int, ep: int = 1) -> Layout:
    """The preset layout of a cluster of `gpus` GPUs (a power of two ≥ 8).

    Small clusters get fewer nodes per leaf switch (half the nodes, at most 16) so that they
    still have two switches and a switch fault can be simulated on them.
    """
    if not isinstance(gpus, int) or gpus < 8 or gpus & (gpus - 1):
        raise ValueError(f"gpus must be a power of two >= 8, got {gpus!r}")
    if gpus in _PRESETS:
        tp, pp, dp = _PRESETS[gpus]
    else:  # beyond the presets: TP8 inside a node, PP16, the rest DP
        tp, pp = 8, 16
        dp = gpus // (tp * pp)
    nodes = gpus // 8
    nodes_per_switch = 16 if nodes >= 32 else max(1, nodes // 2)
    return Layout(tp=tp, pp=pp, dp=dp, ep=ep, gpus_per_node=8, nodes_per_switch=nodes_per_switch)


@dataclass(frozen=True)
class Fault:
    """One injected fault, active from `onset_step` on (target None: drawn from the seed)."""

    family: str
    severity: float
    onset_step: int
    target: str | None = None

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"Fault.family {self.family!r} is not one of {', '.join(FAMILIES)}")
        if not isinstance(self.severity, int | float) or not math.isfinite(self.severity):
            raise ValueError(f"Fault.severity must be a finite number, got {self.severity!r}")
        if self.severity < 1.0:
            raise ValueError(f"Fault.severity must be >= 1.0 (a slowdown), got {self.severity}")
        if not isinstance(self.onset_step, int) or self.onset_step < 0:
            raise ValueError(f"Fault.onset_step must be an integer >= 0, got {self.onset_step!r}")

    @property
    def kind(self) -> str:
        return FAMILY_KIND[self.family]


@dataclass(frozen=True)
class Noise:
    """Clean noise that must NOT become device incidents; all on by default (0 turns one off)."""

    jitter: float = 0.01
    data_jitter: float = 0.02
    net_jitter: float = 0.03
    gc_every: int = 40
    rank_gc_prob: float = 0.02
    checkpoint_every: int = 100
    eval_every: int = 0
    level_shift_step: int | None = None
    level_shift: float = 1.15
    moe_imbalance: float = 0.3
    clock_skew_ms: float = 20.0

    def __post_init__(self) -> None:
        for name in ("jitter", "data_jitter", "net_jitter", "moe_imbalance", "clock_skew_ms"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Noise.{name} must be a finite number >= 0, got {v!r}")
        for name in ("gc_every", "checkpoint_every", "eval_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"Noise.{name} must be an integer >= 0 (0: off), got {v!r}")
        if not 0.0 <= self.rank_gc_prob <= 1.0:
            raise ValueError(f"Noise.rank_gc_prob must be in [0, 1], got {self.rank_gc_prob!r}")
        if self.level_shift <= 0:
            raise ValueError(f"Noise.level_shift must be > 0, got {self.level_shift!r}")

    @classmethod
    def quiet(cls) -> Noise:
        """No noise at all: every rank identical, no pauses (for calibration and unit tests)."""
        return cls(
            jitter=0.0, data_jitter=0.0, net_jitter=0.0, gc_every=0, rank_gc_prob=0.0,
            checkpoint_every=0, eval_every=0, level_shift_step=None, level_shift=1.0,
            moe_imbalance=0.0, clock_skew_ms=0.0,
        )  # fmt: skip


@dataclass(frozen=True)
class Scenario:
    """One simulated job: layout, length, seed, optional fault and the clean noise.

    `heartbeats` turns the heartbeat stream on; `keepalive_s` and `long_op_s` are its
    cadence, the node agent's policy (`producers.agent.cadence`, defaults included): a rank's
    1 Hz sample is published on its first sample, when its long op (in flight >= `long_op_s`)
    changes, and at least every `keepalive_s` (keepalive_s <= 1 s: every sample, the old 1 Hz
    stream). Unlike the agent's flags these are not bounded by the hang timeout, so that
    evaluations may study other cadences.

    Real-training conditions (DESIGN §4.8; the defaults are the kind simulator of old, and
    leave its output byte for byte unchanged):
    - `step_time_s`: the healthy step (real LLM steps last 0.5–60 s). Compute and bandwidth
      scale with it; launch gaps, link latencies, clock skew, GC and checkpoint pauses and
      the 1 Hz heartbeat sampling stay absolute, as on real hardware.
    - `traced` (one of `TRACED`): only these ranks' steps and heartbeats are emitted; the
      ground truth stays the true culprit, traced or not.
    - `comm_only`: no compute ops in any message or frame (collective and p2p logging only);
      the rank's step window stays what its step marker says.
    - `seq_imbalance`: sequence-length imbalance, the σ of a per-step lognormal (mean 1)
      multiplier of each DP replica's compute, drawn anew every step, with a seeded eighth
      of the replicas (at least one) persistently heavier by 1 + σ·U(0.5, 1).
    - `stage_imbalance`: the last pipeline stage computes this many times longer by design
      (1.2–1.6 in real models: the LM head and the loss); included in the calibration, so
      the healthy step still lasts `step_time_s`.
    - `schedule` (one of `SCHEDULES`): the pipeline schedule. "1f1b" interleaves forwards
      and backwards (a stage holds at most P - s microbatches in flight) and runs the dp
      reduce_scatter in buckets on a stream of its own during the last backward, so a
      rank's ops overlap in time.
    - `partial_bursts`: a flapping NIC's bursts start anywhere in a step and run 0.5-1.5
      steps across its end, at a period of the NIC's own (4-9 steps, not a whole number),
      as drills on real training show; by default each burst is one or two whole steps.
    - `oneway_nic`: a NIC fault (steady or flapping) slows only what its node sends, as a
      rate limit on its egress or a failing transmit lane does: a collective's copies on
      its node end as if it were healthy (their data came in on time), the other members'
      when the slow data reaches them, and a pipeline transfer is slow only from it. By
      default every copy of an instance through it ends at once, late.
    - `cpu_transfers`: a rank fault (slow GPU, thermal, straggler, rank stall) slows the
      rank's cross-node transfers too, by its severity: the rank's own process drives them
      (gloo on its CPU, NCCL's proxy thread), as drills on real training show (a rank held
      to a tenth of a core sent ×9 slower through a NIC its node partner used at full
      speed). By default a rank fault leaves every transfer alone.
    None of these is a fault: they must not become device incidents. `fault2` is a second,
    simultaneous fault in a different group (no node, TP or DP group shared with `fault`;
    drawn from its own seed when it has no target); at most one of the two is a hang.
    """

    job: str
    layout: Layout
    steps: int
    seed: int
    fault: Fault | None = None
    noise: Noise = field(default_factory=Noise)
    step_time_s: float = 2.0
    microbatches: int = 4
    chunks: int = 2
    heartbeats: bool = True
    keepalive_s: float = KEEPALIVE_S
    long_op_s: float = LONG_OP_S
    traced: str = "all"
    comm_only: bool = False
    seq_imbalance: float = 0.0
    stage_imbalance: float = 1.0
    fault2: Fault | None = None
    schedule: Schedule = "gpipe"
    partial_bursts: bool = False
    oneway_nic: bool = False
    cpu_transfers: bool = False
    # true time 0 of the job on the nodes' clocks; None: a fixed epoch, so a recording is
    # the same file every time. A live run (`flare up`) starts now, so its steps and
    # incidents are where a "last hour" dashboard looks.
    epoch_ns: int | None = None

    def __post_init__(self) -> None:
        self._check_conditions()
        if not isinstance(self.job, str) or not 1 <= len(self.job) <= 256:
            raise ValueError(f"Scenario.job must be a non-empty string, got {self.job!r}")
        for name in ("keepalive_s", "long_op_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Scenario.{name} must be a finite number >= 0, got {v!r}")
        for name in ("steps", "microbatches", "chunks"):
            _positive_int("Scenario", name, getattr(self, name))
        if self.epoch_ns is not None and (not isinstance(self.epoch_ns, int)
                                          or self.epoch_ns < 0):
            raise ValueError(f"Scenario.epoch_ns must be an integer >= 0, got {self.epoch_ns!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"Scenario.seed must be an integer >= 0, got {self.seed!r}")
        if not (self.step_time_s > 0 and math.isfinite(self.step_time_s)):
            raise ValueError(f"Scenario.step_time_s must be > 0, got {self.step_time_s!r}")
        for f in (self.fault, self.fault2):
            if f is not None and f.onset_step >= self.steps:
                raise ValueError(
                    f"Fault.onset_step={f.onset_step} must be below steps={self.steps}"
                )
        if self.fault2 is not None:
            if self.fault is None:
                raise ValueError("Scenario.fault2 is a second fault: it needs Scenario.fault")
            if FAMILY_KIND[self.fault.family] == FAMILY_KIND[self.fault2.family] == "hang":
                raise ValueError("Scenario.fault and fault2 cannot both be hangs")

    def without_faults(self) -> Scenario:
        """The same job with no fault: same seed, so the same noise, clocks and workload
        draw for draw (each comes from its own child of the seed, none from the faults').
        What it lacks against this run is what the faults cost (issue #12)."""
        return replace(self, fault=None, fault2=None)

    def _check_conditions(self) -> None:
        if self.traced not in TRACED:
            raise ValueError(f"Scenario.traced must be one of {', '.join(TRACED)}, "
                             f"got {self.traced!r}")  # fmt: skip
        for name in ("comm_only", "partial_bursts", "oneway_nic", "cpu_transfers"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Scenario.{name} must be True or False, "
                                 f"got {getattr(self, name)!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Scenario.schedule must be one of {', '.join(SCHEDULES)}, "
                             f"got {self.schedule!r}")  # fmt: skip
        for name, lo, hi in (("seq_imbalance", 0.0, 2.0), ("stage_imbalance", 1.0, 10.0)):
            v = getattr(self, name)
            ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
            if not ok or not lo <= v <= hi:
                raise ValueError(f"Scenario.{name} must be a number in [{lo}, {hi}], got {v!r}")

    def conditions(self) -> dict[str, Any]:
        """The real-training conditions that differ from the defaults (step time apart)."""
        out: dict[str, Any] = {}
        for name, default in (("traced", "all"), ("comm_only", False), ("seq_imbalance", 0.0),
                              ("stage_imbalance", 1.0), ("fault2", None),
                              ("schedule", "gpipe"), ("partial_bursts", False),
                              ("oneway_nic", False), ("cpu_transfers", False)):  # fmt: skip
            if getattr(self, name) != default:
                out[name] = getattr(self, name)
        if self.fault2 is not None:
            out["fault2"] = asdict(self.fault2)
        return out


@dataclass(frozen=True)
class GroundTruth:
    """What a perfect diagnosis says; written next to a recording as <stem>.truth.json.

    `onset_ts_ns` is on the reference clock (no node skew): the earliest start of the onset
    step over all ranks, or for a hang the moment the rank / collective stopped.
    `conditions` (the scenario's non-default real-training conditions), `culprit_traced`
    (whether any rank of a rank or node culprit reports, with a partial `traced`) and `second`
    (the same fields of `Scenario.fault2`: family, kind, culprit, onset_step, onset_ts_ns,
    severity, culprit_traced) are written only when set, so that recordings of the default
    conditions keep their old truth file.
    """

    job: str
    family: str | None
    kind: str | None
    culprit: str | None
    onset_step: int | None
    onset_ts_ns: int | None
    severity: float | None
    layout: dict
    gpus: int
    steps: int
    seed: int
    step_time_s: float
    conditions: dict[str, Any] | None = None
    culprit_traced: bool | None = None
    second: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for name in ("conditions", "culprit_traced", "second"):
            if d[name] is None:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroundTruth:
        try:
            return cls(**data)
        except TypeError as exc:
            raise ValueError(f"not a ground truth document: {exc}") from None
