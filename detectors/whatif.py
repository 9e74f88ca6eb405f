"""What a culprit costs the job: the step replayed without its excess.

A slow GPU's own excess is not what the job loses. Its tensor-parallel peers wait for it, its
pipeline neighbours wait for them, and whatever slack the schedule has (a bubble, a rank
that waits anyway) absorbs part of it. A heuristic from the culprit's own slowdown
over-states the loss (issue #12). So the step is replayed twice over its own dependency
structure, once as it ran and once with the culprit made typical, and the job's cost is the
difference between the two step times.

The replay model, on one clock where each rank begins the step when it did (ranks of
different pipeline stages begin at different times); node clocks disagree by milliseconds,
so each node's stamps are first put on that clock by the offset that lines up the ends of
the collectives it shares with other nodes (`clocks`):
- an op starts after the op of its rank that ended last before it started (its
  predecessor), plus the lag it had after that one (launch gaps, host work between ops);
  ops that overlapped (async collectives, comm streams) stay overlapped;
- a compute op lasts its duration;
- a collective or p2p instance ends when its last member arrives, plus its transfer (the
  shortest copy: the last arriver's; a buffered send's as its receiver saw it, `p2p`);
  every copy ends then, plus as much later as it ended as the step ran (its tail: a NIC
  slow one way delays its partners' data, not its own);
- a member that is not traced arrives when the instance's traced copies say it did (their
  end less the transfer), unless it is the culprit.

The counterfactual changes only the culprit's part: a GPU's compute at its tensor-parallel
peers' typical time (they compute the same data), a node's (or a GPU's without traced
peers) at its stage peers' typical time times the load of its data replica in this step
(sequence lengths differ by replica and step), a starved host's lags too, a NIC's, link's
or switch's transfers at the usual transfer of their kind, and the copies they reached
late without their tails. Untraced members arrive with
the traced ones when they may be the culprit (an untraced culprit, a node's untraced GPUs,
the far end of a slow link), and otherwise as much earlier as the culprit is ahead without
its excess by then: a traced GPU's untraced peers and pipeline neighbours were late by
waiting on it. And each rank begins the step when it ended the step before in that step's
what-if: a rank begins a step when it ended the last one, so a fault stretches the stagger
of the stages' starts too (`UsualStep.chained_origins`; on the first step priced, the step
before is taken to have lost what this one does, within how much later than usual each rank
began). Both replays share the model's errors, so the job's slowdown is their ratio and the
lost time is the actual step time less the actual step time over that slowdown.

Two ranks compute, then all-reduce (5 ms of transfer), then compute 20 ms each and
all-reduce again; rank 1 computes 30 ms instead of 10 ms first. Its peer waits 20 ms for it,
and the job's 60 ms step would have taken 40 ms without rank 1's excess:

>>> from detectors.compute_suspects import compute_ratio
>>> from detectors.features import step_features
>>> from detectors.peers import stage_keys
>>> from detectors.testing import frame_of, rank_step
>>> frame = frame_of([
...     rank_step(r, f"n{r}", 0, [("compute", "fwd", "", 0, 0.0, c, 0),
...                               ("coll", "all_reduce", "dp.0", 1, c, 35.0 - c, 1024),
...                               ("compute", "bwd", "", 0, 35.0, 20.0, 0),
...                               ("coll", "all_reduce", "dp.0", 2, 55.0, 5.0, 1024)])
...     for r, c in ((0, 10.0), (1, 30.0))
... ])
>>> feats = step_features(frame)
>>> ratio = compute_ratio(frame, feats, stage_keys(frame))
>>> cost = job_cost(frame, feats, "gpu", "rank:1", ratio)
>>> round(cost.actual_s * 1e3, 3), round(cost.without_s * 1e3, 3), round(cost.slowdown, 3)
(60.0, 40.0, 1.5)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from detectors.base import Stateful
from detectors.features import Instances, StepFeatures, rank_max
from detectors.network_suspects import REF_QUANTILE, short_of_members, transfer_reference
from detectors.p2p import delivered
from detectors.peers import replica_keys, stage_keys
from detectors.reconcile import NETWORK_KINDS
from detectors.segments import grouped_median, grouped_quantile, int_codes
from schemas.frame import StepFrame
from schemas.rankstep import COMPUTE, P2P

# bits of an instance's copies (at most 2^20, as the wire allows ranks) in its packed kind
_COPIES_BITS = 21
_CLOCK_SAMPLES = 9  # healthy steps' clock offsets kept per node
_CLOCK_MIN = 3  # readings a node needs before they are used
_CONVERGED_NS = 1_000.0  # a replay that moves no op by more than 1 µs is done
_MIN_WINDOW = 256  # ops the replay settles at once, at least (`timeline`)
# a partial instance whose shortest copy lasts over 1.5× the typical transfer (+50 µs) waited
# for a member that is not traced
_UNTRACED_LATE = 1.5
_UNTRACED_SLACK_S = 50e-6


@dataclass(frozen=True, slots=True)
class JobCost:
    """The job's step time as it ran and as it would have run without the culprit."""

    actual_s: float  # the step time the detectors measure (median rank span)
    without_s: float  # what-if: the same step without the culprit's excess

    @property
    def slowdown(self) -> float:
        return self.actual_s / self.without_s if self.without_s > 0 else 1.0

    @property
    def lost_s(self) -> float:
        """Seconds of every GPU's step lost to the culprit."""
        return max(self.actual_s - self.without_s, 0.0)


