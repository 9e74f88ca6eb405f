"""JobDiagnoser: the whole detection pipeline of one job, fed messages in arrival order.

The stream worker owns one per job (on the job's partition) and `flare diagnose` one per job
of a recording; both call exactly these methods, so offline and online answers are the same.
Time is an input: the diagnoser's clock is the stream time of the messages (and `tick` for
when messages stop), never the wall clock.

Four ranks on two nodes; from step 6 on rank 2 computes 40 ms instead of 10 ms. Each step
names it a suspect; the third such step opens a `gpu` incident (the job's first five steps are
its warm-up: suspects there are reported, never counted):

>>> from detectors.testing import frame_of, rank_step
>>> def step(s):
...     def ops(r):
...         c = 40.0 if r == 2 and s >= 6 else 10.0
...         return [("compute", "fwd", "", 0, 0.0, c, 0),
...                 ("coll", "all_reduce", "tp.0", s, c, 45.0 - c, 1 << 20)]
...     return frame_of([rank_step(r, f"n{r // 2}", s, ops(r)) for r in range(4)])
>>> d = JobDiagnoser("j")
>>> for s in range(9):
...     out = d.on_frame(step(s))
...     if s >= 5:
...         print(s, [x.entity for x in out.reports[0].detections],
...               [(i.kind, i.culprit) for i in out.incidents])
5 [] []
6 ['rank:2'] []
7 ['rank:2'] []
8 ['rank:2'] [('gpu', 'rank:2')]
"""

from __future__ import annotations

import numpy as np

from detectors.assembly import StepAssembler
from detectors.base import Stateful
from detectors.budget import StepBudget
from detectors.candidates import Candidates
from detectors.compute_suspects import compute_ratio
from detectors.config import DetectorConfig
from detectors.evidence import EvidenceTracker, Track
from detectors.explain import summarize
from detectors.features import StepFeatures, step_features
from detectors.hang import EXIT_GRACE, HangDetector, HangFinding
from detectors.incidents import IncidentBook, OpenIncident
from detectors.irregularity import LEVEL_STEPS, WARMUP, StepTimeBaseline
from detectors.network_suspects import Topology, transfer_reference
from detectors.noise import NoiseMemory
from detectors.peers import stage_keys
from detectors.reconcile import Placement, covering
from detectors.rows import group_rows, rank_rows
from detectors.suspects import step_suspects
from detectors.untraced_suspects import WaitHistory, untraced_home
from schemas.frame import StepFrame
from schemas.rankstep import RankStep
from schemas.report import Detection, DiagnoserOutput, StepReport
from schemas.wire import HeartbeatV1, IncidentV1, JobV1, Suspect

_MEMBERSHIP_EVERY = 10  # relearn group membership every N steps (it rarely changes)
# a suspect that costs this share of the job's step on a significant step has made that step
# slow by itself (noise that reaches significance costs a few percent): see evidence.py
MATERIAL_SHARE = 0.25


