"""ClusterSimulator: a scenario run step by step, as frames, rank messages and heartbeats.

Each call to `run()` or `events()` replays the run from its seed, so both are deterministic
and describe the same ops. Output is in stream-time order (the true time a message would be
produced): a merge buffer holds what was generated and releases everything older than the
earliest rank clock, since no later step can produce anything before that.

Heartbeats follow the node agent's cadence (`producers.agent.cadence`, in its vectorized
form `GridCadence`): each rank is sampled at 1 Hz, but a sample is published only on the
rank's first sample, when its long op (in flight >= `Scenario.long_op_s`) appears, changes or
ends, and on every K-th sample of its grid (K = keepalive_s / 1 s); the per-rank state of that
rule is carried from step to step.

The engine always simulates every rank; what is emitted is what a production tracer would
see: only the `Scenario.traced` ranks' steps and heartbeats, without compute ops when
`comm_only`. After a hang, heartbeats keep coming for max(40 s, 6 step times), long enough for
a hang timeout of a few of the job's own step times to fire, then the job is gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np

from producers.agent.cadence import INTERVAL_S, GridCadence
from producers.simulator.conditions import Workload, stage_factor, traced_mask
from producers.simulator.costs import CostModel, transfer_times
from producers.simulator.emit import (
    Clocks,
    HeartbeatBatch,
    build_frame,
    heartbeat_batch,
    heartbeat_structs,
    heartbeat_values,
    rank_steps,
    steps_value,
)
from producers.simulator.engine import SeqCounters, StepEngine, StepInputs, StepRecord
from producers.simulator.faults import HANG_FAMILIES, FaultPlan, plan_fault, plan_second_fault
from producers.simulator.merge import Merger
from producers.simulator.noise import NoiseDraw, NoiseSource
from producers.simulator.scenario import GroundTruth, Scenario
from producers.simulator.topology import Topology
from schemas import topics
from schemas.clock import NS_PER_S
from schemas.frame import StepFrame
from schemas.rankstep import RankStep
from schemas.wire import HeartbeatV1, JobV1, NodeInfo
from schemas.wire import Layout as WireLayout

EPOCH_NS = 1_790_000_000 * 10**9  # true time 0 of every simulated job
HEARTBEAT_PERIOD_NS = INTERVAL_S * NS_PER_S  # each rank is sampled as the agent samples it
HANG_TAIL_NS = 40e9  # heartbeats keep coming at least this long after a hang, then stop
HANG_TAIL_STEPS = 6  # ... and at least this many step times (a timeout of 3 steps sees it)
MAX_STEPS_AFTER_HANG = 4  # ranks that can still run finish at most this many steps


@dataclass
class _Step:
    rec: StepRecord
    frame: StepFrame | None
    ends: np.ndarray | None  # true t_end of the frame's ranks
    heartbeats: HeartbeatBatch | None
    watermark: float


class ClusterSimulator:
    """A simulated job. Construction is cheap-ish: it calibrates one quiet step."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.topology = topo = Topology(scenario.layout)
        self.costs = costs = CostModel()
        # children 0-4 as they always were; the conditions' streams come after them, so a
        # condition changes no other draw of the run. The faults draw only from their own
        # (target, fault, host delays), so `Scenario.without_faults()` replays the same noise,
        # clocks and workload: the counterfactual that prices a fault (issue #12)
        seeds = np.random.SeedSequence(scenario.seed).spawn(9)
        self._noise_seed, fault_seed, target_seed, clock_seed, self._host_seed = seeds[:5]
        traced_seed, self._workload_seed, target2_seed, fault2_seed = seeds[5:]
        # (world,) bool of the ranks that report, None: all of them
        self.traced = traced_mask(scenario.traced, topo, np.random.default_rng(traced_seed))
        self.hang_tail_ns = max(HANG_TAIL_NS, HANG_TAIL_STEPS * scenario.step_time_s * 1e9)
        self.engine = StepEngine(
            topo, scenario.microbatches, scenario.chunks, costs, scenario.schedule
        )
        self._transfers = transfer_times(topo, costs)
        self.engine.scale = self._calibrate()
        crng = np.random.default_rng(clock_seed)
        skew = crng.uniform(-1.0, 1.0, topo.n_nodes) * scenario.noise.clock_skew_ms * 1e6
        self.epoch_ns = EPOCH_NS if scenario.epoch_ns is None else scenario.epoch_ns
        self.clocks = Clocks(self.epoch_ns, np.rint(skew).astype(np.int64))
        self._phase = crng.uniform(0.0, HEARTBEAT_PERIOD_NS, topo.world)
        self.plan: FaultPlan | None = None  # the fault of the ground truth
        self.plans: list[FaultPlan] = []  # and the second, simultaneous one, if any
        if scenario.fault is not None:
            self.plan = plan_fault(
                scenario.fault, topo, scenario.steps,
                np.random.default_rng(target_seed), np.random.default_rng(fault_seed),
                partial_bursts=scenario.partial_bursts, cpu_transfers=scenario.cpu_transfers,
            )  # fmt: skip
            self.plans.append(self.plan)
        if scenario.fault2 is not None and self.plan is not None:
            self.plans.append(plan_second_fault(
                scenario.fault2, self.plan, topo, scenario.steps,
                np.random.default_rng(target2_seed), np.random.default_rng(fault2_seed),
                cpu_transfers=scenario.cpu_transfers,
            ))  # fmt: skip
        self._xfer = self._transfers.total(self.engine.scale)
        # per link fault (and rank fault under `cpu_transfers`), its transfer multiplier of
        # every instance (kind → per stage)
        self._stretch: list[dict[int, list[np.ndarray]] | None] = [
            None if p.link_hit is None else {
                k: [np.where(hit, p.fault.severity, 1.0) for hit in hits]
                for k, hits in p.link_hit.items()
            }
            for p in self.plans
        ]  # fmt: skip
        self._onset_ts_ns: list[int | None] = [None] * len(self.plans)

    # ------------------------------------------------------------- calibration
    def _calibrate(self) -> float:
        """Scale so that one quiet training step lasts `step_time_s` (gaps stay absolute)."""
        topo, eng = self.topology, self.engine
        K = [eng.n_ops(s, True, False) for s in range(topo.layout.pp)]
        S, W = topo.stage_size, topo.world
        gap = 0.5 * (self.costs.gap_lo_s + self.costs.gap_hi_s) * 1e9
        ones = [np.ones((k, S)) for k in K]
        stage = stage_factor(self.scenario, topo)  # an imbalance by design is healthy
        inp = StepInputs(
            train=True, checkpoint_ns=0.0, gaps=[np.full((k, S), gap) for k in K], jit=ones,
            net=ones, main=np.ones(W) if stage is None else stage, dev=np.ones(W), moe=None,
            xfer=self._transfers.total(1.0),
        )  # fmt: skip
        eng.scale = 1.0
        clock = np.zeros(W)
        eng.run(0, clock, SeqCounters.fresh(topo.layout.pp), inp)
        return self.scenario.step_time_s * 1e9 / float(clock.max())

    # -------------------------------------------------------------- the steps
    def _inputs(
        self,
        step: int,
        train: bool,
        nd: NoiseDraw,
        K: list[int],
        host_rng: np.random.Generator,
        workload: np.ndarray | None = None,
    ) -> StepInputs:
        """Noise, workload imbalance and the faults' effect on this step."""
        topo = self.topology
        S, W = topo.stage_size, topo.world
        level = nd.level
        main = nd.data * level
        if workload is not None:
            main = main * workload
        dev = np.full(W, level)
        xfer = self._xfer
        stop = hang_dp = burst = oneway = None
        for plan, stretch in zip(self.plans, self._stretch, strict=True):
            if not plan.active(step):
                continue
            cf = plan.compute_factor(step, W)
            if cf is not None:
                main = main * cf
                dev = dev * cf
            fam = plan.family
            if stretch is not None:
                stretched = dict(xfer)
                for k, mult in stretch.items():
                    stretched[k] = [x * m for x, m in zip(xfer[k], mult, strict=True)]
                lo, hi = plan.covered(step)
                if (lo, hi) == (0.0, 1.0):
                    xfer = stretched
                else:  # a burst over part of the step: those of its ops, by their slots
                    burst = (stretched, [(int(lo * k), int(np.ceil(hi * k))) for k in K])
                if self.scenario.oneway_nic and fam in ("nic", "flapping_nic"):
                    sender = np.zeros(W, dtype=bool)
                    sender[plan.ranks] = True
                    oneway = (sender, self._xfer)
            if fam == "rank_stall":
                # one lump per step (a GC pause, a late batch) before a random op of the rank
                lost = (plan.fault.severity - 1.0) * self.scenario.step_time_s * 1e9
                r = int(plan.ranks[0])
                s = r // S
                nd.gaps[s][int(host_rng.integers(K[s])), r % S] += lost * host_rng.uniform(
                    0.8, 1.2)
            elif fam == "host":
                # exponential launch delays; mean such that the node's ranks lose about
                # (severity - 1) of a step in gaps, while compute durations stay normal
                lost = (plan.fault.severity - 1.0) * self.scenario.step_time_s * 1e9
                for s in sorted(set((plan.ranks // S).tolist())):
                    cols = plan.ranks[plan.ranks // S == s] % S
                    nd.gaps[s][:, cols] += host_rng.exponential(lost / K[s], (K[s], cols.size))
            elif fam == "hang_rank" and step == plan.fault.onset_step:
                r = int(plan.hang_rank)  # type: ignore[arg-type]
                s = r // S
                col = min(max(1, int(plan.hang_at * K[s])), K[s] - 1)
                stop = (s, col, r % S)
            elif fam == "comm_hang" and step == plan.fault.onset_step:
                hang_dp = plan.comm_group
        return StepInputs(
            train=train, checkpoint_ns=nd.checkpoint_ns, gaps=nd.gaps,
            jit=nd.jit, net=nd.net, main=main, dev=dev, moe=nd.moe, xfer=xfer, stop=stop,
            hang_dp=hang_dp, burst=burst, oneway=oneway,
        )  # fmt: skip

    def _records(self) -> Iterator[StepRecord]:
        """Engine-only run: one StepRecord per step (fresh random streams every call)."""
        sc, topo, eng = self.scenario, self.topology, self.engine
        noise = NoiseSource(sc.noise, topo, self.costs, np.random.default_rng(self._noise_seed))
        host_rng = np.random.default_rng(self._host_seed)
        workload = Workload(sc, topo, np.random.default_rng(self._workload_seed))
        clock = np.zeros(topo.world)
        ctr = SeqCounters.fresh(topo.layout.pp)
        last = sc.steps - 1
        for plan in self.plans:
            if plan.family in HANG_FAMILIES:
                # ranks that can still run keep going past the last step until they block too
                last = max(last, plan.fault.onset_step + MAX_STEPS_AFTER_HANG)
        step = 0
        while step <= last:
            train = noise.is_train(step)
            K = [eng.n_ops(s, train, noise.has_checkpoint(step)) for s in range(topo.layout.pp)]
            nd = noise.draw(step, K)
            inp = self._inputs(step, train, nd, K, host_rng, workload.factor())
            rec = eng.run(step, clock, ctr, inp)
            for i, plan in enumerate(self.plans):
                if step == plan.fault.onset_step:
                    hang = plan.family in HANG_FAMILIES and rec.hang_ns is not None
                    t = rec.hang_ns if hang else float(np.min(rec.t_start))
                    self._onset_ts_ns[i] = self.epoch_ns + int(round(t))  # type: ignore[arg-type]
            yield rec
            if not np.isfinite(clock).any():
                return
            step += 1

    def _steps(self, heartbeats: bool) -> Iterator[_Step]:
        stop = np.inf
        sc, topo = self.scenario, self.topology
        cadence = GridCadence.fresh(
            topo.world, HEARTBEAT_PERIOD_NS, sc.keepalive_s * 1e9, sc.long_op_s * 1e9
        )
        for rec in self._records():
            if rec.hang_ns is not None:
                stop = rec.hang_ns + self.hang_tail_ns
            built = build_frame(topo, rec, sc.job, self.clocks, self.traced, sc.comm_only)
            frame, ends = built if built is not None else (None, None)
            hb = None
            if heartbeats:
                hb = heartbeat_batch(topo, rec, self._phase, HEARTBEAT_PERIOD_NS, stop, cadence)
                if hb is not None and self.traced is not None:
                    hb = hb.of_ranks(self.traced)
            live = rec.t_end[np.isfinite(rec.t_end)]
            wm = float(live.min()) if live.size else np.inf
            yield _Step(rec, frame, ends, hb, min(wm, stop))

    def _want_heartbeats(self) -> bool:
        return self.scenario.heartbeats or any(p.family in HANG_FAMILIES for p in self.plans)

    # ------------------------------------------------------------ public API
    @property
    def truth(self) -> GroundTruth:
        sc, plan = self.scenario, self.plan
        if self.plans and None in self._onset_ts_ns:
            onset = max(p.fault.onset_step for p in self.plans)
            for rec in self._records():  # run the engine up to the onsets to time them
                if rec.step >= onset:
                    break
        return GroundTruth(
            job=sc.job,
            family=plan.family if plan else None,
            kind=plan.kind if plan else None,
            culprit=plan.culprit if plan else None,
            onset_step=plan.fault.onset_step if plan else None,
            onset_ts_ns=self._onset_ts_ns[0] if plan else None,
            severity=float(plan.fault.severity) if plan else None,
            layout=sc.layout.to_dict(),
            gpus=sc.layout.world,
            steps=sc.steps,
            seed=sc.seed,
            step_time_s=sc.step_time_s,
            conditions=sc.conditions() or None,
            culprit_traced=self._culprit_traced(plan),
            second=self._second_truth(),
        )

    def _second_truth(self) -> dict | None:
        if len(self.plans) < 2:
            return None
        p = self.plans[1]
        return {"family": p.family, "kind": p.kind, "culprit": p.culprit,
                "onset_step": p.fault.onset_step, "onset_ts_ns": self._onset_ts_ns[1],
                "severity": float(p.fault.severity),
                "culprit_traced": self._culprit_traced(p)}  # fmt: skip

    def _culprit_traced(self, plan: FaultPlan | None) -> bool | None:
        """Whether a rank of the culprit reports (a rank or node culprit, partial tracing)."""
        if plan is None or self.traced is None or plan.ranks.size == 0:
            return None
        if not plan.culprit.startswith(("rank:", "node:")):
            return None
        return bool(self.traced[plan.ranks].any())

    def job_start(self) -> JobV1:
        lay = self.scenario.layout
        return JobV1(
            v=1, job=self.scenario.job, event="start", ts_ns=self.epoch_ns, world_size=lay.world,
            layout=WireLayout(tp=lay.tp, pp=lay.pp, dp=lay.dp, ep=lay.ep),
            nodes=[NodeInfo(**n) for n in self.topology.nodes_table()],
        )  # fmt: skip

    def run(self) -> Iterator[StepFrame | HeartbeatV1]:
        """Frames (at the true time their last rank reports) and heartbeats, in time order."""
        job, topo, clocks = self.scenario.job, self.topology, self.clocks
        merger = Merger()
        for st in self._steps(self._want_heartbeats()):
            if st.frame is not None and st.ends is not None:
                merger.add(np.array([st.ends.max()]), [st.frame])
            if st.heartbeats is not None:
                merger.add(st.heartbeats.t, heartbeat_structs(st.heartbeats, job, topo, clocks))
            for _, items, i in merger.release(st.watermark):
                yield items[i]  # type: ignore[index]
        for _, items, i in merger.release(np.inf):
            yield items[i]  # type: ignore[index]

    def rank_steps(self, frame: StepFrame) -> list[RankStep]:
        """The same step as per-rank `flare.steps.v1` messages (decoded form)."""
        return rank_steps(frame)

    def events(self) -> Iterator[tuple[str, str, dict, int]]:
        """(topic, key, wire-v1 value, true ts_ns): job start, steps and heartbeats, job end.

        The `end` event is stamped 1 ms after the latest node-clock time of anything emitted
        (a step's t_end_ns, a heartbeat's ts_ns) and after the latest true time: node clocks
        are skewed, so an end stamped from true time alone could precede some messages.
        """
        job, topo, clocks = self.scenario.job, self.topology, self.clocks
        start = self.job_start()
        yield topics.JOBS, job, _job_value(start), self.epoch_ns
        merger = Merger()
        last = 0
        latest_ns = self.epoch_ns  # largest node-clock stamp emitted

        def emit(items) -> Iterator[tuple[str, str, dict, int]]:
            nonlocal last, latest_ns
            for key, obj, i in items:
                last = key
                if isinstance(obj, list):
                    value = obj[i]
                    latest_ns = max(latest_ns, value["ts_ns"])
                    yield topics.HEARTBEATS, job, value, self.epoch_ns + key
                else:
                    latest_ns = max(latest_ns, int(obj.t_end_ns[i]))
                    yield topics.STEPS, job, steps_value(obj, i), self.epoch_ns + key

        for st in self._steps(self._want_heartbeats()):
            if st.frame is not None and st.ends is not None:
                merger.add(st.ends, st.frame)
            if st.heartbeats is not None:
                merger.add(st.heartbeats.t, heartbeat_values(st.heartbeats, job, topo, clocks))
            yield from emit(merger.release(st.watermark))
        yield from emit(merger.release(np.inf))
        end_ts = max(self.epoch_ns + last, latest_ns) + 1_000_000
        yield topics.JOBS, job, {"v": 1, "job": job, "event": "end", "ts_ns": end_ts}, end_ts


def _job_value(ev: JobV1) -> dict:
    return msgspec.to_builtins(ev)