class UsualStep(Stateful):
    """What the job's healthy steps look like, and what a culprit's last what-if left, for
    the counterfactual of a fault that changes the step as a whole:
    - the usual transfer of each kind of instance (op, size, members, across nodes or not):
      a bad switch under most of the job slows most instances of every kind, so the step
      itself no longer shows what a transfer should take;
    - when each rank usually begins its step after the first one (pipeline stages begin
      apart), and how much earlier each rank ended the last step priced for a culprit in
      its what-if: a rank begins a step when it ended the one before, so a fault stretches
      that stagger too, through the step before (`chained_origins`, `first_origins`);
    - each node's clock offset (`learn_clocks`, `clocks_of`): a step's own lines up the
      ends of its collectives' copies, and a NIC slow one way ends its partners' copies
      late and its own on time, which reads as clocks hundreds of ms apart (a drill's nodes,
      on one host, 0.1-0.4 s in its bursts' steps). Clocks drift by microseconds a
      minute: the healthy steps' medians are the better reading while a fault is on.

    Per kind, the lower quartile of its per-step medians over the last `window` healthy
    steps, and per rank the median of its start offsets; the diagnoser feeds transfers only
    while no network incident is open, starts only while no incident is, and the quantiles
    keep the few steps between a fault's onset and its incident from moving them.
    """

    def __init__(self, window: int = 50) -> None:
        self.window = window
        self.seen: dict[tuple[str, int, int, bool], list[float]] = {}
        # ring of per-rank start offsets (ns) as stamped: node clocks are lined up when used
        self.starts = np.full((window, 0), np.nan)
        self._row = 0
        # (kind, entity) → the last step priced for it, its ranks (sorted), and how much
        # earlier each of them ended that step in the what-if than as it ran (ns)
        self.leads: dict[tuple[str, str], tuple[int, np.ndarray, np.ndarray]] = {}
        # node → its recent healthy offsets against `_anchor`'s clock (ns), and their median
        # once it has `_CLOCK_MIN` (read on every priced step: kept, not recomputed)
        self.offsets: dict[str, deque[float]] = {}
        self._offset: dict[str, float] = {}
        self._anchor: str | None = None

    def update(self, frame: StepFrame, feats: StepFeatures) -> None:
        inst = feats.inst
        if inst.transfer_s.size == 0:
            return
        keys, sig = instance_kinds(frame, inst)
        med = grouped_median(inst.transfer_s, sig, len(keys))
        for k, m in zip(keys, med.tolist(), strict=True):
            past = self.seen.setdefault(k, [])
            past.append(m)
            del past[:-self.window]

    def update_starts(self, frame: StepFrame) -> None:
        if frame.n_ranks == 0:
            return
        top = int(frame.rank.max()) + 1
        if top > self.starts.shape[1]:
            pad = np.full((self.window, top - self.starts.shape[1]), np.nan)
            self.starts = np.concatenate([self.starts, pad], axis=1)
        row = self.starts[self._row % self.window]
        row[:] = np.nan
        row[frame.rank] = _origins(frame)
        self._row += 1

    def stretch(self, frame: StepFrame, skew_ns: np.ndarray | None = None) -> np.ndarray:
        """(R,) how much later than usual each of the frame's ranks began the step, after
        the first one (ns, never below 0; 0 for a rank never seen)."""
        now = _origins(frame, skew_ns)
        if self._row == 0 or frame.n_ranks == 0:
            return np.zeros(frame.n_ranks)
        known = frame.rank < self.starts.shape[1]
        seen = self.starts[:, frame.rank[known]]
        has = ~np.isnan(seen).all(axis=0)
        usual = np.full(frame.n_ranks, np.nan)
        usual[np.flatnonzero(known)[has]] = np.nanmedian(seen[:, has], axis=0)
        if skew_ns is not None and skew_ns.size:
            usual -= skew_ns[frame.node]
        usual -= np.nanmin(usual) if np.isfinite(usual).any() else 0.0
        return np.where(np.isfinite(usual), np.maximum(now - usual, 0.0), 0.0)

    def chained_origins(
        self, frame: StepFrame, culprit: tuple[str, str], skew_ns: np.ndarray | None = None
    ) -> np.ndarray | None:
        """(R,) when each of the frame's ranks would have begun the step without `culprit`
        (on the replay's clock, `_origins`), when the step before was priced for it: each
        rank as much earlier as it ended that step in its what-if. The stagger moves with
        the step before's work (sequence lengths differ by replica and step), so this is
        closer than the healthy steps' stagger. None when the step before was not priced."""
        last = self.leads.get(culprit)
        if last is None or last[0] != frame.step - 1 or frame.n_ranks == 0 or last[1].size == 0:
            return None
        _, ranks, lead = last
        pos = np.minimum(np.searchsorted(ranks, frame.rank), ranks.size - 1)
        known = ranks[pos] == frame.rank
        # a rank that did not report the step before began with the median rank
        return _origins(frame, skew_ns) - np.where(known, lead[pos], float(np.median(lead)))

    def first_origins(
        self, frame: StepFrame, lead_ns: np.ndarray, skew_ns: np.ndarray | None = None
    ) -> np.ndarray:
        """(R,) when each rank would have begun the first step priced for a culprit without
        it: as much earlier as the culprit's what-if of this very step ends it (`lead_ns`),
        taken for the step before's, which was not priced (the fault was there already: an
        incident opens after a few steps), but never earlier than the rank usually begins:
        a later start may also be the step before's pause (a checkpoint, an evaluation),
        which is there without the fault too, or a fault that came and went."""
        return _origins(frame, skew_ns) - np.clip(lead_ns, 0.0, self.stretch(frame, skew_ns))

    def remember(self, frame: StepFrame, culprit: tuple[str, str], lead_ns: np.ndarray) -> None:
        """`culprit`'s what-if of this step ended each rank `lead_ns` earlier than its replay
        as it ran (for `chained_origins` of the next step); older steps are forgotten."""
        self.leads = {k: v for k, v in self.leads.items() if v[0] >= frame.step - 1}
        order = np.argsort(frame.rank, kind="stable")
        self.leads[culprit] = (frame.step, frame.rank[order].copy(), lead_ns[order])

    def learn_clocks(self, frame: StepFrame, feats: StepFeatures) -> None:
        """Keep this healthy step's node clock offsets (`p2p.delivered`), each against the
        first node ever seen: a step's offsets are relative, and its set of nodes may
        differ (a late rank, a dark node). A step whose nodes are not all on one scale with
        that node is not kept."""
        if len(frame.nodes) < 2:
            return
        clocks = delivered(frame, feats.inst)[1]
        if self._anchor is None:
            self._anchor = frame.nodes[0]
        if self._anchor not in frame.nodes:
            return
        at = frame.nodes.index(self._anchor)
        ok = clocks.comparable(np.full(len(frame.nodes), at), np.arange(len(frame.nodes)))
        if not ok.all():
            return
        rel = clocks.offset_ns - clocks.offset_ns[at]
        for name, off in zip(frame.nodes, rel.tolist(), strict=True):
            seen = self.offsets.setdefault(name, deque(maxlen=_CLOCK_SAMPLES))
            seen.append(off)
            if len(seen) >= _CLOCK_MIN:
                self._offset[name] = float(np.median(seen))

    def clocks_of(self, frame: StepFrame) -> np.ndarray | None:
        """(nodes,) the frame's node clock offsets as the healthy steps read them (their
        median, ns), or None while any of its nodes has fewer than `_CLOCK_MIN` readings."""
        got = [self._offset.get(name) for name in frame.nodes]
        if len(got) < 2 or None in got:
            return None
        return np.array(got, dtype=np.float64)

    def usual(self, frame: StepFrame, feats: StepFeatures) -> np.ndarray:
        """(I,) the usual transfer of each instance's kind; NaN for a kind never seen."""
        inst = feats.inst
        if inst.transfer_s.size == 0 or not self.seen:
            return np.full(inst.transfer_s.size, np.nan)
        keys, sig = instance_kinds(frame, inst)
        per_key = np.array([float(np.quantile(self.seen[k], REF_QUANTILE)) if k in self.seen
                            else np.nan for k in keys])
        return per_key[sig]


