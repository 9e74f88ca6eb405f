"""Per-step suspects: which rank, node, host, link or switch explains this step's excess.

Three independent views of one step, each relative to peers in the SAME step so that job-wide
effects (GC, checkpoints, level shifts) cancel:
- compute: a rank's compute vs its stage peers; the node's median share is split off first,
  so one slow GPU and a slow node (all its GPUs) are told apart;
- host: idle gaps between ops vs stage peers (launch delays, CPU contention: GPU durations
  stay normal, the gaps grow);
- network: each instance's transfer (its shortest copy) vs instances of the same signature;
  the node, link or switch whose instances are slow AND that explains most of the slow
  instances wins, then its instances are explained away and the rest is searched again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from detectors.features import Instances, StepFeatures
from detectors.peers import replica_keys
from detectors.segments import (
    grouped_median,
    grouped_quantile,
    robust_sigma,
    robust_sigma_rows,
    unique_ints,
)
from schemas.frame import StepFrame
from schemas.rankstep import P2P

Z_REPORT = 2.5  # report a suspect's step evidence from this significance on
Z_CAP = 50.0  # one step never counts for more than this
_NET_MIN_RATIO = np.log(1.1)  # a transfer 10% over its peers is the smallest we blame
_NET_ROUNDS = 3
REF_QUANTILE = 0.25
_NET_SIGMA_FLOOR = 0.03
_NODE_TIE = 0.95  # a node within 5% of the best one's score is a tie


@dataclass(slots=True)
class Candidates:
    """Suspects of one step: parallel lists, one entry per (entity, kind)."""

    entity: list[str] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)
    z: list[float] = field(default_factory=list)
    excess_s: list[float] = field(default_factory=list)
    detail: list[str] = field(default_factory=list)

    def add(self, entity: str, kind: str, z: float, excess_s: float, detail: str = "") -> None:
        self.entity.append(entity)
        self.kind.append(kind)
        self.z.append(float(min(z, Z_CAP)))
        self.excess_s.append(float(excess_s))
        self.detail.append(detail)


SMALL_GROUP = 16  # up to this many values a step, each entity is left out of its own σ


class NoiseMemory:
    """Spread of each family's per-step values pooled over recent steps.

    A job with 8 nodes gives 8 values per step: their MAD alone is noisy enough to turn a
    data-dependent wobble into z > 8. Pooling the last `depth` steps gives a stable σ while
    still following slow changes; MAD keeps a persistent outlier among many peers from
    inflating it.

    Among few peers it does not: one slow rank of four is a quarter of the pool, pulls its
    median and widens its MAD, and so hides behind a σ it inflated itself (a 7× slow rank
    measured z ≈ 3.5 on an oversubscribed CPU and was never confirmed). So in groups of up
    to `SMALL_GROUP` values an entity is measured against the σ of the others' values
    (leave one out), as a peer comparison means; larger groups use the whole pool, where one
    entity's share is too small to matter and the per-entity work would not be.

    Ranks use it; nodes and hosts do not yet. Node-level wobble (MoE imbalance, data) moves
    nodes in correlated pairs, and leaving only one of a pair out turned one false `node`
    incident of `flare eval --gpus 16,32,64` into two while gaining one slow node of 27.
    """

    def __init__(self, depth: int = 10) -> None:
        self.depth = depth
        self._hist: dict[str, deque[tuple[np.ndarray, np.ndarray | None]]] = {}

    def _remember(
        self, family: str, values: np.ndarray, ids: np.ndarray | None
    ) -> deque[tuple[np.ndarray, np.ndarray | None]]:
        h = self._hist.setdefault(family, deque(maxlen=self.depth))
        ok = np.isfinite(values)
        v = values[ok]
        i = None if ids is None else ids[ok]
        if v.size > 4096:  # plenty this step; keep the memory light
            stride = v.size // 4096 + 1
            v = v[::stride]
            i = None if i is None else i[::stride]
        h.append((v - np.median(v) if v.size else v, i))
        return h

    def sigma(self, family: str, values: np.ndarray, floor: float) -> float:
        """σ of the whole pool (for scores of an entity made of all the values)."""
        h = self._remember(family, values, None)
        return robust_sigma(np.concatenate([v for v, _ in h]), floor)

    def sigma_each(
        self, family: str, values: np.ndarray, ids: np.ndarray, floor: float
    ) -> np.ndarray:
        """(N,) σ to measure each value against: the pool's, or in a small group the pool
        without the entries of that value's entity (`ids`: one entity id per value)."""
        h = self._remember(family, values, ids)
        pool = np.concatenate([v for v, _ in h])
        out = np.full(values.shape, robust_sigma(pool, floor))
        if values.size > SMALL_GROUP or pool.size == 0:
            return out
        owner = np.concatenate([np.full(v.size, -1) if i is None else i for v, i in h])
        others = owner[None, :] != ids[:, None]  # (N, pool)
        enough = others.sum(axis=1) >= 3
        others[~enough] = True  # too few others: the whole pool
        loo = robust_sigma_rows(np.where(others, pool[None, :], np.nan), floor)
        return np.where(enough, loo, out)