class JobDiagnoser(Stateful):
    """All detector state of one job; bounded in size whatever the length of the job."""

    def __init__(self, job: str, config: DetectorConfig | None = None) -> None:
        self.job = job
        self.config = s = config or DetectorConfig()
        self.assembler = StepAssembler(job, grace_s=s.grace_s, grace_steps=s.grace_steps)
        self.baseline = StepTimeBaseline(window=s.window, delta=s.delta)
        self.tracker = EvidenceTracker()
        self.book = IncidentBook(job, resolve_after=s.resolve_after)
        self.hang = HangDetector(timeout_s=s.hang_timeout_s)
        self.topology = Topology()
        self.noise = NoiseMemory()
        self.waits = WaitHistory()
        self.placement = Placement(switch_of_node=self.topology.switch_of)
        self.now_ns = 0  # stream time of every message (hang timeouts)
        self.steps_ns = 0  # stream time of step messages only (grace periods)
        self.steps_seen = 0
        self.world = 0
        self._onset_baseline: dict[tuple[str, str], float] = {}
        self.budget = StepBudget()

    # ---- inputs ---------------------------------------------------------------------------
    def on_steps(self, msg: RankStep) -> DiagnoserOutput:
        """One rank-step message; returns the reports of any steps it completed."""
        self.now_ns = max(self.now_ns, msg.t_end_ns)
        self.steps_ns = max(self.steps_ns, msg.t_end_ns)
        out = DiagnoserOutput()
        hang = self._hang_incident()
        if hang is not None and hang.culprit == f"rank:{msg.rank}" and msg.step >= hang.onset_step:
            out.incidents.append(self._resolve(hang, msg.step))
        for frame in self.assembler.add(msg, self.steps_ns):
            out.extend(self.on_frame(frame))
        return out

    def on_heartbeat(self, hb: HeartbeatV1) -> DiagnoserOutput:
        """One heartbeat: it may open a hang, but it does not expire step grace periods.

        Under backlog a consumer can read heartbeats ahead of the step messages of the same
        moment; letting them move the assembly clock would cut steps short of ranks whose
        messages are merely not read yet. Steps expire on step time (and on `tick`, which
        the worker calls only for partitions that are caught up).
        """
        self.hang.observe(hb)
        self.now_ns = max(self.now_ns, hb.ts_ns)
        return self._check_hang()

    def on_job(self, ev: JobV1) -> DiagnoserOutput:
        """A job start (layout, topology) or end (flushes pending steps)."""
        if ev.event == "start":
            if ev.world_size:
                self.assembler.world_size = ev.world_size
                self.world = ev.world_size
            if ev.layout is not None:
                lay = ev.layout
                sizes = {"tp": lay.tp or 0, "dp": lay.dp or 0, "ep": lay.ep or 0}
                self.hang.learn_layout(sizes)
                self.topology.group_size = {k: v for k, v in sizes.items() if v > 1}
                self.topology.world = ev.world_size or 0
            if ev.nodes:
                self.topology.nodes = tuple(n.node for n in ev.nodes)
                self.topology.switch_of = {n.node: n.switch for n in ev.nodes if n.switch}
                self.placement.switch_of_node = self.topology.switch_of
            self.now_ns = max(self.now_ns, ev.ts_ns)
            return DiagnoserOutput()
        out = self.flush()
        for inc in list(self.book.open.values()):
            out.incidents.append(self._resolve(inc, inc.last_step))
        return out

    def tick(self, now_ns: int) -> DiagnoserOutput:
        """Advance stream time with no message (grace periods, hang timeouts)."""
        self.now_ns = max(self.now_ns, now_ns)
        out = DiagnoserOutput()
        for frame in self.assembler.advance(self.now_ns):
            out.extend(self.on_frame(frame))
        return out.extend(self._check_hang())

    def _hang_timeout(self) -> float:
        """Seconds without progress that make a hang: in the job's own step times."""
        return max(self.config.hang_timeout_s, self.config.hang_timeout_steps * self._baseline_s())

    def _check_hang(self) -> DiagnoserOutput:
        return self._open_hang(self.hang.check(self.now_ns, self._hang_timeout()))

    def _open_hang(self, finding: HangFinding | None) -> DiagnoserOutput:
        out = DiagnoserOutput()
        if finding is not None and self._hang_incident() is None:
            inc = self.book.open_incident(
                "hang",
                finding.culprit,
                [Suspect(entity=e, confidence=round(c, 3)) for e, c in finding.suspects],
                finding.onset_step,
                finding.onset_step,
                self.now_ns,
                finding.summary,
            )
            inc.evidence_steps = 1
            inc.slowdown_sum = 1.0
            out.incidents.append(inc.to_v1(self.job))
        return out

    def flush(self) -> DiagnoserOutput:
        """End of input (the job ended, went idle, or the recording ran out): assemble what
        is pending, and name a rank that vanished whatever grace is left (the peers that
        fail after a killed rank 0 end the stream with no `end` event)."""
        out = DiagnoserOutput()
        for frame in self.assembler.flush():
            out.extend(self.on_frame(frame))
        out.extend(self._open_hang(
            self.hang.exit_finding(self.now_ns, self._hang_timeout() * EXIT_GRACE, final=True)))
        return out

    # ---- one step -------------------------------------------------------------------------
    def on_frame(self, frame: StepFrame) -> DiagnoserOutput:
        """An already assembled step (the simulator's fast path)."""
        out = DiagnoserOutput()
        if frame.n_ranks == 0:
            return out
        ts = int(frame.t_end_ns.max())
        self.now_ns = max(self.now_ns, ts)
        self.steps_seen += 1
        self.world = max(self.world, frame.n_ranks + int(frame.missing.size))
        # where an idle stopped rank is: a step is assembled long before a hang timeout
        self.hang.steps_done(frame.rank, frame.step, frame.t_end_ns)
        self.hang.untraced_home = untraced_home(frame, self.topology)
        feats = step_features(frame)
        if self.steps_seen <= 3 or self.steps_seen % _MEMBERSHIP_EVERY == 0:
            self._learn_membership(frame, feats)
            names = frame.nodes
            self.placement.node_of_rank.update(
                zip(frame.rank.tolist(), [names[i] for i in frame.node.tolist()], strict=True)
            )
        step_time = float(np.median(feats.span_s))
        self.budget.add(
            float(np.median(feats.compute_s)), float(np.median(feats.comm_s - feats.wait_s)),
            float(np.median(feats.wait_s)), float(np.median(feats.gap_s)),
        )
        self.assembler.set_step_time(step_time)
        irr = self.baseline.update(step_time)
        stages = stage_keys(frame)
        ratio = compute_ratio(frame, feats, stages)
        ref = transfer_reference(feats.inst)
        cands = step_suspects(
            frame, feats, ratio, self.topology, ref, self.noise, stages, self.waits
        )
        keep = {(culprit, kind) for kind, culprit in self.book.open}  # tracker keys
        # The job's first steps are its warm-up (allocators, caches, the first batches), and
        # the noise memory holds no spread yet: their suspects are reported, never evidence.
        counted = cands if self.steps_seen > WARMUP else Candidates()
        baseline = irr.baseline_s if np.isfinite(irr.baseline_s) else step_time
        confirmed = self.tracker.update(
            frame.step, counted.entity, counted.kind, counted.z, counted.excess_s,
            counted.detail, keep, material_s=MATERIAL_SHARE * baseline,
        )
        touched: set[tuple[str, str]] = set()
        for tr in sorted(confirmed, key=lambda t: t.mean_z(), reverse=True):
            key = (tr.kind, tr.entity)
            inc = self.book.get(*key)
            if inc is None:
                device = (k for k in self.book.open if k[0] != "hang")
                cover = covering(key, device, self.placement)
                if cover is not None:  # the same fault seen from another entity
                    if cover not in touched:
                        touched.add(cover)
                        inc = self.book.open[cover]
                        slow = self._slowdown(cover, step_time, tr.excess_s)
                        inc.add_evidence(frame.step, slow, step_time, self.world)
                        out.incidents.append(inc.to_v1(self.job))
                    continue
                inc = self._open(tr, frame, feats, ratio, ts, baseline)
            elif key in touched:
                continue
            touched.add(key)
            slow = self._slowdown(key, step_time, tr.excess_s)
            inc.add_evidence(frame.step, slow, step_time, self.world)
            out.incidents.append(inc.to_v1(self.job))
        for key, inc in list(self.book.open.items()):
            open_tr = self.tracker.tracks.get((key[1], key[0]))
            if key not in touched and open_tr is not None and open_tr.absent == 0:
                touched.add(key)
                slow = self._slowdown(key, step_time, open_tr.excess_s)
                inc.add_evidence(frame.step, slow, step_time, self.world)
                out.incidents.append(inc.to_v1(self.job))
        touched.update(k for k in self.book.open if k[0] == "hang")
        for inc in self.book.quiet_step(touched, frame.step):
            self._onset_baseline.pop((inc.kind, inc.culprit), None)
            out.incidents.append(inc.to_v1(self.job))
        if irr.level_shift and irr.shift_ratio > 1.0:  # a job that got faster is no problem
            out.incidents.extend(self._job_shift(frame, ts, irr.shift_ratio, step_time))
        sample = self.config.ops_sample_every
        keep_ops = irr.irregular not in ("normal", "warmup") or (
            sample and frame.step % sample == 0
        )
        out.reports.append(
            StepReport(
                job=self.job,
                step=frame.step,
                ts_ns=ts,
                n_ranks=frame.n_ranks,
                n_missing=int(frame.missing.size),
                step_time_s=step_time,
                baseline_s=baseline,
                delta=irr.delta,
                irregular=irr.irregular,
                level_shift=irr.level_shift,
                ranks=rank_rows(frame, feats, ratio),
                groups=group_rows(frame, feats, ref),
                detections=[
                    Detection(e, k, z, x)
                    for e, k, z, x in zip(
                        cands.entity, cands.kind, cands.z, cands.excess_s, strict=True
                    )
                ],
                frame=frame if keep_ops else None,
            )
        )
        return out

    # ---- helpers --------------------------------------------------------------------------
    def _baseline_s(self) -> float:
        b = self.baseline.baseline_s
        return b if np.isfinite(b) else 0.0

    def _slowdown(self, key: tuple[str, str], step_time: float, excess_s: float) -> float:
        before = self._onset_baseline.get(key, step_time)
        by_baseline = step_time / before if before > 0 else 1.0
        healthy = step_time - excess_s
        by_excess = step_time / healthy if healthy > 0 else 1.0
        return max(by_baseline, by_excess, 1.0)

    def _open(
        self,
        tr: Track,
        frame: StepFrame,
        feats: StepFeatures,
        ratio: np.ndarray,
        ts: int,
        baseline: float,
    ) -> OpenIncident:
        key = (tr.kind, tr.entity)
        self._onset_baseline[key] = baseline
        ranked = [t for t in self.tracker.ranked() if t is not tr][:3]
        scores = [max(tr.mean_z(), 1e-9)] + [max(t.mean_z(), 0.0) for t in ranked]
        total = sum(scores)
        suspects = [Suspect(entity=tr.entity, confidence=round(scores[0] / total, 3))]
        seen = {tr.entity}
        for t, sc in zip(ranked, scores[1:], strict=True):
            if t.entity not in seen:
                seen.add(t.entity)
                suspects.append(Suspect(entity=t.entity, confidence=round(sc / total, 3)))
        summary = summarize(tr.kind, tr.entity, tr.detail, tr.excess_s, frame, feats, ratio)
        return self.book.open_incident(
            tr.kind,
            tr.entity,
            suspects,
            tr.first_hit_step(self.tracker.z_on),
            frame.step,
            ts,
            summary,
        )

    def _job_shift(
        self, frame: StepFrame, ts: int, ratio: float, step_time: float
    ) -> list[IncidentV1]:
        """A confirmed job-wide level shift with no device to blame: a `job` incident."""
        if any(k[0] != "job" for k in self.book.open):
            return []
        old = self.book.get("job", "job")
        if old is not None:
            self.book.resolve("job", "job", frame.step)
        inc = self.book.open_incident(
            "job",
            "job",
            [Suspect(entity="job", confidence=1.0)],
            frame.step,
            frame.step,
            ts,
            f"job-wide step time shifted ×{ratio:.2f} (now {step_time:.2f} s) with no device "
            f"to blame: {self.budget.explain(LEVEL_STEPS)}; baseline re-set",
        )
        inc.evidence_steps = 1
        inc.slowdown_sum = max(ratio, 1.0)
        return [inc.to_v1(self.job)]

    def _hang_incident(self) -> OpenIncident | None:
        return next((i for k, i in self.book.open.items() if k[0] == "hang"), None)

    def _resolve(self, inc: OpenIncident, step: int) -> IncidentV1:
        self.book.resolve(inc.kind, inc.culprit, step)
        inc.resolved_step = step
        return inc.to_v1(self.job)

    def _learn_membership(self, frame: StepFrame, feats: StepFeatures) -> None:
        """Members of each group, from its first instance of the step (all members take
        part in every instance), for the hang detector's waits-for graph."""
        inst = feats.inst
        if inst.transfer_s.size == 0:
            return
        first = np.full(len(frame.groups), np.iinfo(np.int64).max)
        np.minimum.at(first, inst.group, inst.seq)
        pick = inst.seq == first[inst.group]
        copies = np.flatnonzero(pick[inst.copy_inst])
        g = inst.group[inst.copy_inst[copies]]
        order = np.argsort(g, kind="stable")
        g = g[order]
        ranks = frame.rank[inst.copy_rank[copies][order]]
        starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
        ends = np.r_[starts[1:], g.size]
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            self.hang.learn_members(frame.groups[int(g[a])], set(ranks[a:b].tolist()))