@dataclass(slots=True)
class _Change:
    """The counterfactual: per-op factors and per-instance transfers and arrivals."""

    dur: np.ndarray  # (N,) compute duration factor
    lag: np.ndarray  # (N,) factor on the lag before the op
    transfer_s: np.ndarray  # (I,) the instance's transfer
    arrival_ns: np.ndarray  # (I,) when its untraced members arrive (-inf: with the traced)
    origin: np.ndarray | None = None  # (R,) when each rank begins the step (None: as it did)
    # (ranks,) a traced culprit's: untraced members' set arrivals move as much earlier as
    # its own excess puts it ahead by then (`_followed_arrival`; None: they keep them)
    follow: np.ndarray | None = None
    # (I,) bool: instances whose copies' tails (`_Timeline.tail`) were the culprit's data
    # arriving late: their copies end together again; None: every copy as it ran
    cut_tails: np.ndarray | None = None


def job_cost(
    frame: StepFrame,
    feats: StepFeatures,
    kind: str,
    entity: str,
    ratio: np.ndarray,
    stages: tuple[np.ndarray, int] | None = None,
    group_size: dict[str, int] | None = None,
    switch_of: dict[str, str] | None = None,
    history: UsualStep | None = None,
    pace: np.ndarray | None = None,
    after_burst: bool = False,
    masked_by: tuple[tuple[str, str], ...] = (),
) -> JobCost:
    """The job's step time with and without `entity`'s excess (`kind` says which excess).

    `ratio`: each rank's compute vs its stage peers (`compute_ratio`), `stages`: the peer sets
    it was measured in (`stage_keys`); `group_size`: members
    per group kind from the job's layout (to see which instances miss untraced members);
    `switch_of`: node → switch, for a switch culprit; `history`: the job's usual transfers
    (without it, a network culprit's transfers are brought to those of the step's other
    instances) and how the culprit's what-if of the step before ended, which this one
    begins with and updates (without it, each rank begins the step as it did); `pace`: (R, 2)
    each rank's compute ratio and idle factor against its own past where its node is alone
    in its stage (`NodeHistory.observe`), what such a node is priced by, having no peers;
    `after_burst`: the step before, not priced, was the culprit's own burst (an intermittent
    fault's, before its incident opened), so however late a rank began this step is the
    culprit's too, not only as much as this step's own what-if gives back; `masked_by`:
    (kind, entity) of other culprits, whose excess both replays leave out: what the culprit
    would cost once they are fixed (a slow GPU whose step a straggler elsewhere decides
    costs nothing while the straggler lasts). Each rank then begins the step as it did.
    """
    actual = step_span_s(frame)
    if frame.n_ops == 0 or actual <= 0:
        return JobCost(actual, actual)
    # each transfer as its data's receiver saw it: a buffered send's shortest copy shows
    # nothing of what its data took, and the receiver's wait on it would be priced as a wait
    # on its sender (`p2p`)
    seen, clocks = delivered(frame, feats.inst,
                             history.clocks_of(frame) if history is not None else None)
    feats = replace(feats, inst=replace(feats.inst, transfer_s=seen))
    inst = feats.inst
    skew = clocks.offset_ns
    short = short_of_members(frame.groups, inst.group, inst.n_copies, group_size or {})
    typical = _typical_transfer(inst)
    # an instance that misses untraced members: if even its shortest copy lasted well over
    # the typical transfer, that copy waited too, for an untraced member that arrived last,
    # the typical transfer before the copies ended; otherwise a traced member was last
    late = short & (inst.transfer_s > _UNTRACED_LATE * typical + _UNTRACED_SLACK_S)
    transfer = np.where(late, typical, inst.transfer_s)
    arrival = np.where(late, _earliest_copy_end(frame, inst, skew) - transfer * 1e9, -np.inf)
    same = _Change(np.ones(frame.n_ops), np.ones(frame.n_ops), transfer, arrival)
    line = timeline(frame, feats, skew, transfer, arrival)
    stages = stages or stage_keys(frame)
    change = _change(frame, feats, kind, entity, ratio, stages, same, typical, switch_of or {},
                     history, line.lag, pace)
    if masked_by:
        others = same
        for other_kind, other in masked_by:
            others = _both(others, _change(frame, feats, other_kind, other, ratio, stages, same,
                                           typical, switch_of or {}, history, line.lag, pace))
        return _cost(actual, replay(frame, line, others),
                     replay(frame, line, _both(others, change)))
    if history is not None:
        change.origin = history.chained_origins(frame, (kind, entity), skew)
    spans = replay(frame, line, same)
    if history is not None and change.origin is None:
        lead = np.full(frame.n_ranks, np.inf) if after_burst else (
            spans - replay(frame, line, change))
        change.origin = history.first_origins(frame, lead, skew)
    spans_without = replay(frame, line, change)
    if history is not None:
        origin = _origins(frame, skew)
        after = origin if change.origin is None else change.origin
        history.remember(frame, (kind, entity), origin + spans - (after + spans_without))
    return _cost(actual, spans, spans_without)