@dataclass(slots=True)
class Topology:
    """What the job's start event told us: each node's switch (may be empty)."""

    switch_of: dict[str, str] = field(default_factory=dict)


def _node_stats(
    values: np.ndarray, node: np.ndarray, n_nodes: int
) -> tuple[np.ndarray, np.ndarray]:
    counts = np.bincount(node, minlength=n_nodes)
    return grouped_median(values, node, n_nodes), counts


def compute_ratio(
    frame: StepFrame, feats: StepFeatures, stages: tuple[np.ndarray, int]
) -> np.ndarray:
    """(R,) compute time vs the median of the rank's stage peers (1.0 = like its peers)."""
    basis = feats.compute_s if feats.has_compute else feats.gap_s
    keys, n_keys = stages
    ref = grouped_median(basis, keys, n_keys)[keys]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(ref > 0, basis / ref, np.nan)


def _compute_suspects(
    frame: StepFrame, feats: StepFeatures, ratio: np.ndarray, noise: NoiseMemory, out: Candidates
) -> None:
    basis = feats.compute_s if feats.has_compute else feats.gap_s
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.log(ratio)
    x = np.where(np.isfinite(x), x, 0.0)
    n_nodes = len(frame.nodes)
    node_x, counts = _node_stats(x, frame.node, n_nodes)
    node_x = np.nan_to_num(node_x)
    per_node = counts[frame.node]
    g = np.where(per_node >= 3, x - node_x[frame.node], x)
    rep = replica_keys(frame)
    if rep is not None:
        keys, n_rep = rep
        size = np.bincount(keys, minlength=n_rep)[keys]
        rep_x = grouped_median(x, keys, n_rep)[keys]
        # a pair's median is its mean: the slow member's residual is +d/2 and its partner's
        # -d/2, so with fewer than three pairs half of all residuals carry the fault and the
        # spread estimate breaks down; then the node is the better reference
        usable = (size >= 3) | ((size == 2) & (n_rep >= 3))
        g = np.where(usable, x - rep_x, g)
    zg = g / noise.sigma_each("gpu", g, frame.rank, 0.004)
    for i in np.flatnonzero(zg >= Z_REPORT):
        out.add(
            f"rank:{int(frame.rank[i])}",
            "gpu",
            zg[i],
            basis[i] * (1 - np.exp(-g[i])),
            f"compute ×{np.exp(x[i]):.2f} vs stage peers",
        )
    multi = counts >= 2
    if multi.sum() >= 3:
        sn = noise.sigma("node", node_x[multi], 0.006)
        zn = np.where(multi, node_x / sn, 0.0)
        node_basis = grouped_median(basis, frame.node, n_nodes)
        for n in np.flatnonzero(zn >= Z_REPORT):
            out.add(
                f"node:{frame.nodes[n]}",
                "node",
                zn[n],
                node_basis[n] * (1 - np.exp(-node_x[n])),
                f"compute ×{np.exp(node_x[n]):.2f} on all {counts[n]} ranks",
            )


