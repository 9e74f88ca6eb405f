"""JobDiagnoser: the whole detection pipeline of one job, fed messages in arrival order.

The stream worker owns one per job (on the job's partition) and `flare diagnose` one per job
of a recording; both call exactly these methods, so offline and online answers are the same.
Time is an input: the diagnoser's clock is the stream time of the messages (and `tick` for
when messages stop), never the wall clock.

Four ranks on two nodes; from step 6 on rank 2 computes 14 ms instead of 10 ms, and the
others wait for it in their all-reduce. Each step names it a suspect; the third such step
opens a `gpu` incident (the job's first five steps are its warm-up: suspects there are
reported, never counted):

>>> from detectors.testing import frame_of, rank_step
>>> def step(s):
...     def ops(r):
...         c, last = (14.0 if r == 2 else 10.0, 14.0) if s >= 6 else (10.0, 10.0)
...         return [("compute", "fwd", "", 0, 0.0, c, 0),
...                 ("coll", "all_reduce", "tp.0", s, c, last + 5.0 - c, 1 << 20)]
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

from detectors.assembly import PendingSteps, StepAssembler
from detectors.base import Stateful
from detectors.budget import StepBudget
from detectors.burst_evidence import Carried, burst_tail, charged_excess
from detectors.candidates import Z_REPORT, Candidates
from detectors.compute_suspects import TwoStages, compute_ratio
from detectors.config import DetectorConfig
from detectors.evidence import LONG_WINDOW, Z_ON, EvidenceTracker, Track, far_bar
from detectors.explain import summarize
from detectors.features import StepFeatures, step_features
from detectors.hang import EXIT_GRACE, FIRST_STALL_TIMEOUTS, HangDetector, HangFinding
from detectors.incidents import IncidentBook, OpenIncident
from detectors.irregularity import LEVEL_STEPS, WARMUP, StepTimeBaseline
from detectors.kept_ops import kept_frame
from detectors.network_suspects import (
    Topology,
    burst_of,
    one_link,
    reference_and_peers,
    short_of_members,
)
from detectors.node_history import NodeHistory
from detectors.noise import NoiseMemory
from detectors.peers import stage_keys
from detectors.reconcile import (
    NETWORK_KINDS,
    Placement,
    covering,
    earlier_views,
    nic_of,
    spread_of,
)
from detectors.rows import group_rows, rank_rows
from detectors.shard_merge import CodedNames, ShardMerger
from detectors.signature_history import SignatureHistory
from detectors.stacks import StackBook, where_phrase
from detectors.stalls import stall_seconds
from detectors.suspects import step_suspects
from detectors.transfer_history import TransferHistory
from detectors.untraced_suspects import WaitHistory, untraced_home
from detectors.whatif import JobCost, UsualStep, job_cost, step_span_s
from schemas import InvalidMessage
from schemas.clock import NS_PER_S
from schemas.frame import StepFrame
from schemas.partial_frame import PartialFrame
from schemas.rankstep import COLL, RankStep
from schemas.report import Detection, DiagnoserOutput, StepReport
from schemas.wire import HeartbeatV1, IncidentV1, JobV1, Suspect

_MEMBERSHIP_EVERY = 10  # relearn group membership every N steps (it rarely changes)
_CLOCKS_EVERY = 4  # read the node clocks every N healthy steps (a tenth of a step's work)
# A confirmed device candidate that the job would not be faster without (the what-if
# replay, by 0.1%) opens only while no other device incident is open. Beside another fault
# it is that fault's shadow or masked by it (`_latent` forecasts the latter): under half
# tracing a rank's host stall left two bystanders confirmed at ×1.000, "2% slower" and
# "-1% slower". Alone, it is a degraded device that the job's slack absorbs for now: a
# ×1.05 GPU of an 8,192-GPU job, z 12 on every step, where 128 pipelines' data and jitter
# decide each step (its fault-free re-run has the very same step times). An SRE drains it at
# the next window, so it opens, saying it costs nothing now. (At 0.5% the simulator's ×1.05
# slow GPUs of smaller jobs opened a step later.)
_MIN_SLOWDOWN = 1.001
_ABSORBED = "; the job does not wait on it now: slower work elsewhere decides each step"

# A fault masked by another is paged for what it would cost once that one is fixed: a
# forecast, not a loss the step shows, so it must be material (1%: a simulated slow GPU at
# ×1.05 behind a straggler forecasts ×1.02; a 2% compute lean left by a stalled rank's
# critical path, ×1.001)
_LATENT_MIN_SLOWDOWN = 1.01
# A candidate confirmed by `evidence.NEED` significant steps of its window, on a step the
# job ran no slower than its usual, waits for one more significant step before it opens:
# the job has not felt it, and its evidence is its own timing alone. On a drill's busy host
# (8 ranks on 2 cores) a pipeline link's tiny sends took ×5.6 their usual on 3 steps of 5
# (z 4.5-8.6, 5-18 ms of 0.32 s steps that ran faster than usual): the ranks' wake-ups, no
# fault. A fault the job feels opens as before; one it does not feel yet (a ×1.05 GPU of an
# 8,192-GPU job) is significant step after step and opens one step later.
_UNFELT_EXTRA_HITS = 1
# A network entity's evidence is the timing of its transfers, small ones included, which a
# loaded host's scheduling stretches too: on 4 of 40 live drills (8 ranks on 2 cores beside
# other work) a link or NIC was confirmed in steps 9-12 by tiny transfers x8-10 on 3 steps
# of 5 that the what-if priced at x1.00-1.05, within the job's own step noise (σ ~6%). So
# on 3 steps a link or switch opens only if what it costs the job stands out of that noise;
# otherwise it waits for a fourth significant step, like a fault the job has not felt.
_NETWORK = ("link", "switch")
_NO_DEVICE = " with no device to blame"
_WHERE = "; stacks: "  # a hang's summary ends with where its culprit is, once known


class JobDiagnoser(Stateful):
    """All detector state of one job; bounded in size whatever the length of the job."""

    def __init__(self, job: str, config: DetectorConfig | None = None) -> None:
        self.job = job
        self.config = s = config or DetectorConfig()
        # A job's steps are gathered from its ranks' messages, or (a job split across
        # workers, issue #17) from its shards' frames: `on_partial` swaps in a ShardMerger.
        self.assembler: PendingSteps = StepAssembler(
            job, grace_s=s.grace_s, grace_steps=s.grace_steps)
        self.baseline = StepTimeBaseline(window=s.window, delta=s.delta)
        self.tracker = EvidenceTracker()
        self.book = IncidentBook(job, resolve_after=s.resolve_after)
        self.hang = HangDetector(timeout_s=s.hang_timeout_s)
        self.stacks = StackBook()  # the ranks' Python stacks, for a hang's merged view
        self._stacks_new = False  # stacks arrived since a hang incident last showed them
        self.topology = Topology()
        self.noise = NoiseMemory()
        self.waits = WaitHistory()
        self.placement = Placement(switch_of_node=self.topology.switch_of)
        self.now_ns = 0  # stream time of every message (hang timeouts)
        self.steps_ns = 0  # stream time of step messages only (grace periods)
        self.steps_seen = 0
        self.world = 0
        self._job_before_s = 0.0  # the step time a job-wide shift left
        self.transfers = TransferHistory()  # each transfer's own past (jobs of few instances)
        self.signature_past = SignatureHistory()  # each kind of transfer's usual reference
        self.nodes = NodeHistory()  # each node's own past (nodes alone in their stage)
        self.two_stages = TwoStages()  # a two-stage job's memory of its stages' compute
        self.usual = UsualStep()  # the healthy step, for a counterfactual's transfers and starts
        # this step's excess of suspects on entities that report nothing (`_untraced_excess`)
        self._seen_excess: dict[tuple[str, str], float] = {}
        self._carrier: Carried | None = None  # the network entity the last step's burst charged
        self._forecast_at: dict[tuple[str, str], int] = {}  # (kind, entity) → step of `_latent`
        # (kind, entity) → the step a network candidate was last priced within the job's noise
        self._noise_priced_at: dict[tuple[str, str], int] = {}
        self.budget = StepBudget()
        # A job's `end` event is final only after a grace: a rank's last steps can still be
        # on their way (a straggler's agent behind, a broker partition read later), and
        # resolving first would open their evidence as new incidents. None: not ending.
        self.end_at_ns: int | None = None
        self.ended = False  # the job ended: its silence is no hang

    # ---- inputs ---------------------------------------------------------------------------
    def on_steps(self, msg: RankStep) -> DiagnoserOutput:
        """One rank-step message; returns the reports of any steps it completed."""
        asm = self.assembler
        if not isinstance(asm, StepAssembler):
            raise InvalidMessage("$", f"job {self.job!r} is merged from its shards' frames; "
                                      "a rank's own step message cannot join them")
        self._check_rank(msg.rank)
        self.now_ns = max(self.now_ns, msg.t_end_ns)
        self.steps_ns = max(self.steps_ns, msg.t_end_ns)
        out = DiagnoserOutput()
        hang = self._hang_incident()
        if hang is not None and hang.culprit == f"rank:{msg.rank}" and msg.step >= hang.onset_step:
            out.incidents.append(self._resolve(hang, msg.step))
            self.hang.settle(self.now_ns)
        self.hang.ops_done(msg.rank, msg.step, msg.group, msg.seq)
        for frame in asm.add(msg, self.steps_ns):
            out.extend(self.on_frame(frame))
        return out

    def on_partial(self, part: PartialFrame) -> DiagnoserOutput:
        """One shard's assembled step (stage 2 of a job split across workers): for each of
        its ranks what `on_steps` does with a rank's message, then the merge of the shards."""
        merger = self._merger()
        f = part.frame
        if f.n_ranks == 0:  # a watermark alone: time passes, as on a tick
            return self._frames(merger.add_partial(part, self.steps_ns)).extend(
                self.tick(part.t_end_ns))
        self._check_rank(int(f.rank[-1]))
        end = int(f.t_end_ns.max())
        self.now_ns = max(self.now_ns, end)
        self.steps_ns = max(self.steps_ns, end)
        out = DiagnoserOutput()
        ranks = f.rank.tolist()
        hang = self._hang_incident()
        if hang is not None and f.step >= hang.onset_step and hang.culprit.startswith("rank:"):
            if int(hang.culprit.removeprefix("rank:")) in set(ranks):
                out.incidents.append(self._resolve(hang, f.step))
                self.hang.settle(self.now_ns)
        off = f.off.tolist()
        for i, rank in enumerate(ranks):
            rows = slice(off[i], off[i + 1])
            self.hang.ops_done(rank, f.step, CodedNames(f.op_group[rows], f.groups),
                               f.op_seq[rows])
        return out.extend(self._frames(merger.add_partial(part, self.steps_ns)))

    def _frames(self, frames: list[StepFrame]) -> DiagnoserOutput:
        out = DiagnoserOutput()
        for frame in frames:
            out.extend(self.on_frame(frame))
        return out

    def _merger(self) -> ShardMerger:
        """The job's ShardMerger, swapped in for the step assembler at the first shard's
        frame; InvalidMessage once ranks' own messages were assembled."""
        asm = self.assembler
        if isinstance(asm, ShardMerger):
            return asm
        if asm.pending or asm.emitted_upto >= 0:
            raise InvalidMessage("$", f"job {self.job!r} is assembled from its ranks' "
                                      "messages; a shard's frame cannot join them")
        merger = ShardMerger(self.job, grace_s=self.config.grace_s,
                             grace_steps=self.config.grace_steps)
        merger.world_size, merger.step_ns = asm.world_size, asm.step_ns
        self.assembler = merger
        return merger

    def _check_rank(self, rank: int) -> None:
        """InvalidMessage, before any state changes, for a rank outside the world the job's
        start event declared: per-rank state is sized by the largest rank seen, so one such
        message would make every detector hold (and scan) arrays that size."""
        world = self.assembler.world_size
        if world and rank >= world:
            raise InvalidMessage("$.rank", f"is {rank}, outside the job's world_size {world}")

    def on_heartbeat(self, hb: HeartbeatV1) -> DiagnoserOutput:
        """One heartbeat: it may open a hang, but it does not expire step grace periods.

        Under backlog a consumer can read heartbeats ahead of the step messages of the same
        moment; letting them move the assembly clock would cut steps short of ranks whose
        messages are merely not read yet. Steps expire on step time (and on `tick`, which
        the worker calls only for partitions that are caught up).
        """
        self._check_rank(hb.rank)
        self.hang.observe(hb)
        if self.stacks.observe(hb):
            self._stacks_new = True
        self.now_ns = max(self.now_ns, hb.ts_ns)
        return self._check_hang() if self.end_at_ns is None and not self.ended else (
            DiagnoserOutput())

    def on_job(self, ev: JobV1) -> DiagnoserOutput:
        """A job start (layout, topology) or end. The end is final one assembly grace later
        (on `tick`, or at once on `flush`): then pending steps are assembled and every open
        incident resolves. Until a new start, the job's silence is no hang."""
        if ev.event == "start":
            self.ended, self.end_at_ns = False, None
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
            if ev.nodes or ev.topology:
                known = [*(ev.topology or ()), *(ev.nodes or ())]  # the job's own list wins
                self.topology.switch_of = {n.node: n.switch for n in known if n.switch}
                self.placement.switch_of_node = self.topology.switch_of
            self.now_ns = max(self.now_ns, ev.ts_ns)
            return DiagnoserOutput()
        asm = self.assembler
        grace = max(asm.grace_ns, int(asm.grace_steps * asm.step_ns))
        self.end_at_ns = max(ev.ts_ns, self.now_ns) + grace
        return DiagnoserOutput()

    def _end(self) -> DiagnoserOutput:
        """The job's end, once its grace is over: what is pending is assembled, then every
        open incident is resolved at its last step."""
        self.end_at_ns, self.ended = None, True
        out = self._assemble_rest()
        for inc in list(self.book.open.values()):
            out.incidents.append(self._resolve(inc, inc.last_step))
        return out

    def tick(self, now_ns: int) -> DiagnoserOutput:
        """Advance stream time with no message (grace periods, hang timeouts)."""
        self.now_ns = max(self.now_ns, now_ns)
        out = DiagnoserOutput()
        for frame in self.assembler.advance(self.now_ns):
            out.extend(self.on_frame(frame))
        if self.end_at_ns is not None:
            return out.extend(self._end()) if self.now_ns >= self.end_at_ns else out
        return out if self.ended else out.extend(self._check_hang())

    def _hang_timeout(self) -> float:
        """Seconds without progress that make a hang: in the job's own step times. Before
        the job's first step is assembled its step time is unknown, and a rank of a 60 s
        step computes for tens of seconds with no op in flight: until then the floor is
        `FIRST_STALL_TIMEOUTS` times longer (clean 16-64-GPU jobs of 60 s steps opened a
        hang in step 0)."""
        floor = self.config.hang_timeout_s
        if self.steps_seen == 0:
            floor *= FIRST_STALL_TIMEOUTS
        return max(floor, self.config.hang_timeout_steps * self._baseline_s())

    def _check_hang(self) -> DiagnoserOutput:
        inc = self._hang_incident()
        if inc is None and not self.hang.due(self.now_ns):
            return DiagnoserOutput()  # nothing to look for or to say before the next second
        out = self._open_hang(self.hang.check(self.now_ns, self._hang_timeout()))
        inc = self._hang_incident()
        if inc is not None and not out.incidents and (
                self.now_ns - inc.held_ns >= self._hang_timeout() * NS_PER_S
                or self._stacks_new and self.now_ns - inc.held_ns >= NS_PER_S):
            # an open hang costs the whole job more every second: say so once a timeout,
            # and show stacks that arrived since (at most once a second: at 10,000 ranks
            # they arrive together)
            self._hold(inc)
            out.incidents.append(inc.to_v1(self.job))
        return out

    def _hold(self, inc: OpenIncident) -> None:
        inc.hold(inc.since_ns, self.now_ns, self._baseline_s(), self.world)
        inc.held_ns = self.now_ns
        inc.stacks = self.stacks.merged(inc.since_ns, self.world, self.hang.last) or None
        if inc.stacks:
            head = inc.summary.partition(_WHERE)[0]
            inc.summary = head + where_phrase(inc.culprit, inc.stacks).replace("; ", _WHERE, 1)
        self._stacks_new = False

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
            inc.since_ns = self.now_ns - int(finding.stuck_s * NS_PER_S)
            self._hold(inc)
            out.incidents.append(inc.to_v1(self.job))
        return out

    def flush(self) -> DiagnoserOutput:
        """End of input (the job ended, went idle, or the recording ran out): assemble what
        is pending, and name a rank that vanished whatever grace is left (the peers that
        fail after a killed rank 0 end the stream with no `end` event)."""
        if self.end_at_ns is not None:
            return self._end()  # the job said it ended: nothing more is coming
        return self._assemble_rest()

    def _assemble_rest(self) -> DiagnoserOutput:
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
        stall_names, stall_s = stall_seconds(frame)
        if stall_names:
            self.hang.learn_stalls(stall_names, stall_s.max(axis=0))
        self.budget.add(
            float(np.median(feats.compute_s)), float(np.median(feats.comm_s - feats.wait_s)),
            float(np.median(feats.wait_s)), float(np.median(feats.gap_s)),
            dict(zip(stall_names, np.median(stall_s, axis=0).tolist(), strict=True)),
        )
        self.assembler.set_step_time(step_time)
        irr = self.baseline.update(step_time)
        stages = stage_keys(frame)
        ratio = compute_ratio(frame, feats, stages)
        ref, peers = reference_and_peers(feats.inst, one_link(frame, self.topology))
        healthy_net = not any(k[0] in NETWORK_KINDS for k in self.book.open)
        kinds = self.signature_past.observe(frame, feats.inst, ref, learn=healthy_net)
        ref = kinds.ref
        own = self.transfers.observe(frame, feats.inst, ref, peers, learn=healthy_net)
        own = own.or_else(kinds.past)
        if healthy_net:
            self.usual.update(frame, feats)
        else:
            self.transfers.drop_recent()
            self.signature_past.drop_recent()
        burst = burst_of(step_time, irr.baseline_s, irr.z) if self.steps_seen > WARMUP else None
        if not self.book.open:
            self.usual.update_starts(frame)
            if burst is None and self.steps_seen % _CLOCKS_EVERY == 0:
                self.usual.learn_clocks(frame, feats)
        cands = step_suspects(
            frame, feats, ratio, self.topology, ref, self.noise, stages, self.waits, own, burst,
            self.two_stages, self.usual.clocks_of(frame) if burst is not None else None,
            kinds.usual,
        )
        self._seen_excess = _untraced_excess(frame, feats, cands, self.topology.group_size)
        if any(k in NETWORK_KINDS and z >= far_bar(k) * Z_ON
               for k, z in zip(cands.kind, cands.z, strict=True)):
            # a network entity far beyond any jitter (a flapping NIC's burst, before the
            # bursts confirm it): its steps are not the transfers' usual, or the bursts
            # would become it and fade one by one (a one-way NIC flapping at half speed in
            # a two-node job: z 11.5, 11.5, 4.8, 3.4, never paged)
            self.transfers.drop_recent()
            self.signature_past.drop_recent()
        healthy_nodes = not any(k[0] in ("node", "host") for k in self.book.open)
        pace = self.nodes.observe(frame, feats, stages, cands, learn=healthy_nodes)
        if not healthy_nodes:
            self.nodes.drop_recent()
        if self.book.open:  # any fault may move one stage's compute (a NIC's retries)
            self.two_stages.drop_recent()
        keep = {(culprit, kind) for kind, culprit in self.book.open}  # tracker keys
        # The job's first steps are its warm-up (allocators, caches, the first batches), and
        # the noise memory holds no spread yet: their suspects are reported, never evidence.
        counted = cands if self.steps_seen > WARMUP else Candidates()
        baseline = irr.baseline_s if np.isfinite(irr.baseline_s) else step_time
        recent = self.tracker.peaks()
        entity = [nic_of(e, k, recent, self.placement, Z_REPORT, far_bar("link") * Z_ON)
                  if (k, e) not in self.book.open else e
                  for e, k in zip(counted.entity, counted.kind, strict=True)]
        # a link or a switch read as a NIC is tracked as that NIC
        kind = [k if m == e else "link"
                for m, e, k in zip(entity, counted.entity, counted.kind, strict=True)]
        self._credit_nic(entity, kind, counted.z, recent)
        excess, carried = charged_excess(counted, entity, kind, burst, self.tracker.z_on)
        z, detail = list(counted.z), list(counted.detail)
        tail = burst_tail(counted, burst, self._carrier, self.tracker.z_on)
        if tail is not None:
            entity.append(tail.entity)
            kind.append(tail.kind)
            z.append(tail.z)
            excess.append(tail.excess_s)
            detail.append(tail.detail)
        self._carrier = carried or tail
        confirmed = self.tracker.update(
            frame.step, entity, kind, z, excess, detail, keep, step_s=baseline
        )
        felt = step_time > baseline
        touched: set[tuple[str, str]] = set()
        for tr in _opening_order(confirmed):
            key = (tr.kind, tr.entity)
            inc = self.book.get(*key)
            if inc is None:
                device = (k for k in self.book.open if k[0] != "hang")
                cover = covering(key, device, self.placement) or self._spread(tr)
                if cover is not None:  # the same fault seen from another entity
                    self._also_suspect(cover, tr)
                    if cover not in touched:
                        touched.add(cover)
                        inc = self.book.open[cover]
                        self._evidence(inc, frame, feats, ratio, stages, pace)
                        out.incidents.append(inc.to_v1(self.job))
                    continue
                confirmed_again = tr.intermittent or \
                    tr.hits(self.tracker.z_on) >= self.tracker.need + _UNFELT_EXTRA_HITS
                if not (felt or confirmed_again):
                    continue
                judged_by_cost = tr.kind in _NETWORK and not confirmed_again
                if judged_by_cost and self._within_noise(frame, key):
                    continue  # priced within the job's noise lately: it waits, unpriced
                cost = self._price(frame, feats, tr.kind, tr.entity, ratio, stages, pace)
                if judged_by_cost and np.log(cost.slowdown) < self.baseline.sigma:
                    self._noise_priced_at[key] = frame.step
                    continue  # what it costs is within the job's own step-to-step noise
                latent = None
                if cost.slowdown < _MIN_SLOWDOWN:
                    latent = self._latent(frame, feats, tr.kind, tr.entity, ratio, stages, pace)
                    if latent is None and self._open_devices():
                        continue
                inc = self._open(tr, frame, feats, ratio, ts, cost, latent)
                out.incidents.extend(self._shift_explained(inc, frame.step))
            elif key in touched:
                continue
            touched.add(key)
            self._evidence(inc, frame, feats, ratio, stages, pace)
            out.incidents.append(inc.to_v1(self.job))
        for key, inc in list(self.book.open.items()):
            open_tr = self.tracker.tracks.get((key[1], key[0]))
            if key not in touched and open_tr is not None and open_tr.absent == 0:
                touched.add(key)
                self._evidence(inc, frame, feats, ratio, stages, pace)
                out.incidents.append(inc.to_v1(self.job))
        touched.update(k for k in self.book.open if k[0] == "hang")
        shift = self.book.get("job", "job")
        if shift is not None and shift.opened_step < frame.step and self._job_before_s > 0:
            # a job-wide shift costs the GPU-time above the baseline it left, while open
            shift.add_cost(step_time / self._job_before_s, step_time, self.world)
        for inc in self.book.quiet_step(touched | self._still_seen(cands, touched),
                                        frame.step):
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
                frame=kept_frame(frame, cands.entity, self.config.keep_ops) if keep_ops
                else None,
            )
        )
        return out

    # ---- helpers --------------------------------------------------------------------------
    def _credit_nic(self, entity: list[str], kind: list[str], z: list[float],
                    recent: dict[tuple[str, str], float]) -> None:
        """A NIC significant this step takes the costly steps its link and its switch were
        charged with before it was found (`reconcile.earlier_views`): one flapping NIC's
        bursts, named by whatever was in flight, are its evidence, not three entities' each
        short of what confirms."""
        for e, k, zz in zip(entity, kind, z, strict=True):
            if k != "link" or not e.startswith("node:") or zz < self.tracker.z_on:
                continue
            for key in earlier_views(e, zz, list(self.tracker.costly), recent, self.placement,
                                     Z_REPORT, far_bar("link") * Z_ON):
                if (key[1], key[0]) not in self.book.open:
                    self.tracker.absorb((e, "link"), key)

    def _baseline_s(self) -> float:
        b = self.baseline.baseline_s
        return b if np.isfinite(b) else 0.0

    def _price(self, frame: StepFrame, feats: StepFeatures, kind: str, entity: str,
               ratio: np.ndarray, stages: tuple[np.ndarray, int], pace: np.ndarray) -> JobCost:
        """What the step cost with `entity`'s excess: replayed without it (`job_cost`), or,
        for an entity none of whose ranks report (a dark node, the link to it), the seconds
        the traced ranks waited on it over their usual this step, as its suspect measured
        them. The replay has none of its ops to set right, and reads every wait on it as its
        excess, the pipeline's usual waits included (a dark stage priced 1.6× for 1.3×)."""
        if (kind, entity) in self._seen_excess:
            actual = step_span_s(frame)
            return JobCost(actual, max(actual - self._seen_excess[(kind, entity)], 0.0))
        # an intermittent fault's burst the step before, not priced: its late starts are
        # this culprit's, unless another fault is open (a persistent culprit's step before,
        # or one while another incident is open, may be that other fault's: a throttled
        # rank's doubled steps, charged to a pipeline link as bursts, priced it ×3)
        track = self.tracker.tracks.get((entity, kind))
        burst_before = (
            track is not None and track.intermittent
            and not self._open_devices()
            and any(s == frame.step - 1 for s, _, _ in self.tracker.costly.get((entity, kind), ())))
        return job_cost(frame, feats, kind, entity, ratio, stages, self.topology.group_size,
                        self.topology.switch_of, self.usual, pace, burst_before)

    def _open_devices(self) -> tuple[tuple[str, str], ...]:
        """(kind, culprit) of the open device incidents: not a job-wide shift, not a hang."""
        return tuple(k for k in self.book.open if k[0] not in ("job", "hang"))

    def _within_noise(self, frame: StepFrame, key: tuple[str, str]) -> bool:
        """A waiting network candidate was priced within the job's noise in the last steps
        of one what-if's worth of ops (`price_ops`): a replay of a large step costs seconds,
        so it is priced again only that often, as `_latent`'s forecasts are."""
        every = -(-frame.n_ops // self.config.price_ops)
        self._noise_priced_at = {k: s for k, s in self._noise_priced_at.items()
                                 if frame.step - s < every}
        return key in self._noise_priced_at

    def _latent(self, frame: StepFrame, feats: StepFeatures, kind: str, entity: str,
                ratio: np.ndarray, stages: tuple[np.ndarray, int], pace: np.ndarray
                ) -> tuple[str, JobCost] | None:
        """A confirmed culprit that costs the job nothing, and the open device incident that
        masks it: the step is the other culprit's (a straggler elsewhere decides it), and
        this one would cost its share once that one is fixed (`job_cost`'s `masked_by`).
        It is a fault all the same, one an SRE fixing the other would meet next, so it is
        paged with that forecast, when it is material. None otherwise. A third replay of a
        large step costs seconds, so a culprit is forecast again only as often as an
        incident's evidence is priced (`_evidence`)."""
        if (kind, entity) in self._seen_excess:
            return None
        others = self._open_devices()
        if not others:
            return None
        every = -(-frame.n_ops // self.config.price_ops)
        self._forecast_at = {k: s for k, s in self._forecast_at.items() if frame.step - s < every}
        if (kind, entity) in self._forecast_at:
            return None
        self._forecast_at[(kind, entity)] = frame.step
        latent = job_cost(frame, feats, kind, entity, ratio, stages, self.topology.group_size,
                          self.topology.switch_of, self.usual, pace, masked_by=others)
        if latent.slowdown < _LATENT_MIN_SLOWDOWN:
            return None
        return others[0][1], latent

    def _evidence(self, inc: OpenIncident, frame: StepFrame, feats: StepFeatures,
                  ratio: np.ndarray, stages: tuple[np.ndarray, int], pace: np.ndarray) -> None:
        """The step is evidence of `inc`: what it cost the job, from the step replayed
        without the culprit's excess (`whatif`). Replaying a step costs about 0.5 µs per op
        on one core, several seconds for a 16,384-GPU step, so a step of more than
        `price_ops` ops is replayed only every (ops / price_ops)-th evidence step, and the
        steps between cost what the last replay found (a fault that persists costs about
        the same step after step); the worker keeps up with the job meanwhile."""
        every = -(-frame.n_ops // self.config.price_ops)
        if inc.priced_step >= 0 and frame.step - inc.priced_step < every:
            inc.add_evidence(frame.step, inc.priced_slowdown, step_span_s(frame), self.world)
            return
        cost = self._price(frame, feats, inc.kind, inc.culprit, ratio, stages, pace)
        inc.priced_step, inc.priced_slowdown = frame.step, cost.slowdown
        inc.add_evidence(frame.step, cost.slowdown, cost.actual_s, self.world)

    def _still_seen(self, cands: Candidates, touched: set[tuple[str, str]]
                    ) -> set[tuple[str, str]]:
        """Open device incidents without evidence this step whose fault still shows, reported
        from an entity inside or around their own (a throttled rank's CPU-starved host, the
        rank of a slow node): not evidence to add, but no sign the fault ended either.

        A rank throttled to a tenth of a CPU, its stage's only traced peer beside it, read
        first as a slow GPU, then, as its peer's mirrored residual widened the noise, only as
        its node's host stalling every few steps: the rank's incident resolved and the host's
        opened, two pages for one fault (a drill with one rank per node traced)."""
        out: set[tuple[str, str]] = set()
        for key in self.book.open:
            if key in touched or key[0] in ("hang", "job"):
                continue
            if any(covering(c, (key,), self.placement) is not None
                   for c in zip(cands.kind, cands.entity, strict=True)):
                out.add(key)
        return out

    def _spread(self, tr: Track) -> tuple[str, str] | None:
        """The open network incident `tr` is the spread of (`reconcile.spread_of`)."""
        onsets = {k: i.onset_step for k, i in self.book.open.items() if k[0] in NETWORK_KINDS}
        if tr.kind not in NETWORK_KINDS or not onsets:
            return None
        return spread_of((tr.kind, tr.entity), tr.first_hit_step(self.tracker.z_on), onsets)

    def _also_suspect(self, key: tuple[str, str], tr: Track) -> None:
        """Keep an entity that shows the incident's fault among its suspects (it may be
        where an SRE looks first)."""
        inc = self.book.open[key]
        if any(s.entity == tr.entity for s in inc.suspects):
            return
        main = self.tracker.tracks.get((key[1], key[0]))
        z_main = main.mean_z() if main is not None else tr.mean_z()
        share = max(tr.mean_z(), 0.0) / max(tr.mean_z() + z_main, 1e-9)
        inc.suspects.append(Suspect(entity=tr.entity, confidence=round(min(share, 0.5), 3)))

    def _open(
        self,
        tr: Track,
        frame: StepFrame,
        feats: StepFeatures,
        ratio: np.ndarray,
        ts: int,
        cost: JobCost,
        latent: tuple[str, JobCost] | None = None,
    ) -> OpenIncident:
        ranked = [t for t in self.tracker.ranked() if t is not tr][:3]
        scores = [max(tr.mean_z(), 1e-9)] + [max(t.mean_z(), 0.0) for t in ranked]
        total = sum(scores)
        suspects = [Suspect(entity=tr.entity, confidence=round(scores[0] / total, 3))]
        seen = {tr.entity}
        for t, sc in zip(ranked, scores[1:], strict=True):
            if t.entity not in seen:
                seen.add(t.entity)
                suspects.append(Suspect(entity=t.entity, confidence=round(sc / total, 3)))
        lost_s, slowdown = cost.lost_s, cost.slowdown
        share = self.tracker.burst_share(tr.entity, tr.kind) if tr.intermittent else 0.0
        # an intermittent fault opened between its bursts: quote what one burst costs
        between = tr.intermittent and slowdown - 1.0 < share / 2
        if between:
            lost_s, slowdown = share * self._baseline_s(), 1.0 + share
        summary = summarize(tr.kind, tr.entity, tr.detail, lost_s, slowdown, frame, feats,
                            ratio, intermittent=between)
        if latent is not None:
            other, later = latent
            summary += (f"; masked by {other}, which decides the step now: once that is fixed,"
                        f" ×{later.slowdown:.2f} ({later.lost_s:.2f} s per step)")
        elif cost.slowdown < _MIN_SLOWDOWN and not between:
            summary += _ABSORBED
        inc = self.book.open_incident(
            tr.kind,
            tr.entity,
            suspects,
            tr.first_hit_step(self.tracker.z_on),
            frame.step,
            ts,
            summary,
        )
        if tr.intermittent:
            inc.resolve_after = max(LONG_WINDOW, self.book.resolve_after)
        inc.priced_step, inc.priced_slowdown = frame.step, cost.slowdown  # no second replay
        return inc

    def _shift_explained(self, device: OpenIncident, step: int) -> list[IncidentV1]:
        """A job-wide shift was opened with no device to blame, and now one is: the shift
        was that device's doing (confirming a device takes a few steps longer than seeing
        the step time jump). The shift is resolved and says which incident explains it."""
        shift = self.book.get("job", "job")
        if shift is None or device.kind in ("job", "hang"):
            return []
        head = shift.summary.partition(_NO_DEVICE)[0]
        shift.summary = (f"{head}: explained by {device.kind} {device.culprit} (incident "
                         f"{device.id}, confirmed {step - shift.opened_step} steps later)")
        return [self._resolve(shift, step)]

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
            f"job-wide step time shifted ×{ratio:.2f} (now {step_time:.2f} s){_NO_DEVICE}: "
            f"{self.budget.explain(LEVEL_STEPS)}; baseline re-set",
        )
        self._job_before_s = step_time / ratio
        inc.add_evidence(frame.step, ratio, step_time, self.world)
        return [inc.to_v1(self.job)]

    def _hang_incident(self) -> OpenIncident | None:
        return next((i for k, i in self.book.open.items() if k[0] == "hang"), None)

    def _resolve(self, inc: OpenIncident, step: int) -> IncidentV1:
        if inc.kind == "hang":
            self._hold(inc)
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


def _opening_order(confirmed: list[Track]) -> list[Track]:
    """Confirmed tracks, strongest first, one entity's kinds together and the costliest of
    them first.

    A CPU quota stretches a rank's compute and the gaps between its ops alike, and its `gpu`
    and `host` tracks confirmed in the same step: the gaps' higher z (11 against 10) named a
    drill's throttled rank a host stall while its compute cost the step three times as much.
    Of two readings of one entity the kind whose excess costs more is the fault; the other
    is seen through it (and stays a suspect of the incident)."""
    by_entity: dict[str, list[Track]] = {}
    for tr in sorted(confirmed, key=lambda t: t.mean_z(), reverse=True):
        by_entity.setdefault(tr.entity, []).append(tr)
    return [tr for kinds in by_entity.values()
            for tr in sorted(kinds, key=lambda t: t.excess_s, reverse=True)]


def _untraced_excess(frame: StepFrame, feats: StepFeatures, cands: Candidates,
                     group_size: dict[str, int]) -> dict[tuple[str, str], float]:
    """(kind, entity) → the excess seconds of this step's suspects on entities none of whose
    ranks report: a node that is not among the step's nodes, or a link with such an end;
    and only in a step whose collectives miss no member (the dark node holds whole groups).
    Where some collective misses members the replay prices their waits well (at 256 GPUs
    with a node dark, the NIC's cost error median 1.6%; by the suspect's seconds, 8.3%).

    >>> from detectors.testing import frame_of, rank_step
    >>> frame = frame_of([rank_step(0, "n0", 0, [("compute", "fwd", "", 0, 0.0, 1.0, 0)])])
    >>> c = Candidates()
    >>> c.add("node:n1", "gpu", 5.0, 0.2); c.add("node:n0", "gpu", 5.0, 0.1)
    >>> c.add("link:n0~n1", "link", 5.0, 0.3)
    >>> _untraced_excess(frame, step_features(frame), c, {})
    {('gpu', 'node:n1'): 0.2, ('link', 'link:n0~n1'): 0.3}
    """
    present = {frame.nodes[i] for i in np.unique(frame.node).tolist()}
    out: dict[tuple[str, str], float] = {}
    for e, k, x in zip(cands.entity, cands.kind, cands.excess_s, strict=True):
        what, _, name = e.partition(":")
        ends = name.split("~") if what == "link" else [name] if what == "node" else []
        if ends and not set(ends) <= present:
            out[(k, e)] = max(out.get((k, e), 0.0), x)
    inst = feats.inst
    short = short_of_members(frame.groups, inst.group, inst.n_copies, group_size)
    if out and ((inst.kind == COLL) & short).any():
        return {}
    return out