def _cost(actual: float, spans: np.ndarray, spans_without: np.ndarray) -> JobCost:
    """The step as it ran, over the slowdown of the two replays (each rank's span, ns)."""
    base = float(np.median(spans))
    what_if = float(np.median(spans_without))
    if base <= 0:
        return JobCost(actual, actual)
    # Not floored at the step as it ran: in a step the culprit barely touched the two replays
    # differ by noise either way, and an incident sums its steps' estimates with their signs
    # (`OpenIncident._lose`), so the noise cancels instead of adding up (cost p90 over all
    # runs 6.2% -> 5.0% at 256 GPUs, 31% -> 23% at 1,024; ACCURACY.md, third pass)
    return JobCost(actual, actual * what_if / base)


def _both(a: _Change, b: _Change) -> _Change:
    """Two counterfactuals at once: each culprit's own ops, instances and untraced members
    as its counterfactual has them (both begin from the step as it ran)."""
    follow = [f for f in (a.follow, b.follow) if f is not None]
    cuts = [c for c in (a.cut_tails, b.cut_tails) if c is not None]
    return _Change(a.dur * b.dur, a.lag * b.lag, np.minimum(a.transfer_s, b.transfer_s),
                   np.minimum(a.arrival_ns, b.arrival_ns),
                   follow=np.union1d(*follow) if len(follow) == 2 else next(iter(follow), None),
                   cut_tails=np.logical_or(*cuts) if len(cuts) == 2 else next(iter(cuts), None))


def step_span_s(frame: StepFrame) -> float:
    """The step time the detectors measure: the median rank span (s; 0 without ranks)."""
    span = (frame.t_end_ns - frame.t_start_ns).astype(np.float64)
    return float(np.median(span)) / 1e9 if span.size else 0.0


def _typical_transfer(inst: Instances) -> np.ndarray:
    """(I,) the typical transfer of each instance's kind: the network reference where there
    is one, else the lower quartile of the instances with the same op and size (partial
    instances included: most of them wait on healthy members), never above its own. A p2p
    transfer whose other end is not traced lasts from its traced end's post to the end: the
    whole wait when that end posts first, so where the step has p2p pairs of the same size
    with both ends traced, their lower quartile (the pair's name is its first copy's, send
    or recv) bounds it too."""
    ref = transfer_reference(inst)
    if inst.transfer_s.size == 0:
        return ref
    _, bcode = np.unique(inst.bytes, return_inverse=True)
    bcode = bcode.reshape(-1)
    n_bytes = int(bcode.max()) + 1
    key = (inst.kind.astype(np.int64) * (int(inst.name.max()) + 1) + inst.name) * n_bytes + bcode
    _, sig = np.unique(key, return_inverse=True)
    sig = sig.reshape(-1)
    low = grouped_quantile(inst.transfer_s, sig, int(sig.max()) + 1, REF_QUANTILE)[sig]
    p2p = inst.kind == P2P
    pairs = p2p & (inst.n_copies >= 2)
    if pairs.any():
        pair = grouped_quantile(inst.transfer_s[pairs], bcode[pairs], n_bytes, REF_QUANTILE)
        low = np.where(p2p & np.isfinite(pair[bcode]), np.minimum(low, pair[bcode]), low)
    best = np.where(np.isfinite(ref), np.minimum(ref, low), low)
    return np.minimum(best, inst.transfer_s)


def instance_kinds(frame: StepFrame, inst: Instances) -> tuple[list[tuple[str, int, int, bool]],
                                                             np.ndarray]:
    """The kinds of instances whose transfers compare (op, size, members, across nodes or
    not), named so they compare across steps too, and the (I,) kind of each instance.

    The four columns are packed into one int64 per instance (sizes by their rank among the
    step's sizes) and made unique in one sort: `np.unique(..., axis=0)` over the rows took
    5 s for the 2 million instances of a 16,384-GPU step, this 0.25 s. The packed order is
    the rows' lexicographic order, so the kinds come out in the same order."""
    sizes, size_code = int_codes(inst.bytes)
    name = inst.name.astype(np.int64)
    copies = np.minimum(inst.n_copies, 1 << 20).astype(np.int64)
    key = (name * sizes.size + size_code) << _COPIES_BITS | copies
    key = key << 1 | inst.cross_node.astype(np.int64)
    uniq, sig = int_codes(key)
    cross, copies = uniq & 1, (uniq >> 1) & ((1 << _COPIES_BITS) - 1)
    name, size = np.divmod(uniq >> (_COPIES_BITS + 1), sizes.size)
    keys = [(frame.names[int(n)], int(sizes[b]), int(c), bool(x))
            for n, b, c, x in zip(name.tolist(), size.tolist(), copies.tolist(), cross.tolist(),
                                  strict=True)]
    return keys, sig


def _transfer_elsewhere(frame: StepFrame, inst: Instances, hit: np.ndarray) -> np.ndarray:
    """(I,) the median transfer of the instances like each one (same op, size, members,
    across nodes or not) that do not go through the culprit: its transfers as they would be
    without it. A bad switch under most of the job slows most instances of every kind, so a
    quantile over all of them is not healthy; NaN where no such instance ran this step."""
    out = np.full(inst.transfer_s.size, np.nan)
    if inst.transfer_s.size == 0 or hit.all():
        return out
    keys, sig = instance_kinds(frame, inst)
    return grouped_median(inst.transfer_s[~hit], sig[~hit], len(keys))[sig]


