"""Network suspects: the NIC (node), pipeline link (node pair) or switch behind slow transfers.

A collective instance's shortest copy is its transfer (`features.Instances`); each is compared
with the instances of the same signature (kind, op, bytes, members, cross-node) in the SAME
step, so a job-wide slowdown cancels; where a step has too few of a signature, with the
instance's own past too (`transfer_history`, `OwnPast`). Every network entity (a node's NIC,
a p2p node pair, a leaf switch when the job start told us the topology) touches some
instances; the entity whose instances are slow AND that explains most of the slow instances
wins, its instances are explained away, and the rest is searched again (a few rounds, for
concurrent faults). A switch is judged only by the instances that can tell it apart: not by
those whose every same-step peer crosses it too (`_blind_to`).

A step that at least doubled is a burst (`burst_of`): a flapping NIC stalls what is in
flight for a second, yet on a loaded host each stalled transfer is only a few σ of the
noise and the entity's transfers outside the burst were on time. The first entity found
then shares the step's own significance, in the share of its lost seconds that the
entity's transfers carry as their data arrived (`_burst_carrier`, `p2p.delivered`).

Four nodes of one rank each, one all-reduce per pair of nodes; every transfer through node n3
takes 40 ms instead of 10 ms:

>>> from detectors.features import step_features
>>> from detectors.testing import frame_of, rank_step
>>> pairs = [(0, 1), (2, 3), (0, 2), (1, 3), (0, 3), (1, 2)]
>>> def ops(r):
...     mine = [(f"dp.{a}{b}", 40.0 if 3 in (a, b) else 10.0) for a, b in pairs if r in (a, b)]
...     return [("coll", "all_reduce", g, 1, 50.0 * i, d, 1 << 20) for i, (g, d) in enumerate(mine)]
>>> frame = frame_of([rank_step(r, f"n{r}", 0, ops(r)) for r in range(4)])
>>> feats = step_features(frame)
>>> ref = transfer_reference(feats.inst)
>>> (ref * 1e3).round(1).tolist()
[10.0, 10.0, 10.0, 10.0, 10.0, 10.0]
>>> out = Candidates()
>>> network_suspects(frame, feats, Topology(), ref, out)
>>> out.entity, out.kind, out.detail
(['node:n3'], ['link'], ['transfers ×4.00 on 3 of 3 instances'])
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from detectors.candidates import Z_REPORT, Candidates
from detectors.features import Instances, StepFeatures
from detectors.p2p import delivered
from detectors.segments import grouped_quantile, int_codes, unique_ints
from schemas.frame import StepFrame
from schemas.rankstep import P2P

REF_QUANTILE = 0.25  # the reference transfer: the lower quartile (see `transfer_reference`)
# For Gaussian noise the 10th percentile lies Φ⁻¹(0.10) − Φ⁻¹(0.25) = −1.2816 + 0.6745 ≈ −0.607σ
# below the lower quartile, so the healthy side alone gives σ even when most are slow.
_Q10_BELOW_Q25 = 0.607
_NET_SIGMA_FLOOR = 0.03  # healthy transfers jitter ≈3% (as the simulator's Noise.net_jitter)
_NET_MIN_RATIO = np.log(1.1)  # a transfer 10% over its peers is the smallest we blame
_NET_ROUNDS = 3  # entities found per step at most: concurrent faults, not every bystander
_NODE_TIE = 0.95  # a node within 5% of the best one's score is a tie
_OVER_TOP = 2.0  # twice the slowest transfer of its own past is new whatever its spread
_MAD_TO_SIGMA = 1.4826
_BURST_Z_CLIP = 10.0  # a doubled step's significance, as far as one step may weigh
_BURST_TIE = 0.9  # another node that lost this share of a burst's seconds too is a tie
# a burst's entity stands out by this many σ on its own (a congested spine doubles a step
# with every entity's transfers alike: none stands out, none shares the step's significance)
_BURST_MIN_Z = 1.0
_ONE_RANK_SHARE = 2 / 3  # one rank carrying this share of a NIC's slow excess may be its own


@dataclass(slots=True)
class Topology:
    """What the job's start event told us: each node's switch (may be empty)."""

    switch_of: dict[str, str] = field(default_factory=dict)
    nodes: tuple[str, ...] = ()  # every node of the job, reporting or not (may be empty)
    group_size: dict[str, int] = field(default_factory=dict)  # members per group kind (layout)
    world: int = 0  # ranks in the job (start event); fewer reporting means partial tracing


@dataclass(frozen=True, slots=True)
class Burst:
    """A step that at least doubled (`burst_of`): how far beyond the job's step-time noise
    it is (σ, clipped) and the seconds it lost against the usual step."""

    z: float
    lost_s: float


def burst_of(step_s: float, usual_s: float, z: float) -> Burst | None:
    """The step as a burst if it took at least twice the usual step, else None.

    A flapping NIC's burst stalls a step many times over, yet its transfers are only a few
    σ of a loaded host's noise (sub-millisecond sends vary ×3 there), and those of the
    entity that were not in flight during the burst dilute its score. The step itself is
    the stronger witness: the network entity whose slow transfers carry its lost seconds
    shares its significance (`network_suspects`). A checkpoint or eval step doubles a step
    too, but it stretches some rank's compute or waits, never a transfer."""
    if not (step_s >= 2 * usual_s > 0):
        return None
    return Burst(min(z, _BURST_Z_CLIP), step_s - usual_s)