def _host_suspects(
    frame: StepFrame,
    feats: StepFeatures,
    stages: tuple[np.ndarray, int],
    noise: NoiseMemory,
    out: Candidates,
) -> None:
    if not feats.has_compute:
        return  # gaps then include compute: the compute view already uses them
    n_nodes = len(frame.nodes)
    if n_nodes < 2:
        # a host is judged against other hosts; on the only one, contention slows every rank
        # alike (the job's step time shows it) and what is left between its own ranks is
        # scheduling noise (oversubscribed CPU: z up to 6 on a healthy run)
        return
    keys, n_keys = stages
    ref_gap = grouped_median(feats.gap_s, keys, n_keys)[keys]
    ref_span = grouped_median(feats.span_s, keys, n_keys)[keys]
    extra = feats.gap_s - ref_gap
    h = np.where(ref_span > 0, extra / np.maximum(ref_span, 1e-9), 0.0)
    counts = np.bincount(frame.node, minlength=n_nodes)
    node_h = np.bincount(frame.node, weights=h, minlength=n_nodes) / np.maximum(counts, 1)
    node_extra = np.bincount(frame.node, weights=extra, minlength=n_nodes) / np.maximum(counts, 1)
    if n_nodes >= 3:
        sh = noise.sigma("host", node_h, 0.003)
    else:
        sh = noise.sigma("host1", h, 0.003)
    zh = node_h / sh
    for n in np.flatnonzero(zh >= Z_REPORT):
        out.add(
            f"node:{frame.nodes[n]}",
            "host",
            zh[n],
            node_extra[n],
            f"idle gaps +{node_extra[n] * 1e3:.0f} ms per rank",
        )


def transfer_reference(inst: Instances) -> np.ndarray:
    """(I,) normal transfer of comparable instances (same kind, op, bytes, size, cross-node)
    in this step; NaN where fewer than three are comparable.

    The lower quartile, not the median: a congested switch under half of the nodes slows
    half of the instances of every signature, and the reference must stay healthy.
    """
    ref = np.full(inst.transfer_s.size, np.nan)
    idx = np.flatnonzero(inst.cross_node & (inst.n_copies >= 2))
    if idx.size < 3:
        return ref
    _, bcode = np.unique(inst.bytes[idx], return_inverse=True)
    n_names = int(inst.name[idx].max()) + 1
    key = (inst.kind[idx].astype(np.int64) * n_names + inst.name[idx]) * (int(bcode.max()) + 1)
    key = (key + bcode.reshape(-1)) * (1 << 24) + np.minimum(inst.n_copies[idx], (1 << 24) - 1)
    _, sig = np.unique(key, return_inverse=True)
    sig = sig.reshape(-1)
    n_sig = int(sig.max()) + 1
    med = grouped_quantile(inst.transfer_s[idx], sig, n_sig, REF_QUANTILE)
    ok = np.bincount(sig, minlength=n_sig)[sig] >= 3
    ref[idx[ok]] = med[sig[ok]]
    return ref