def _earliest_copy_end(
    frame: StepFrame, inst: Instances, skew_ns: np.ndarray | None = None
) -> np.ndarray:
    """(I,) the earliest end of an instance's copies on the replay's clock (ns)."""
    comm = np.flatnonzero(frame.op_kind != COMPUTE)
    out = np.full(inst.transfer_s.size, np.inf)
    if comm.size:
        ends = (frame.op_start_ns[comm] + frame.op_dur_ns[comm]).astype(np.float64)
        ends += _origins(frame, skew_ns)[frame.op_rank_index()[comm]]
        np.minimum.at(out, inst.copy_inst, ends)
    return out


def _change(
    frame: StepFrame,
    feats: StepFeatures,
    kind: str,
    entity: str,
    ratio: np.ndarray,
    stages: tuple[np.ndarray, int],
    same: _Change,
    typical: np.ndarray,
    switch_of: dict[str, str],
    history: UsualStep | None,
    lags: np.ndarray,
    pace: np.ndarray | None = None,
) -> _Change:
    """The step without `entity`'s excess (see the module docstring); `lags`: the time each
    op waited after its predecessor on its rank (launch gaps, host work between ops), as
    the replay models it (`_Timeline.lag`); `pace`: as `job_cost`'s, for the fallback of a
    node with no peers."""
    inst = feats.inst
    transfer = same.transfer_s.copy()
    what, _, name = entity.partition(":")
    if kind in NETWORK_KINDS:
        hit = _network_instances(frame, feats, what, name, switch_of)
        usual = history.usual(frame, feats) if history is not None else typical * np.nan
        elsewhere = _transfer_elsewhere(frame, inst, hit)
        usual = np.where(np.isfinite(usual), usual,
                         np.where(np.isfinite(elsewhere), elsewhere, typical))
        transfer[hit] = np.minimum(transfer[hit], usual[hit])
        # a slow transfer to a member that is not traced reads as that member arriving late;
        # the copies that ended after the rest had waited on the slow transfer's data
        return _Change(same.dur, same.lag, transfer, _with_traced(same.arrival_ns),
                       cut_tails=hit)
    if what == "rank" and name.isdigit():
        ranks = np.flatnonzero(frame.rank == int(name))
    elif what == "node" and kind != "gpu":  # a gpu on a node: one of its untraced GPUs
        ranks = np.flatnonzero(np.array(frame.nodes, dtype=object)[frame.node] == name)
    else:
        ranks = np.zeros(0, np.int64)
    if ranks.size == 0:
        # not traced: its peers' waits on it are what it costs; without it, the members
        # that are not traced arrive with the traced ones
        return _Change(same.dur, same.lag, transfer, _with_traced(same.arrival_ns))
    idle = np.ones(frame.n_ranks)  # factor on each rank's gaps without the culprit
    if what == "node" and pace is not None:  # alone in its stage: priced by its own past
        ratio = np.where(np.isfinite(pace[:, 0]), pace[:, 0], ratio)
        idle[ranks] = np.nan_to_num(pace[ranks, 1], nan=1.0)
    factor = np.ones(frame.n_ranks)
    factor[ranks] = 1.0 / np.maximum(np.nan_to_num(ratio[ranks], nan=1.0), 1.0)
    per_op = np.repeat(factor, np.diff(frame.off))
    dur, lag = same.dur, same.lag
    mine = np.zeros(frame.n_ranks, bool)
    mine[ranks] = True
    culprit = np.repeat(mine, np.diff(frame.off))
    if feats.has_compute:
        compute = np.flatnonzero(frame.op_kind == COMPUTE)
        dur = _compute_without(frame, kind, stages, compute, culprit, mine, per_op)
    if kind == "host" or not feats.has_compute:
        # a starved host stretches the gaps before ops; without compute ops the gaps are the
        # compute (the ratio is measured on them)
        lag = _toward_peers(frame, stages, lags, np.arange(frame.n_ops), culprit, mine,
                            per_op if not feats.has_compute
                            else np.repeat(idle, np.diff(frame.off)))
    # a node's (or host's) untraced GPUs are as slow as its traced ones: without it, they
    # arrive with the rest; one traced GPU's untraced peers are healthy, but late by as much
    # as they waited on it (its pipeline neighbours, and theirs, wait on its tensor-parallel
    # peers): they keep their time less how far ahead its own timeline is without it by then
    if what == "rank":
        return _Change(dur, lag, transfer, same.arrival_ns, follow=ranks)
    return _Change(dur, lag, transfer, _with_traced(same.arrival_ns))


def _with_traced(arrival_ns: np.ndarray) -> np.ndarray:
    """Untraced members that arrive with the traced ones (the counterfactual of a culprit
    that may be among them)."""
    return np.full_like(arrival_ns, -np.inf)


def _peer_typical(
    frame: StepFrame, stages: tuple[np.ndarray, int], values: np.ndarray, rows: np.ndarray,
    culprit: np.ndarray, need: np.ndarray,
) -> np.ndarray:
    """(len(rows),) the median of `values` (per op) over the same op, by name and occurrence
    (a rank's 3rd "fwd"), on the stage peers that are not the culprit; NaN where none ran it
    or where the rank is not one of those that `need` (R,) it. Only the needing ranks' peer
    sets are read: a GPU's tensor-parallel peers are 7 ranks of thousands."""
    out = np.full(rows.size, np.nan)
    ri = frame.op_rank_index()[rows]
    wanted = np.zeros(stages[1], bool)
    wanted[stages[0][need]] = True
    sel = np.flatnonzero(wanted[stages[0][ri]])
    if sel.size == 0:
        return out
    rows, ri = rows[sel], ri[sel]
    name = frame.op_name[rows].astype(np.int64)
    n_names = int(name.max()) + 1
    order = np.lexsort((rows, name, ri))
    cell = ri[order] * n_names + name[order]
    first = np.flatnonzero(np.r_[True, cell[1:] != cell[:-1]])
    occ_sorted = np.arange(order.size) - np.repeat(first, np.diff(np.r_[first, order.size]))
    occ = np.empty(order.size, np.int64)
    occ[order] = occ_sorted
    n_occ = int(occ.max()) + 1
    key = (stages[0][ri] * n_names + name) * n_occ + occ
    uniq, code = np.unique(key, return_inverse=True)
    code = code.reshape(-1)
    peer = ~culprit[rows]
    typical = np.full(uniq.size, np.nan)
    if peer.any():
        typical = grouped_median(values[rows][peer], code[peer], uniq.size)
    out[sel] = typical[code]
    return out


