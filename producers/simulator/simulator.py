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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import numpy as np

from producers.agent.cadence import INTERVAL_S, GridCadence
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
from producers.simulator.faults import HANG_FAMILIES, LINK_FAMILIES, FaultPlan, plan_fault
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
HANG_TAIL_NS = 40e9  # heartbeats keep coming this long after a hang, then the job is gone
MAX_STEPS_AFTER_HANG = 4  # ranks that can still run finish at most this many steps


class _Merger:
    """Items keyed by true time, released in key order once the watermark passes them."""

    def __init__(self) -> None:
        self._keys: list[np.ndarray] = []
        self._src: list[np.ndarray] = []
        self._idx: list[np.ndarray] = []
        self._objs: dict[int, object] = {}
        self._n = 0

    def add(self, keys: np.ndarray, obj: object) -> None:
        """Item i of `obj` has time keys[i]."""
        if keys.shape[0] == 0:
            return
        oid = self._n
        self._n += 1
        self._objs[oid] = obj
        self._keys.append(np.asarray(keys, dtype=np.int64))
        self._src.append(np.full(keys.shape[0], oid, dtype=np.int64))
        self._idx.append(np.arange(keys.shape[0], dtype=np.int64))

    def release(self, watermark: float) -> Iterator[tuple[int, object, int]]:
        """(key, obj, i) of every item with key < watermark, in key order (stable)."""
        if not self._keys:
            return
        keys = np.concatenate(self._keys)
        src = np.concatenate(self._src)
        idx = np.concatenate(self._idx)
        order = np.argsort(keys, kind="stable")
        keys, src, idx = keys[order], src[order], idx[order]
        cut = len(keys)
        if np.isfinite(watermark):
            cut = int(np.searchsorted(keys, watermark, side="left"))
        rest = slice(cut, None)
        self._keys, self._src, self._idx = [keys[rest]], [src[rest]], [idx[rest]]
        objs = self._objs
        live = set(np.unique(src[rest]).tolist())
        head = zip(keys[:cut].tolist(), src[:cut].tolist(), idx[:cut].tolist(), strict=True)
        for k, o, i in head:
            yield k, objs[o], i
        self._objs = {o: objs[o] for o in live}


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
        seeds = np.random.SeedSequence(scenario.seed).spawn(5)
        self._noise_seed, fault_seed, target_seed, clock_seed, self._host_seed = seeds
        self.engine = StepEngine(topo, scenario.microbatches, scenario.chunks, costs)
        self._transfers = transfer_times(topo, costs)
        self.engine.scale = self._calibrate()
        crng = np.random.default_rng(clock_seed)
        skew = crng.uniform(-1.0, 1.0, topo.n_nodes) * scenario.noise.clock_skew_ms * 1e6
        self.clocks = Clocks(EPOCH_NS, np.rint(skew).astype(np.int64))
        self._phase = crng.uniform(0.0, HEARTBEAT_PERIOD_NS, topo.world)
        self.plan: FaultPlan | None = None
        if scenario.fault is not None:
            self.plan = plan_fault(
                scenario.fault, topo, scenario.steps,
                np.random.default_rng(target_seed), np.random.default_rng(fault_seed),
            )  # fmt: skip
        self._xfer = self._transfers.total(self.engine.scale)
        self._xfer_faulty = self._xfer
        if self.plan is not None and self.plan.link_hit is not None:
            sev = self.plan.fault.severity
            self._xfer_faulty = dict(self._xfer)
            for k, hits in self.plan.link_hit.items():
                self._xfer_faulty[k] = [
                    x * np.where(hit, sev, 1.0) for x, hit in zip(self._xfer[k], hits, strict=True)
                ]
        self._onset_ts_ns: int | None = None

    # ------------------------------------------------------------- calibration
    def _calibrate(self) -> float:
        """Scale so that one quiet training step lasts `step_time_s` (gaps stay absolute)."""
        topo, eng = self.topology, self.engine
        K = [eng.n_ops(s, True, False) for s in range(topo.layout.pp)]
        S, W = topo.stage_size, topo.world
        gap = 0.5 * (self.costs.gap_lo_s + self.costs.gap_hi_s) * 1e9
        ones = [np.ones((k, S)) for k in K]
        inp = StepInputs(
            train=True, checkpoint_ns=0.0, gaps=[np.full((k, S), gap) for k in K], jit=ones,
            net=ones, main=np.ones(W), dev=np.ones(W), moe=None, xfer=self._transfers.total(1.0),
        )  # fmt: skip
        eng.scale = 1.0
        clock = np.zeros(W)
        eng.run(0, clock, SeqCounters.fresh(topo.layout.pp), inp)
        return self.scenario.step_time_s * 1e9 / float(clock.max())

    # -------------------------------------------------------------- the steps
    def _inputs(
        self, step: int, train: bool, nd: NoiseDraw, K: list[int], host_rng: np.random.Generator
    ) -> StepInputs:
        """Noise plus the fault's effect on this step."""
        topo, plan = self.topology, self.plan
        S, W = topo.stage_size, topo.world
        level = nd.level
        main = nd.data * level
        dev = np.full(W, level)
        xfer = self._xfer
        stop = hang_dp = None
        if plan is not None and plan.active(step):
            cf = plan.compute_factor(step, W)
            if cf is not None:
                main = main * cf
                dev = dev * cf
            fam = plan.family
            if fam in LINK_FAMILIES:
                xfer = self._xfer_faulty
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
            hang_dp=hang_dp,
        )  # fmt: skip

    def _records(self) -> Iterator[StepRecord]:
        """Engine-only run: one StepRecord per step (fresh random streams every call)."""
        sc, topo, eng = self.scenario, self.topology, self.engine
        noise = NoiseSource(sc.noise, topo, self.costs, np.random.default_rng(self._noise_seed))
        host_rng = np.random.default_rng(self._host_seed)
        clock = np.zeros(topo.world)
        ctr = SeqCounters.fresh(topo.layout.pp)
        last = sc.steps - 1
        if self.plan is not None and self.plan.family in HANG_FAMILIES:
            # ranks that can still run keep going past the last step until they block too
            last = max(last, self.plan.fault.onset_step + MAX_STEPS_AFTER_HANG)
        step = 0
        while step <= last:
            train = noise.is_train(step)
            K = [eng.n_ops(s, train, noise.has_checkpoint(step)) for s in range(topo.layout.pp)]
            nd = noise.draw(step, K)
            rec = eng.run(step, clock, ctr, self._inputs(step, train, nd, K, host_rng))
            if self.plan is not None and step == self.plan.fault.onset_step:
                t = rec.hang_ns if rec.hang_ns is not None else float(np.min(rec.t_start))
                self._onset_ts_ns = EPOCH_NS + int(round(t))
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
                stop = rec.hang_ns + HANG_TAIL_NS
            built = build_frame(topo, rec, sc.job, self.clocks)
            frame, ends = built if built is not None else (None, None)
            hb = None
            if heartbeats:
                hb = heartbeat_batch(topo, rec, self._phase, HEARTBEAT_PERIOD_NS, stop, cadence)
            live = rec.t_end[np.isfinite(rec.t_end)]
            wm = float(live.min()) if live.size else np.inf
            yield _Step(rec, frame, ends, hb, min(wm, stop))

    def _want_heartbeats(self) -> bool:
        sc = self.scenario
        return sc.heartbeats or (sc.fault is not None and sc.fault.family in HANG_FAMILIES)

    # ------------------------------------------------------------ public API
    @property
    def truth(self) -> GroundTruth:
        sc, plan = self.scenario, self.plan
        if plan is not None and self._onset_ts_ns is None:
            for rec in self._records():  # run the engine up to the onset to time it
                if rec.step >= plan.fault.onset_step:
                    break
        return GroundTruth(
            job=sc.job,
            family=plan.family if plan else None,
            kind=plan.kind if plan else None,
            culprit=plan.culprit if plan else None,
            onset_step=plan.fault.onset_step if plan else None,
            onset_ts_ns=self._onset_ts_ns if plan else None,
            severity=float(plan.fault.severity) if plan else None,
            layout=sc.layout.to_dict(),
            gpus=sc.layout.world,
            steps=sc.steps,
            seed=sc.seed,
            step_time_s=sc.step_time_s,
        )

    def job_start(self) -> JobV1:
        lay = self.scenario.layout
        return JobV1(
            v=1, job=self.scenario.job, event="start", ts_ns=EPOCH_NS, world_size=lay.world,
            layout=WireLayout(tp=lay.tp, pp=lay.pp, dp=lay.dp, ep=lay.ep),
            nodes=[NodeInfo(**n) for n in self.topology.nodes_table()],
        )  # fmt: skip

    def run(self) -> Iterator[StepFrame | HeartbeatV1]:
        """Frames (at the true time their last rank reports) and heartbeats, in time order."""
        job, topo, clocks = self.scenario.job, self.topology, self.clocks
        merger = _Merger()
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
        yield topics.JOBS, job, _job_value(start), EPOCH_NS
        merger = _Merger()
        last = 0
        latest_ns = EPOCH_NS  # largest node-clock stamp emitted

        def emit(items) -> Iterator[tuple[str, str, dict, int]]:
            nonlocal last, latest_ns
            for key, obj, i in items:
                last = key
                if isinstance(obj, list):
                    value = obj[i]
                    latest_ns = max(latest_ns, value["ts_ns"])
                    yield topics.HEARTBEATS, job, value, EPOCH_NS + key
                else:
                    latest_ns = max(latest_ns, int(obj.t_end_ns[i]))
                    yield topics.STEPS, job, steps_value(obj, i), EPOCH_NS + key

        for st in self._steps(self._want_heartbeats()):
            if st.frame is not None and st.ends is not None:
                merger.add(st.ends, st.frame)
            if st.heartbeats is not None:
                merger.add(st.heartbeats.t, heartbeat_values(st.heartbeats, job, topo, clocks))
            yield from emit(merger.release(st.watermark))
        yield from emit(merger.release(np.inf))
        end_ts = max(EPOCH_NS + last, latest_ns) + 1_000_000
        yield topics.JOBS, job, {"v": 1, "job": job, "event": "end", "ts_ns": end_ts}, end_ts


def _job_value(ev: JobV1) -> dict:
    return msgspec.to_builtins(ev)