def _network_suspects(
    frame: StepFrame, feats: StepFeatures, topo: Topology, full_ref: np.ndarray, out: Candidates
) -> None:
    inst = feats.inst
    idx = np.flatnonzero(np.isfinite(full_ref) & (full_ref > 0))
    if idx.size < 3:
        return
    ref = full_ref[idx]
    ell = np.log(np.maximum(inst.transfer_s[idx], 1e-12) / ref)
    # noise from the healthy side only: ℓ is relative to each signature's lower quartile,
    # so the pooled 10th percentile sits at ≈ -0.607σ even when most instances are slow
    s_ell = max(float(-np.quantile(ell, 0.10)) / 0.607, _NET_SIGMA_FLOOR)
    e = np.where(ell > max(3 * s_ell, _NET_MIN_RATIO), ell, 0.0)
    if not e.any():
        return
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
    inc_ent: list[np.ndarray] = []
    inc_inst: list[np.ndarray] = []
    used_nodes = np.flatnonzero(np.bincount(p_node, minlength=n_nodes))
    node_eid = np.full(n_nodes, -1)
    node_eid[used_nodes] = np.arange(used_nodes.size)
    for n in used_nodes:
        ent_names.append(f"node:{frame.nodes[n]}")
        ent_kinds.append("link")
        ent_nodes.append(np.array([n]))
    inc_ent.append(node_eid[p_node])
    inc_inst.append(p_inst)
    p2p = inst.kind[idx] == P2P
    if p2p.any():
        lo = np.full(idx.size, n_nodes)
        hi = np.full(idx.size, -1)
        np.minimum.at(lo, c_pos, c_node)
        np.maximum.at(hi, c_pos, c_node)
        two = np.flatnonzero(p2p & (lo != hi) & (hi >= 0))
        keys, link_of = np.unique(lo[two] * n_nodes + hi[two], return_inverse=True)
        base = len(ent_names)
        for k in keys:
            a, b = divmod(int(k), n_nodes)
            ent_names.append("link:" + "~".join(sorted((frame.nodes[a], frame.nodes[b]))))
            ent_kinds.append("link")
            ent_nodes.append(np.array([a, b]))
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
            inc_ent.append(base + sw_pair % len(sw_names))
            inc_inst.append(sw_pair // len(sw_names))
    ie = np.concatenate(inc_ent)
    ii = np.concatenate(inc_inst)
    n_ent = len(ent_names)
    cnt = np.bincount(ie, minlength=n_ent).astype(float)
    e_left = e.copy()
    for _ in range(_NET_ROUNDS):
        total = e_left.sum()
        if total <= 0:
            break
        sums = np.bincount(ie, weights=e_left[ii], minlength=n_ent)
        s_in = sums / np.maximum(cnt, 1)
        # specificity: instances that do not touch the entity must be faster, else the
        # slowdown is everywhere (job-wide) and no single entity is to blame
        s_out = (total - sums) / np.maximum(idx.size - cnt, 1)
        score = np.where(cnt > 0, np.maximum(s_in - s_out, 0.0) * sums / total, 0.0)
        best = int(np.argmax(score))
        z = score[best] / s_ell
        if z < Z_REPORT:
            break
        if ent_kinds[best] == "link" and ent_nodes[best].size == 1:
            best = _disambiguate_node(best, score, ent_names, ent_kinds, ent_nodes)
            if best < 0:
                break  # several nodes explain it equally and no switch holds them all
        ids = ii[ie == best]
        ratio = float(np.exp(e_left[ids][e_left[ids] > 0].mean()))
        out.add(
            ent_names[best],
            ent_kinds[best],
            z,
            float(node_extra[ent_nodes[best]].max()),
            f"transfers ×{ratio:.2f} on {int((e_left[ids] > 0).sum())} of {ids.size} instances",
        )
        e_left[ids] = 0.0


def _disambiguate_node(
    best: int,
    score: np.ndarray,
    names: list[str],
    kinds: list[str],
    nodes: list[np.ndarray],
) -> int:
    """A node is blamed only if it stands out; nodes tied with it point to what they share.

    When several nodes explain the slow transfers equally (every dp group of a stage spans
    all its nodes, and all pipeline links are slow), no NIC is singled out: the smallest
    switch under which all of them sit is the suspect, or nobody.
    """
    is_node = np.array([k == "link" and n.size == 1 for k, n in zip(kinds, nodes, strict=True)])
    tied = np.flatnonzero(is_node & (score >= _NODE_TIE * score[best]))
    if tied.size <= 1:
        return best
    tied_nodes = {int(nodes[i][0]) for i in tied}
    holders = [
        i for i, k in enumerate(kinds) if k == "switch" and tied_nodes <= set(nodes[i].tolist())
    ]
    if not holders:
        return -1
    return min(holders, key=lambda i: nodes[i].size)


def step_suspects(
    frame: StepFrame,
    feats: StepFeatures,
    ratio: np.ndarray,
    topo: Topology,
    ref: np.ndarray,
    noise: NoiseMemory,
    stages: tuple[np.ndarray, int],
) -> Candidates:
    """All suspects of one step with their significance (robust z) and cost in seconds.

    `stages` is `peers.stage_keys(frame)`, computed once per step by the caller."""
    out = Candidates()
    if frame.n_ranks < 2:
        return out
    _compute_suspects(frame, feats, ratio, noise, out)
    _host_suspects(frame, feats, stages, noise, out)
    _network_suspects(frame, feats, topo, ref, out)
    return out