def _compute_without(
    frame: StepFrame, kind: str, stages: tuple[np.ndarray, int], rows: np.ndarray,
    culprit: np.ndarray, mine: np.ndarray, fallback: np.ndarray,
) -> np.ndarray:
    """(N,) factor on each compute op's duration without the culprit's excess: its
    tensor-parallel peers' typical duration (one GPU; they compute the same data), else its
    stage peers' times the load of its data replica in this step, else `fallback`.
    `culprit`: (N,) its ops; `mine`: (R,) its ranks."""
    values = frame.op_dur_ns.astype(np.float64)
    out = np.ones(frame.n_ops)
    if rows.size == 0 or not culprit[rows].any():
        return out
    typical = np.full(rows.size, np.nan)
    replicas = replica_keys(frame) if kind == "gpu" else None
    if replicas is not None:
        typical = _peer_typical(frame, replicas, values, rows, culprit, mine)
    need = ~np.isfinite(typical) & culprit[rows]
    if need.any():
        # the culprit's replica's other ranks too, for the replica's load
        dp = frame.coord("dp")
        replica = mine | (np.isin(dp, dp[mine]) if (dp >= 0).all() else mine)
        stage = _peer_typical(frame, stages, values, rows, culprit, replica)
        load = _replica_load(frame, values, rows, culprit, stage)
        typical = np.where(need, stage * load[frame.op_rank_index()[rows]], typical)
    out[rows] = _down_to(values[rows], typical, culprit[rows], fallback[rows])
    return out


def _down_to(
    v: np.ndarray, typical: np.ndarray, culprit: np.ndarray, fallback: np.ndarray
) -> np.ndarray:
    """Factor bringing the culprit's values `v` down to `typical` (never up), `fallback`
    where there is no typical value; 1 for the other ranks' ops."""
    ok = np.isfinite(typical) & (v > 0)
    factor = np.where(ok, np.minimum(typical / np.where(v > 0, v, 1.0), 1.0), fallback)
    return np.where(culprit, factor, 1.0)


def _replica_load(
    frame: StepFrame, values: np.ndarray, rows: np.ndarray, culprit: np.ndarray,
    typical: np.ndarray,
) -> np.ndarray:
    """(R,) the load of each rank's data replica in this step, against its stage peers: the
    median, over the replica's ranks that are not the culprit, of their compute `rows`
    against their stage peers' `typical`. Every pipeline stage and tensor-parallel rank of a
    replica computes the same samples, and sequence lengths differ by replica and step, so
    stage peers on other replicas compute more or less than the culprit would have; 1 where
    the replicas are not known (no data-parallel coordinate) or have no other rank."""
    dp = frame.coord("dp")
    if frame.n_ranks == 0 or (dp < 0).any():
        return np.ones(frame.n_ranks)
    ri = frame.op_rank_index()[rows]
    v = values[rows]
    ok = ~culprit[rows] & (typical > 0) & (v > 0)  # NaN typical compares False
    per_rank = grouped_median(v[ok] / typical[ok], ri[ok], frame.n_ranks)
    _, code = np.unique(dp, return_inverse=True)
    code = code.reshape(-1)
    known = np.isfinite(per_rank)
    load = grouped_median(per_rank[known], code[known], int(code.max()) + 1)[code]
    return np.where(np.isfinite(load), load, 1.0)


def _toward_peers(
    frame: StepFrame, stages: tuple[np.ndarray, int], values: np.ndarray, rows: np.ndarray,
    culprit: np.ndarray, mine: np.ndarray, fallback: np.ndarray,
) -> np.ndarray:
    """(N,) factor on each op's value: the culprit's `rows` (its ops `culprit`, its ranks
    `mine`) brought down to their peers' typical value (never up), `fallback` where no peer
    ran the op; 1 elsewhere."""
    out = np.ones(frame.n_ops)
    if rows.size == 0 or not culprit[rows].any():
        return out
    t = _peer_typical(frame, stages, values, rows, culprit, mine)
    out[rows] = _down_to(values[rows], t, culprit[rows], fallback[rows])
    return out


def _network_instances(
    frame: StepFrame, feats: StepFeatures, what: str, name: str, switch_of: dict[str, str]
) -> np.ndarray:
    """(I,) bool: cross-node instances that go through the NIC, link or switch `name`."""
    inst = feats.inst
    if what == "node":
        on = np.array([n == name for n in frame.nodes])
    elif what == "link":
        a, _, b = name.partition("~")
        on = np.array([n in (a, b) for n in frame.nodes])
    elif what == "switch":
        on = np.array([switch_of.get(n) == name for n in frame.nodes])
    else:
        on = np.zeros(len(frame.nodes), bool)
    if not on.any() or inst.copy_inst.size == 0:
        return np.zeros(inst.transfer_s.size, bool)
    touch = np.bincount(inst.copy_inst, weights=on[frame.node[inst.copy_rank]],
                        minlength=inst.transfer_s.size)
    if what == "link":  # both ends: a p2p transfer between the two nodes
        other = np.bincount(inst.copy_inst, weights=~on[frame.node[inst.copy_rank]],
                            minlength=inst.transfer_s.size)
        return inst.cross_node & (touch >= 2) & (other == 0)
    return inst.cross_node & (touch > 0)