@dataclass(slots=True)
class OwnPast:
    """(I,) arrays: each instance's usual transfer, log-space noise and slowest transfer by
    its own past (`transfer_history.TransferHistory`); NaN where it has too little past."""

    ref: np.ndarray
    sigma: np.ndarray
    top: np.ndarray

    def slow(self, transfer_s: np.ndarray) -> np.ndarray:
        """(I,) bool: slower than its own past allows (`slow_against_past`)."""
        return slow_against_past(transfer_s, self.ref, self.sigma, self.top)

    def new(self, transfer_s: np.ndarray) -> np.ndarray:
        """(I,) bool: twice its slowest past transfer (`new_against_past`)."""
        return new_against_past(transfer_s, self.top)

    def or_else(self, other: OwnPast) -> OwnPast:
        """This past where it has one, else `other`'s (its signature's, `signature_history`)."""
        mine = np.isfinite(self.ref) & (self.ref > 0)
        return OwnPast(*(np.where(mine, a, b) for a, b in (
            (self.ref, other.ref), (self.sigma, other.sigma), (self.top, other.top))))


def summarize_past(past: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n,) usual, log-space noise and slowest of each row of `past` (n, depth): transfers
    remembered, NaN where none (`transfer_history`, `signature_history`). The usual is the
    median, the noise the MAD in log space as a σ."""
    logs = np.log(np.maximum(past, 1e-12))
    mid = np.nanmedian(logs, axis=1)
    sigma = _MAD_TO_SIGMA * np.nanmedian(np.abs(logs - mid[:, None]), axis=1)
    return np.exp(mid), sigma, np.nanmax(past, axis=1)


def slow_against_past(transfer_s: np.ndarray, usual: np.ndarray, sigma: np.ndarray,
                      top: np.ndarray) -> np.ndarray:
    """(n,) bool: slower than a past (its usual, log-space noise and slowest; NaN: none)
    allows: over its slowest and 3σ over its usual (10% at least), or `new_against_past`."""
    known = np.isfinite(usual) & (usual > 0)
    ell = np.log(np.maximum(transfer_s, 1e-12) / np.where(known, usual, 1.0))
    bar = np.maximum(3 * np.maximum(np.nan_to_num(sigma), _NET_SIGMA_FLOOR), _NET_MIN_RATIO)
    over_top = transfer_s > np.nan_to_num(top, nan=np.inf)
    return known & ((ell > bar) & over_top | new_against_past(transfer_s, top))


def new_against_past(transfer_s: np.ndarray, top: np.ndarray) -> np.ndarray:
    """(n,) bool: twice the slowest of its past (NaN: none), whatever its spread: a small
    transfer's past on a busy host is bimodal (0.2 ms, or a few ms when its thread was
    descheduled), its MAD ×6, and only this says that 270 ms is a fault."""
    return transfer_s > _OVER_TOP * np.nan_to_num(top, nan=np.inf)


def layout_sizes(groups: list[str], group_size: dict[str, int]) -> np.ndarray:
    """(G,) members the job's layout gives each group (by its kind, `tp.3` → `tp`; a pipeline
    pair has 2; 0 when the layout does not say). Fewer traced is partial tracing."""
    kinds = [g.partition(".")[0] for g in groups]
    return np.array([2 if k == "pp" else group_size.get(k, 0) for k in kinds], dtype=np.int64)


def short_of_members(groups: list[str], group: np.ndarray, n_copies: np.ndarray,
                     group_size: dict[str, int]) -> np.ndarray:
    """(I,) bool: the instance (its group code, its traced copies) has fewer copies than the
    layout gives its group members (`layout_sizes`): partial tracing."""
    return n_copies < layout_sizes(groups, group_size)[group]


def transfer_reference(inst: Instances) -> np.ndarray:
    """(I,) normal transfer of comparable instances (same kind, op, bytes, size, cross-node)
    in this step; NaN where fewer than three are comparable.

    The lower quartile, not the median: a congested switch under half of the nodes slows
    half of the instances of every signature, and the reference must stay healthy.
    """
    return reference_and_peers(inst)[0]


def one_link(frame: StepFrame, topo: Topology) -> bool:
    """Whether every transfer across nodes crosses the same link: a job of two nodes. Its
    NICs and the path between them slow the same transfers, and the step's other transfers
    across nodes are no reference (they cross it too)."""
    return len(frame.nodes) == 2 and len(topo.nodes) <= 2


def reference_and_peers(inst: Instances, single_link: bool = False
                        ) -> tuple[np.ndarray, np.ndarray]:
    """`transfer_reference`, and (I,) how many instances of each one's signature the step
    ran (itself included; 0 for one that is not comparable: within one node, or seen from
    one copy). On a `single_link` (`one_link`) each is alone: no reference, a count of 1,
    judged by its own past only."""
    ref = np.full(inst.transfer_s.size, np.nan)
    count = np.zeros(inst.transfer_s.size, dtype=np.int64)
    idx = np.flatnonzero(inst.cross_node & (inst.n_copies >= 2))
    if idx.size == 0:
        return ref, count
    if single_link:
        count[idx] = 1
        return ref, count
    sig, n_sig = signatures(inst, idx)
    count[idx] = np.bincount(sig, minlength=n_sig)[sig]
    ok = count[idx] >= 3
    if ok.any():
        med = grouped_quantile(inst.transfer_s[idx], sig, n_sig, REF_QUANTILE)
        ref[idx[ok]] = med[sig[ok]]
    return ref, count


def signatures(inst: Instances, idx: np.ndarray) -> tuple[np.ndarray, int]:
    """The signature code of each instance `idx` names (kind, op, bytes, copies), and how
    many there are."""
    _, bcode = int_codes(inst.bytes[idx])
    n_names = int(inst.name[idx].max()) + 1
    key = (inst.kind[idx].astype(np.int64) * n_names + inst.name[idx]) * (int(bcode.max()) + 1)
    key = (key + bcode) * (1 << 24) + np.minimum(inst.n_copies[idx], (1 << 24) - 1)
    _, sig = int_codes(key)
    return sig, int(sig.max()) + 1


def step_excess(transfer_s: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, float]:
    """(n,) each transfer's log excess over its same-step reference (NaN where it has none)
    and their pooled noise σ (never under the floor).

    Noise from the healthy side only: ℓ is relative to each signature's lower quartile, so
    the pooled 10th percentile sits at ≈ -0.607σ even when most instances are slow."""
    has = np.isfinite(ref) & (ref > 0)
    ell = np.where(has, np.log(np.maximum(transfer_s, 1e-12) / np.where(has, ref, 1.0)), np.nan)
    s_pool = float(-np.quantile(ell[has], 0.10)) / _Q10_BELOW_Q25 if has.sum() >= 3 else 0.0
    return ell, max(s_pool, _NET_SIGMA_FLOOR)


def slow_within_step(transfer_s: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """(n,) bool: slower than its step's peers allow (`step_excess`: 3σ, and 10% at least;
    False without a same-step reference)."""
    return _over_step_bar(*step_excess(transfer_s, ref))


def _over_step_bar(ell: np.ndarray, s_pool: float) -> np.ndarray:
    return np.nan_to_num(ell, nan=0.0) > max(3 * s_pool, _NET_MIN_RATIO)


def network_suspects(
    frame: StepFrame,
    feats: StepFeatures,
    topo: Topology,
    full_ref: np.ndarray,
    out: Candidates,
    own: OwnPast | None = None,
    burst: Burst | None = None,
    clocks_ns: np.ndarray | None = None,
    usual_signature: np.ndarray | None = None,
) -> None:
    """Add the step's `link` (NIC or node pair) and `switch` suspects to `out`; `full_ref` is
    `transfer_reference(feats.inst)`, `own` each instance's own past
    (`TransferHistory.reference`), `burst` the step if it at least doubled (`burst_of`): the
    first entity found, if it stands out by a σ at least (`_BURST_MIN_Z`), is then as
    significant as the step, in the share of its lost seconds that its slow transfers carry
    (read on `clocks_ns`, the nodes' clocks as the healthy steps showed them, when known);
    `usual_signature` (I,) whether each instance's signature ran its usual this step
    (`signature_history`).

    An instance its step cannot compare is judged by its own past alone; one with both must
    be slow against both (few peers make the step's comparison fragile, and a job-wide
    slowdown makes every instance slow against its past). `out` holds the step's compute
    and host suspects already: a NIC or link whose slow transfers are one such rank's own is
    that rank's (`_one_ranks_own`), and is not named."""
    inst = feats.inst
    nan = np.full(inst.transfer_s.size, np.nan)
    own = own if own is not None else OwnPast(nan, nan, nan)
    suspect_ranks = _rank_suspects(frame, out)
    in_step = np.isfinite(full_ref) & (full_ref > 0)
    has_own = np.isfinite(own.ref) & (own.ref > 0)
    idx = np.flatnonzero(in_step | has_own)
    if idx.size < 3:
        return
    in_step, has_own = in_step[idx], has_own[idx]
    t = inst.transfer_s[idx]
    ell_step, s_pool = step_excess(t, full_ref[idx])
    ell_own = np.log(np.maximum(t, 1e-12) / np.where(has_own, own.ref[idx], np.nan))
    s_own = np.maximum(np.nan_to_num(own.sigma[idx], nan=0.0), _NET_SIGMA_FLOOR)
    slow_step = ~in_step | _over_step_bar(ell_step, s_pool)
    slow_own = ~has_own | own.slow(inst.transfer_s)[idx]
    ell = np.fmin(ell_step, ell_own)  # the smaller excess of the two views
    e = np.where(slow_step & slow_own, ell, 0.0)
    # significance in the units of the view that judged it: the step's, else its own past's
    s_each = np.where(in_step, s_pool, s_own)
    if not e.any():
        return
    ref = inst.transfer_s[idx] / np.exp(ell)
    extra_s = np.where(e > 0, inst.transfer_s[idx] - ref, 0.0)
    # incidence of usable instances with nodes (through their copies)
    pos = np.full(inst.transfer_s.size, -1)
    pos[idx] = np.arange(idx.size)
    c_pos = pos[inst.copy_inst]
    keep = c_pos >= 0
    c_pos = c_pos[keep]
    c_rank = inst.copy_rank[keep]
    c_node = frame.node[c_rank]
    n_nodes = len(frame.nodes)
    pair = unique_ints(c_pos * n_nodes + c_node)
    p_inst, p_node = pair // n_nodes, pair % n_nodes
    rank_extra = np.bincount(c_rank, weights=extra_s[c_pos], minlength=frame.n_ranks)
    node_extra = np.zeros(n_nodes)
    np.maximum.at(node_extra, frame.node, rank_extra)

    # one incidence list (entity, instance) over every network entity: nodes, links, switches
    ent_names: list[str] = []
    ent_kinds: list[str] = []
    ent_nodes: list[np.ndarray] = []
    ent_what: list[str] = []  # what its instances are, as its detail quotes them
    inc_ent: list[np.ndarray] = []
    inc_inst: list[np.ndarray] = []
    used_nodes = np.flatnonzero(np.bincount(p_node, minlength=n_nodes))
    node_eid = np.full(n_nodes, -1)
    node_eid[used_nodes] = np.arange(used_nodes.size)
    for n in used_nodes:
        ent_names.append(f"node:{frame.nodes[n]}")
        ent_kinds.append("link")
        ent_nodes.append(np.array([n]))
        ent_what.append("transfers")
    inc_ent.append(node_eid[p_node])
    inc_inst.append(p_inst)
    single = one_link(frame, topo)
    if not single:
        _add_egress(frame, inst.copy_rank_at(inst.send_copy[idx]),
                    inst.copy_rank_at(inst.recv_copy[idx]), ent_names, ent_kinds,
                    ent_nodes, ent_what, inc_ent, inc_inst)
    # a pair of nodes is an entity of its own for its p2p transfers (a pipeline link), and,
    # in a job of two nodes, for every transfer across them (the only link there is)
    p2p = (inst.kind[idx] == P2P) | single
    if p2p.any():
        # each instance's lowest and highest node, from its (instance, node) pairs, which
        # are sorted: the first and last of each instance's run (ufunc.at over every copy
        # was 4% of a 16,384-GPU worker)
        lo = np.full(idx.size, n_nodes)
        hi = np.full(idx.size, -1)
        if pair.size:
            starts = np.r_[True, p_inst[1:] != p_inst[:-1]]
            ends = np.r_[starts[1:], True]
            lo[p_inst[starts]] = p_node[starts]
            hi[p_inst[ends]] = p_node[ends]
        two = np.flatnonzero(p2p & (lo != hi) & (hi >= 0))
        keys, link_of = np.unique(lo[two] * n_nodes + hi[two], return_inverse=True)
        base = len(ent_names)
        for k in keys:
            a, b = divmod(int(k), n_nodes)
            ent_names.append("link:" + "~".join(sorted((frame.nodes[a], frame.nodes[b]))))
            ent_kinds.append("link")
            ent_nodes.append(np.array([a, b]))
            ent_what.append("transfers")
        inc_ent.append(base + link_of.reshape(-1))
        inc_inst.append(two)
    if topo.switch_of:
        sw_names = sorted({topo.switch_of.get(nm, "") for nm in frame.nodes} - {""})
        if len(sw_names) >= 2:
            sw_index = {s: i for i, s in enumerate(sw_names)}
            node_sw = np.array([sw_index.get(topo.switch_of.get(nm, ""), -1) for nm in frame.nodes])
            psw = node_sw[p_node]
            has = psw >= 0
            sw_pair = unique_ints(p_inst[has] * len(sw_names) + psw[has])
            base = len(ent_names)
            for s, sname in enumerate(sw_names):
                ent_names.append(f"switch:{sname}")
                ent_kinds.append("switch")
                ent_nodes.append(np.flatnonzero(node_sw == s))
                ent_what.append("transfers")
            inc_ent.append(base + sw_pair % len(sw_names))
            inc_inst.append(sw_pair // len(sw_names))
    ie = np.concatenate(inc_ent)
    ii = np.concatenate(inc_inst)
    n_ent = len(ent_names)
    cnt = np.bincount(ie, minlength=n_ent).astype(float)
    # a switch is judged by the instances that can tell it apart (`_blind_to`)
    on_switch = np.array([k == "switch" for k in ent_kinds])[ie]
    seen = np.ones(ie.size, dtype=bool)
    if on_switch.any():
        usual = (usual_signature[idx] if usual_signature is not None
                 else np.zeros(idx.size, dtype=bool))
        seen[on_switch] = ~_blind_to(inst, idx, in_step & ~usual, ie[on_switch], ii[on_switch],
                                     n_ent)
    cnt_seen = np.bincount(ie, weights=seen, minlength=n_ent)
    refuted = np.zeros(n_ent, dtype=bool)
    if frame.n_ranks < topo.world:
        refuted = _refuted_by_complete(frame, inst, idx, e, ie[seen], ii[seen],
                                       topo.group_size, n_ent)
    e_left = e.copy()
    for round_no in range(_NET_ROUNDS):
        total = e_left.sum()
        if total <= 0:
            break
        sums = np.bincount(ie, weights=e_left[ii], minlength=n_ent)
        sums_seen = np.bincount(ie, weights=e_left[ii] * seen, minlength=n_ent)
        s_in = sums_seen / np.maximum(cnt_seen, 1)
        # specificity: instances that do not touch the entity must be faster, else the
        # slowdown is everywhere (job-wide) and no single entity is to blame
        s_out = (total - sums) / np.maximum(idx.size - cnt, 1)
        score = np.where(cnt_seen > 0, np.maximum(s_in - s_out, 0.0) * sums_seen / total, 0.0)
        score[refuted] = 0.0
        best = int(np.argmax(score))
        z = score[best] / float(np.median(s_each[ii[ie == best]]))
        share = 0.0  # of a burst's lost seconds that `best` carries, alone
        if burst is not None and round_no == 0 and z >= _BURST_MIN_Z:
            extra = _delivered_extra(frame, inst, idx, ref, s_pool, ie, ii, n_ent, clocks_ns)
            best, share = _burst_carrier(best, extra, ent_kinds, ent_nodes, burst.lost_s)
            z = max(z, burst.z * share)
        if z < Z_REPORT:
            break
        if share == 0.0 and ent_kinds[best] == "link" and ent_nodes[best].size == 1:
            twins = _same_slow_instances(best, e_left, ie, ii, ent_kinds, ent_nodes)
            best = _disambiguate_node(best, score, ent_kinds, ent_nodes, twins, single)
            if best < 0:
                break  # several nodes explain it equally and no switch holds them all
        ids = ii[ie == best]
        if ent_kinds[best] == "link" and suspect_ranks.any():
            own_rank = _one_ranks_own(ids, ent_nodes[best], e_left, ell, c_pos, c_rank,
                                      c_node, frame.n_ranks)
            if own_rank >= 0 and suspect_ranks[own_rank]:  # its process, not the network
                e_left[np.unique(c_pos[c_rank == own_rank])] = 0.0
                continue
        shown = ii[(ie == best) & seen]  # quoted: the instances that could tell it apart
        if not (e_left[shown] > 0).any():
            shown = ids
        slow = e_left[shown] > 0
        ratio = float(np.exp(e_left[shown][slow].mean()))
        out.add(
            ent_names[best],
            ent_kinds[best],
            z,
            float(node_extra[ent_nodes[best]].max()),
            f"{ent_what[best]} ×{ratio:.2f} on {int(slow.sum())} of {shown.size} instances",
        )
        e_left[ids] = 0.0


def _add_egress(
    frame: StepFrame,
    send_rank: np.ndarray,
    recv_rank: np.ndarray,
    names: list[str],
    kinds: list[str],
    nodes: list[np.ndarray],
    what: list[str],
    inc_ent: list[np.ndarray],
    inc_inst: list[np.ndarray],
) -> None:
    """Add each node's NIC as the sender of its pipeline transfers alone, when they go to
    two nodes or more: an entity named as the NIC (`node:<name>`, kind `link`).

    A NIC slow one way (a rate limit holds its egress, as a drill's does) delays the data
    it sends and nothing it receives. Its all-reduces' shortest copies are its own, on time
    (`oneway_nic` in the simulator), so only its pipeline sends are slow, and spread over
    every transfer through it they read a fraction of their excess: a ÷1.5 NIC of an
    8,192-GPU job sat at z 3.5 on every step and never opened. Its sends alone read whole.
    A node whose sends all go to one node is left out: its egress and that node's ingress
    slow the same transfers, and the link between them is as far as the data goes.

    `send_rank`, `recv_rank`: (n,) the usable instances' send and recv copy's rank (-1:
    none)."""
    at = np.flatnonzero((send_rank >= 0) & (recv_rank >= 0))
    sender, to = frame.node[send_rank[at]], frame.node[recv_rank[at]]
    across = sender != to
    at, sender, to = at[across], sender[across], to[across]
    if at.size == 0:
        return
    n_nodes = len(frame.nodes)
    route = unique_ints(sender.astype(np.int64) * n_nodes + to)
    fan_out = np.bincount(route // n_nodes, minlength=n_nodes)
    keep = fan_out[sender] >= 2
    if not keep.any():
        return
    senders, code = np.unique(sender[keep], return_inverse=True)
    base = len(names)
    for n in senders:
        names.append(f"node:{frame.nodes[n]}")
        kinds.append("link")
        nodes.append(np.array([n]))
        what.append("outgoing pipeline transfers")
    inc_ent.append(base + code.reshape(-1))
    inc_inst.append(at[keep])


def _rank_suspects(frame: StepFrame, out: Candidates) -> np.ndarray:
    """(R,) bool: the ranks already suspects of this step for their compute or their gaps."""
    named = {int(e[5:]) for e, k, z in zip(out.entity, out.kind, out.z, strict=True)
             if k in ("gpu", "host") and e.startswith("rank:") and z >= Z_REPORT}
    return np.isin(frame.rank, np.fromiter(named, dtype=np.int64, count=len(named)))


def _one_ranks_own(
    ids: np.ndarray,
    nodes: np.ndarray,
    e: np.ndarray,
    ell: np.ndarray,
    c_pos: np.ndarray,
    c_rank: np.ndarray,
    c_node: np.ndarray,
    n_ranks: int,
) -> int:
    """The one rank (index) whose own transfers are a NIC's or a link's slow ones, or -1.

    A NIC or a link between nodes slows every transfer through it, whichever rank of the
    node sends it. When one rank on the entity's nodes carries most of its slow excess
    (`e`, `_ONE_RANK_SHARE`) and its transfers through the entity are slow at the median
    (log excess `ell`), while those of the node's other ranks through the same entity run
    near their usual (median under half the rank's), the bytes were slow in that rank's own
    process: gloo, or NCCL's proxy thread, moves them on the rank's CPU. A drill's rank held
    to a tenth of a core sent ×9 slower through a NIC its node partner used at full speed,
    and the NIC opened instead of the rank. At least two transfers of other ranks through
    the entity are needed. The caller takes the rank only when it is a suspect of the step
    itself (its compute or its gaps), which then tells what it is: a flapping NIC's burst
    may catch one rank's transfers in flight and not its partner's.

    >>> e = np.array([0.8, 0.9, 0.0, 0.0]); ell = np.array([0.8, 0.9, 0.01, -0.02])
    >>> c_pos, c_rank, c_node = np.arange(4), np.array([0, 0, 1, 1]), np.zeros(4, int)
    >>> _one_ranks_own(np.arange(4), np.array([0]), e, ell, c_pos, c_rank, c_node, 2)
    0
    >>> ell[2:] = 0.6  # its partner's transfers are slow too, under the bar: the NIC
    >>> _one_ranks_own(np.arange(4), np.array([0]), e, ell, c_pos, c_rank, c_node, 2)
    -1
    """
    on = np.zeros(e.size, dtype=bool)
    on[ids] = True
    mine = on[c_pos] & np.isin(c_node, nodes)
    pair = unique_ints(c_rank[mine] * e.size + c_pos[mine])  # (rank, instance), once each
    rank, pos = pair // e.size, pair % e.size
    excess = np.bincount(rank, weights=e[pos], minlength=n_ranks)
    r = int(np.argmax(excess))
    total = float(e[ids].sum())
    if total <= 0 or excess[r] < _ONE_RANK_SHARE * total:
        return -1
    own = ell[pos[rank == r]]
    others = ell[np.setdiff1d(ids, pos[rank == r])]
    own, others = own[np.isfinite(own)], others[np.isfinite(others)]
    if own.size == 0 or others.size < 2:
        return -1
    own_median = float(np.median(own))
    if own_median < _NET_MIN_RATIO or float(np.median(others)) >= 0.5 * own_median:
        return -1
    return r


def _blind_to(
    inst: Instances,
    idx: np.ndarray,
    in_step: np.ndarray,
    ie: np.ndarray,
    ii: np.ndarray,
    n_ent: int,
) -> np.ndarray:
    """(incidences,) bool: the instance, judged against its step's peers, says nothing of
    the entity because every one of those peers touches it too.

    Its reference then runs through the entity itself. A leaf switch that holds a whole
    pipeline stage carries every pipeline transfer and slows them alike, so they read as on
    time; counted as the switch's fast instances they dilute its slow all-reduces into the
    noise (a ×3 switch of a 32-GPU job scored z ≈ 4, and a job-wide shift opened first).
    Only a switch is spared them: a node's or a link's on-time instances keep counting
    against it, which is what prefers the narrowest entity when the step cannot tell (a
    slow pipeline link and the NIC of either end, whose stage's all-reduces all cross it).
    An instance judged by its own past is always seen, and so is one whose signature ran its
    usual this step (`signature_history`): were the entity slow, that usual would have moved
    with it. With one node's agent down, a stage's data-parallel all-reduces on time under
    leaf b were spared b, which then tied with the pipeline link its transfers crossed and
    was named for it."""
    blind = np.zeros(ie.size, dtype=bool)
    if not in_step.any():
        return blind
    sig, n_sig = signatures(inst, idx)
    peers = np.bincount(sig, weights=in_step, minlength=n_sig)
    key = ie.astype(np.int64) * n_sig + sig[ii]
    touching = np.bincount(key, weights=in_step[ii], minlength=n_ent * n_sig)
    return in_step[ii] & (touching[key] == peers[sig[ii]])


def _delivered_extra(
    frame: StepFrame,
    inst: Instances,
    idx: np.ndarray,
    ref: np.ndarray,
    s_pool: float,
    ie: np.ndarray,
    ii: np.ndarray,
    n_ent: int,
    clocks_ns: np.ndarray | None = None,
) -> np.ndarray:
    """(E,) each entity's extra transfer seconds in this step, over its instances, the data
    of buffered sends counted as their receivers saw it arrive (`p2p.delivered`, on
    `clocks_ns` when known).

    A burst stalls a buffered send's data, not its copy: the send returns at once and its
    receiver waits, so the shortest copies carry a fraction of what the step lost (a drill's
    burst lost 1.3 s, its slow copies 0.3 s). Only a burst step pays for this reading."""
    seen = delivered(frame, inst, clocks_ns)[0][idx]
    over = _over_step_bar(np.log(np.maximum(seen, 1e-12) / ref), s_pool)
    extra = np.where(over, seen - ref, 0.0)
    return np.bincount(ie, weights=extra[ii], minlength=n_ent)


def _burst_carrier(
    best: int,
    extra: np.ndarray,
    kinds: list[str],
    nodes: list[np.ndarray],
    lost_s: float,
) -> tuple[int, float]:
    """The entity that carries a burst's lost seconds, and the share it carries (0: none).

    `best` (the step's strongest network suspect) carries them unless a node outside it
    lost nearly as much (`_BURST_TIE`): the two ends of a pair's transfers lose the same
    seconds, and a millisecond of noise elsewhere must not pick between them. Two such ends
    name the pipeline link between them, if their transfers have one (the narrowest entity
    the burst supports, which `reconcile.nic_of` reads as its NIC when that NIC was a
    suspect just before). Otherwise no entity carries the burst, and `best` keeps its own
    significance (and the twins rule that goes with it)."""
    is_node = np.array([k == "link" and n.size == 1 for k, n in zip(kinds, nodes, strict=True)])
    node_of = np.array([n[0] if n.size == 1 else -1 for n in nodes])

    def rival(e: int) -> int:
        """The node outside entity `e` that lost the most, if nearly as much as `e`."""
        others = np.where(is_node & ~np.isin(node_of, nodes[e]), extra, -1.0)
        r = int(np.argmax(others))
        return r if extra[e] > 0 and others[r] >= _BURST_TIE * extra[e] else -1

    tied = rival(best)
    if tied >= 0:
        if not is_node[best]:
            return best, 0.0
        pair = {int(nodes[best][0]), int(nodes[tied][0])}
        links = [i for i, k in enumerate(kinds)
                 if k == "link" and nodes[i].size == 2 and set(nodes[i].tolist()) == pair]
        if not links or rival(links[0]) >= 0:
            return best, 0.0
        best = links[0]
    return best, min(float(extra[best]) / lost_s, 1.0)


def _refuted_by_complete(
    frame: StepFrame,
    inst: Instances,
    idx: np.ndarray,
    e: np.ndarray,
    ie: np.ndarray,
    ii: np.ndarray,
    group_size: dict[str, int],
    n_ent: int,
) -> np.ndarray:
    """(E,) bool: entities whose fully traced instances are mostly fast.

    With partial tracing an instance's shortest copy is its transfer only when its last
    arriver is seen. An untraced member that arrives late makes every traced copy long, which
    reads as a slow NIC of whichever traced node is on most such instances. A slow NIC or
    link slows every transfer through it, so the entity's instances with every member traced
    (a pipeline pair with both ends traced, a fully traced group) must be slow too: if most
    of them are fast, the slow incomplete ones were waits on an untraced member. An entity
    with no complete instance has nothing but such waits to show, and is not named either."""
    size = layout_sizes(frame.groups, group_size)
    complete = (inst.n_copies[idx] >= size[inst.group[idx]]).astype(float)
    n_complete = np.bincount(ie, weights=complete[ii], minlength=n_ent)
    n_slow = np.bincount(ie, weights=(complete * (e > 0))[ii], minlength=n_ent)
    return (n_complete == 0) | (n_slow < 0.5 * n_complete)


def _same_slow_instances(
    best: int,
    e: np.ndarray,
    ie: np.ndarray,
    ii: np.ndarray,
    kinds: list[str],
    nodes: list[np.ndarray],
) -> np.ndarray:
    """(E,) bool: the other nodes on every slow instance of node `best`, and on no other.

    The two ends of a data-parallel pair share their all-reduces: when only those are slow
    (a flapping NIC's burst that touched nothing else), the step cannot say which end's NIC
    it was. Their scores still differ, by the fast instances each has elsewhere, which says
    nothing about the slow ones; a drill named the wrong end that way."""
    slow = (e[ii] > 0)
    mine = np.zeros(e.size, dtype=bool)
    mine[ii[(ie == best) & slow]] = True
    on_mine = np.bincount(ie, weights=(mine[ii] & slow), minlength=len(kinds))
    on_any = np.bincount(ie, weights=slow, minlength=len(kinds))
    is_node = np.array([k == "link" and n.size == 1 for k, n in zip(kinds, nodes, strict=True)])
    n_mine = int(mine.sum())
    return is_node & (n_mine > 0) & (on_mine == n_mine) & (on_any == n_mine)


def _disambiguate_node(
    best: int,
    score: np.ndarray,
    kinds: list[str],
    nodes: list[np.ndarray],
    twins: np.ndarray,
    single_link: bool = False,
) -> int:
    """A node is blamed only if it stands out; nodes tied with it point to what they share.

    When several nodes explain the slow transfers equally (every dp group of a stage spans
    all its nodes, and all pipeline links are slow), no NIC is singled out: the smallest
    switch under which all of them sit is the suspect, or nobody. Nodes with exactly the
    same slow instances (`twins`, a pair's shared all-reduces) name nobody: a switch slows
    more than one pair's transfers.

    In a job of two nodes (`single_link`) the tie is the link between them: every transfer
    across nodes is on it, and which NIC of the two, or the path between, the transfers
    cannot tell. (In a larger job a pair's shared slow transfers may be either end's NIC:
    a flapping one's burst, whose next bursts show which.)
    """
    if single_link:
        pair = [i for i, k in enumerate(kinds) if k == "link" and nodes[i].size == 2]
        if pair:
            return max(pair, key=lambda i: score[i])
    # counted by node: a NIC is an entity twice, as all its transfers and as the sender of
    # its pipeline transfers (`_add_egress`)
    if len({int(nodes[i][0]) for i in np.flatnonzero(twins)}) > 1:
        return -1
    is_node = np.array([k == "link" and n.size == 1 for k, n in zip(kinds, nodes, strict=True)])
    tied_nodes = {int(nodes[i][0])
                  for i in np.flatnonzero(is_node & (score >= _NODE_TIE * score[best]))}
    if len(tied_nodes) <= 1:
        return best
    holders = [
        i for i, k in enumerate(kinds) if k == "switch" and tied_nodes <= set(nodes[i].tolist())
    ]
    if not holders:
        return -1
    return min(holders, key=lambda i: nodes[i].size)