@dataclass(frozen=True, slots=True)
class _Copies:
    """Copies of instances lying together (positions `at`, or from `at` on when a slice
    start), grouped by instance: where each instance's run begins (`heads`, relative),
    which instance it is and how many copies it has."""

    at: np.ndarray | int
    heads: np.ndarray
    inst: np.ndarray
    width: np.ndarray

    @staticmethod
    def of(inst_of: np.ndarray, at: np.ndarray | int) -> _Copies:
        heads = np.flatnonzero(np.r_[True, inst_of[1:] != inst_of[:-1]]) if inst_of.size \
            else np.zeros(0, np.int64)
        return _Copies(at, heads, inst_of[heads], np.diff(np.r_[heads, inst_of.size]))


@dataclass(frozen=True, slots=True)
class _Timeline:
    """The step as it ran, on the replay's clock, laid out in the order its replays settle
    its ops (`timeline`): the same for every replay of the step, so made once. Per-op
    arrays are in frame order unless named `*_p` (settling order, `perm`)."""

    ri: np.ndarray  # (N,) each op's rank index
    dur: np.ndarray  # (N,) ns
    lag: np.ndarray  # (N,) ns from the predecessor's end (or the rank's begin) to the start
    end: np.ndarray  # (N,) ns, as it ran
    origin: np.ndarray  # (R,) when each rank began the step (`_origins`)
    inst: np.ndarray  # (N,) each op's instance (-1: compute)
    # (N,) ns each copy ended after its instance's end as the model has it (its last
    # member's start plus its transfer; 0 for compute), so that the step replayed as it ran
    # is the step as it ran: one member's data can arrive long after the others' (a NIC
    # slow one way only: its copy on the far side ends last), and a buffered send returns
    # before its data arrives (a negative tail)
    tail: np.ndarray
    perm: np.ndarray  # (N,) the op at each position of the settling order
    pred_p: np.ndarray  # (N,) position of the op each op follows on its rank (-1: none)
    windows: list[tuple[int, int, _Copies]]  # (start, end, copies from `at` on) positions
    copies: _Copies  # every copy's position, for the last pass over all ops


def timeline(frame: StepFrame, feats: StepFeatures, skew_ns: np.ndarray,
             transfer_s: np.ndarray, arrival_ns: np.ndarray) -> _Timeline:
    """The step as it ran on one clock (node offsets `skew_ns`), and its settling order: the
    ops in windows of time holding about one op per rank each, in the order they ended (an
    instance's copies at its last copy's end, so that they share a window), each window
    with its compute ops first and then its copies grouped by instance. `transfer_s`,
    `arrival_ns`: (I,) each instance's transfer and its untraced members' arrival, which
    with its members' starts give the end each copy's tail is measured from."""
    ri = frame.op_rank_index()
    start = frame.op_start_ns.astype(np.float64)
    dur = frame.op_dur_ns.astype(np.float64)
    end = start + dur
    pred = _predecessors(ri, start, end)
    lag = np.maximum(np.where(pred >= 0, start - end[np.maximum(pred, 0)], start), 0.0)
    inst_of = np.full(frame.n_ops, -1, np.int64)
    comm = frame.op_kind != COMPUTE
    inst_of[comm] = feats.inst.copy_inst
    origin = _origins(frame, skew_ns)
    end += origin[ri]
    key = end.copy()
    if comm.any():
        inst_end = np.full(feats.inst.transfer_s.size, -np.inf)
        np.maximum.at(inst_end, inst_of[comm], end[comm])
        key[comm] = inst_end[inst_of[comm]]
    n_win = max(frame.n_ops // max(frame.n_ranks, _MIN_WINDOW), 1)
    low, high = (float(key.min()), float(key.max())) if key.size else (0.0, 0.0)
    win = ((key - low) * (n_win / (high - low + 1.0))).astype(np.int64)
    # one sort: by window, compute (-1) before copies, copies by instance
    perm = np.argsort(win * (feats.inst.transfer_s.size + 1) + inst_of + 1, kind="stable")
    pos = np.empty(frame.n_ops, np.int64)
    pos[perm] = np.arange(frame.n_ops)
    pred_perm = pred[perm]
    pred_p = np.where(pred_perm >= 0, pos[np.maximum(pred_perm, 0)], -1)
    inst_p = inst_of[perm]
    cuts = np.r_[0, np.flatnonzero(np.diff(win[perm])) + 1, frame.n_ops]
    windows = []
    for lo, hi in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        k = lo + int(np.searchsorted(inst_p[lo:hi] >= 0, True))  # compute ops come first
        windows.append((lo, hi, _Copies.of(inst_p[k:hi], k)))
    at = np.flatnonzero(inst_p >= 0)
    copies = _Copies.of(inst_p[at], at)
    # each instance's copies lie together (they share a window): its last member's start
    # by one reduce over them, and each copy's tail from the end the model gives it
    tail = np.zeros(frame.n_ops)
    if at.size:
        end_p = end[perm][at]
        last = np.maximum.reduceat(end_p - dur[perm][at], copies.heads)
        modelled = np.maximum(last, arrival_ns[copies.inst]) + transfer_s[copies.inst] * 1e9
        tail[perm[at]] = end_p - np.repeat(modelled, copies.width)
    return _Timeline(ri, dur, lag, end, origin, inst_of, tail, perm, pred_p, windows, copies)


def replay(frame: StepFrame, line: _Timeline, change: _Change) -> np.ndarray:
    """(R,) each rank's span (ns) when its step (`line`, as it ran) is re-run with `change`
    (module docstring).

    The ops are settled in the order they ended as the step ran (`timeline`): an op waits
    only on ops that ended before it did (its predecessor, an instance's members' arrivals),
    so each window settles in a few rounds on windows already settled. Relaxing every op at
    once instead moves a change one dependency per round, and a pipeline's fill and drain
    chains hundreds of them: at 1,024 GPUs (eight stages) 110 rounds left the what-if
    unsettled by up to 250 ms and priced a slow GPU at a third of its cost. A last pass over
    all ops settles what the order got wrong (node clocks that disagree)."""
    ri, dur, lag0, end, perm = line.ri, line.dur, line.lag, line.end, line.perm
    origin = line.origin if change.origin is None else change.origin
    arrival = _followed_arrival(ri, end, dur * (1.0 - change.dur) + lag0 * (1.0 - change.lag),
                                line.origin - origin, change.arrival_ns, change.follow)
    # (a compute op's tail is 0 whatever its index reads)
    tail = line.tail if change.cut_tails is None else np.where(
        change.cut_tails[np.maximum(line.inst, 0)], 0.0, line.tail)
    step = _Relax(line.pred_p, origin[ri[perm]], (lag0 * change.lag)[perm],
                  (dur * change.dur)[perm], arrival, change.transfer_s * 1e9, tail[perm],
                  end[perm])
    rounds = 2 * int(np.diff(frame.off).max(initial=0)) + 8
    for lo, hi, copies in line.windows:
        step.settle(slice(lo, hi), copies, rounds)
    step.settle(slice(0, frame.n_ops), line.copies, rounds)
    new_end = np.empty(frame.n_ops)
    new_end[perm] = step.new_end
    tail = (frame.t_end_ns - frame.t_start_ns).astype(np.float64)
    # a rank without ops ends where it began
    last_actual = np.maximum(line.origin, rank_max(frame, end))
    last_new = np.maximum(origin, rank_max(frame, new_end))
    return np.maximum(tail - (last_actual - line.origin), 0.0) + last_new - origin


@dataclass(slots=True)
class _Relax:
    """The replay's ops in settling order and their ends so far (`new_end`, ns on the
    replay's clock): an op starts at its predecessor's end (or its rank's origin) plus its
    lag and lasts its duration; an instance's copies all end at its last member's start (or
    its untraced members' arrival) plus its transfer, each plus its own tail."""

    pred: np.ndarray  # (N,) position of the op each op follows on its rank (-1: none)
    first: np.ndarray  # (N,) when the op's rank begins the step
    lag: np.ndarray  # (N,)
    dur: np.ndarray  # (N,)
    arrival: np.ndarray  # (I,)
    transfer_ns: np.ndarray  # (I,)
    tail: np.ndarray  # (N,)
    new_end: np.ndarray  # (N,)

    def settle(self, ops: slice, copies: _Copies, rounds: int) -> None:
        """Relax the ops at positions `ops` (every copy of an instance among them, at
        `copies`) until none moves by 1 µs, at most `rounds` times."""
        pred = self.pred[ops]
        has = pred >= 0
        pred = np.maximum(pred, 0)
        first, lag, dur, tail = self.first[ops], self.lag[ops], self.dur[ops], self.tail[ops]
        at = copies.at - ops.start  # relative to the window
        grouped = slice(at, None) if isinstance(at, int) else at
        arrival, transfer = self.arrival[copies.inst], self.transfer_ns[copies.inst]
        for _ in range(rounds):
            s = np.where(has, self.new_end[pred], first) + lag
            e = s + dur
            if copies.heads.size:
                last = np.maximum(np.maximum.reduceat(s[grouped], copies.heads), arrival)
                e[grouped] = np.maximum(np.repeat(last + transfer, copies.width) + tail[grouped],
                                        s[grouped])
            moved = float(np.max(np.abs(e - self.new_end[ops]))) if e.size else 0.0
            self.new_end[ops] = e
            if moved < _CONVERGED_NS:
                return


def _followed_arrival(
    ri: np.ndarray, end: np.ndarray, saved: np.ndarray, earlier: np.ndarray,
    arrival: np.ndarray, ranks: np.ndarray | None,
) -> np.ndarray:
    """(I,) `arrival` (untraced members' set arrivals, on the replay's clock), each less how
    far ahead the culprit's `ranks` are without their excess by then: how much earlier they
    began the step (`earlier`, per rank) and the time `saved` (per op) on their ops that
    ended before it. Their own excess only, not their ends in the replay: those wait on the
    very arrivals being moved. As it is without `ranks`."""
    if ranks is None or ranks.size == 0:
        return arrival
    late = np.flatnonzero(np.isfinite(arrival))
    ops = np.flatnonzero(np.isin(ri, ranks)) if late.size else np.zeros(0, np.int64)
    if ops.size == 0:
        return arrival
    ops = ops[np.argsort(end[ops], kind="stable")]
    k = np.searchsorted(end[ops], arrival[late], side="right") - 1
    ahead = np.cumsum(saved[ops])[np.maximum(k, 0)] + earlier[ri[ops[np.maximum(k, 0)]]]
    ahead = np.where(k >= 0, ahead, float(np.median(earlier[ranks])))
    out = arrival.copy()
    out[late] -= np.maximum(ahead, 0.0)
    return out


def _origins(frame: StepFrame, skew_ns: np.ndarray | None = None) -> np.ndarray:
    """(R,) when each rank began the step, from the first rank's start (ns), on one clock:
    each node's stamps less its clock's offset (`clocks`; none: taken as agreeing).
    Ranks begin a step when their last one ended, which differs by pipeline stage."""
    if frame.n_ranks == 0:
        return np.zeros(0)
    start = (frame.t_start_ns - frame.t_start_ns.min()).astype(np.float64)
    if skew_ns is not None and skew_ns.size:
        start = start - skew_ns[frame.node]
    return start - start.min()


def _predecessors(ri: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """(N,) the op of the same rank that ended last at or before each op started (-1: none).

    One sorted search over (rank, end) keys: ops that overlap an op are not its
    predecessors, so async work stays async in the replay."""
    n = start.size
    if n == 0:
        return np.zeros(0, np.int64)
    width = float(max(end.max(), start.max())) + 1.0
    key_end = ri * width + end
    order = np.argsort(key_end, kind="stable")
    sorted_keys = key_end[order]
    pos = np.searchsorted(sorted_keys, ri * width + start, side="right") - 1
    idx = np.arange(n)
    # an op of zero length ends where it starts: it is not its own predecessor
    self_hit = (pos >= 0) & (order[np.maximum(pos, 0)] == idx)
    pos = np.where(self_hit, pos - 1, pos)
    cand = order[np.maximum(pos, 0)]
    ok = (pos >= 0) & (ri[cand] == ri) & (cand != idx)
    return np.where(ok, cand, -1)
