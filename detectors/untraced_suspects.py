"""Untraced suspects: the rank everyone waits on reports nothing, so name where it must be.

Production tracers often record one rank per tensor-parallel group, a random subset, or
nothing of a node whose agent is down. A slow GPU that is not traced leaves no compute of its
own to compare; what it leaves is its traced group peers waiting for it. In a group with
untraced members, the traced member that waits least (the last traced one to arrive) still
waits for the untraced one, so the group's least wait is long compared with the same kind of
group on the same stage, while the traced members' own compute is normal.

The narrowest entity the data supports:
- a tensor-parallel group lives inside a node: that node (the untraced member is one of its
  GPUs; which one the traced waits cannot tell);
- a group across nodes waits on an untraced member that may live on any node, unless all
  untraced ranks must live on one node (`untraced_home`: the job start named a node that
  reports nothing, and no more ranks are missing than one node holds): that node.

When the dark node holds a whole pipeline stage (a job of two nodes), every traced group is
complete and the dark stage shows only in the pipeline transfers that wait on it: their
share of the traced ranks' step, against its usual level, names the dark node
(`_dark_node_waits`).

The kind stays `gpu` and the detail says the culprit is not traced. An untraced process
that stalls once per step (a GC pause, a late loader) makes its group wait once, at whatever
collective follows: the group's total wait rises, its typical collective does not. That is
a `host` suspect on the node (`_stall_z`), named where the stall happens rather than in the
pipeline neighbours it passes to (`_stall_origins`). A group whose slowest member is traced
has a short least wait: the compute view names that member. A group whose traced rank also
received late waits on the pipeline, not on a member of its own, unless it waited far longer
than that rank's transfers ran late (`_downstream`); and of two groups of one data replica
that wait alike, the one that waited in more of the recent steps is where the slow member is
(`_held_for_origin`). A group is judged against its stage peers and against its own usual
wait (`WaitHistory`), since each alone is biased. The same waits also settle a question the
compute view cannot: a slow rank that is its node's only traced rank is its GPU if its
untraced peers wait for it, its node if they keep pace (`_whole_node_or_gpu`).

Four traced ranks, one per `tp` group of size 4 (the layout says so). For five steps every
rank waits 1 ms in its group's all-reduce; then the untraced members of `tp.2` turn slow, and
rank 8 waits 30 ms where the others still wait 1 ms:

>>> from detectors.features import step_features
>>> from detectors.network_suspects import Topology, layout_sizes, short_of_members
>>> from detectors.noise import NoiseMemory
>>> from detectors.peers import stage_keys
>>> from detectors.testing import frame_of, rank_step
>>> def frame(slow):
...     return frame_of([rank_step(r, f"n{r // 4}", 0, [
...         ("compute", "fwd", "", 0, 0.0, 10.0, 0),
...         ("coll", "all_reduce", f"tp.{r // 4}", 0, 10.0, 30.0 if slow and r == 8 else 1.0,
...          1 << 20)]) for r in (0, 4, 8, 12)])
>>> topo, noise, waits = Topology(group_size={"tp": 4}, world=16), NoiseMemory(), WaitHistory()
>>> for step in range(6):
...     out = Candidates()
...     f = frame(slow=step == 5)
...     untraced_suspects(f, step_features(f), topo, stage_keys(f), noise, waits, out)
>>> out.entity, out.kind
(['node:n2'], ['gpu'])
"""

from __future__ import annotations

import numpy as np

from detectors.base import Stateful
from detectors.candidates import Z_REPORT, Candidates
from detectors.evidence import NEED, WINDOW, Z_ON
from detectors.features import StepFeatures
from detectors.network_suspects import Topology, layout_sizes, short_of_members
from detectors.noise import NoiseMemory
from detectors.segments import grouped_median
from schemas.frame import StepFrame
from schemas.rankstep import COLL, P2P

# σ floor of the log ratio of a group's least wait to its stage peers': the same 0.4% as a
# GPU's compute ratio (compute_suspects), for the same reason (identical ranks).
_SIGMA_FLOOR = 0.004
_MIN_PEERS = 3  # groups of one kind on one stage to compare with
# σ floor of an untraced member's stall, as a share of the step: one process's stalls
# jitter far more than a group's waits (as `host_suspects` floors a traced rank's)
_STALL_SIGMA_FLOOR = 0.01
_RATE_WEIGHT = 0.25  # weight of the latest step in a group's recent stall and slow rates
# a group's extra total wait over what its typical instance's rise accounts for, past which
# a stall explains it rather than a slow member (`_lump`): a slow GPU raises every instance
# alike (0.8-1.0 in the simulator's untraced slow GPUs), a stall whose process also drives
# its slowed sends raised the typical instance by 20% and the total 20-60 times as much
_LUMP_RATIO = 4.0
# σ floor of the log share of the traced ranks' step spent waiting on a dark node: those
# waits follow the dark stage's data and schedule, far noisier than a group's least wait
_DARK_SIGMA_FLOOR = 0.02
HISTORY = 20  # steps of each group's own least wait kept as its usual level
_MIN_HISTORY = 5  # steps a group must have been seen before it is judged


class WaitHistory(Stateful):
    """Each partially traced group's usual least wait (log seconds) and how much it varies,
    learnt from the steps in which it was not a suspect.

    The peer comparison alone is biased: the wait on k untraced members is the latest of k
    arrivals and grows with k, and under MoE routing or data imbalance by a lot, so a group
    missing six of eight members looks slow next to one missing two, and a group whose
    members' loads vary shows ×2 waits on ordinary steps. Measured against its own usual
    level (less the step's median change over all groups, which is job-wide) and its own
    spread, such a group is ordinary; a GPU that turned slow is not. A suspect's steps are
    held back, so a persistent fault becomes neither the usual level nor the spread; and a
    fault elsewhere that changes many groups' waits at once (they wait on the same slow
    rank) does not widen anyone's spread. A held step is learnt `WINDOW` steps late when the
    group was a suspect in fewer than `NEED` of them, the bar a track is confirmed by: an
    excursion that did not persist is the group's own noise. Never learning them left only
    the body of a heavy-tailed wait (an untraced expert's routed load, the last of several
    replicas' data), whose spread then read its tail as a fault three steps in five.

    >>> h = WaitHistory()
    >>> for step in range(30):  # waits of 10 ms, and a 40 ms one every fourth step
    ...     h.learn(["tp.1"], np.log([0.04 if step % 4 == 3 else 0.01]), np.array([step % 4 == 3]))
    >>> bool(np.nanmax(h.values) > np.log(0.03))  # the tail is part of the usual spread
    True
    >>> h = WaitHistory()
    >>> for step in range(30):  # 10 ms, then from step 10 on 40 ms: a fault, never learnt
    ...     h.learn(["tp.1"], np.log([0.04 if step >= 10 else 0.01]), np.array([step >= 10]))
    >>> bool(np.nanmax(h.values) > np.log(0.03))
    False
    """

    def __init__(self, depth: int = HISTORY) -> None:
        self.depth = depth
        self.row: dict[str, int] = {}  # group name → its row of `values`
        self.values = np.full((0, depth), np.nan)  # (groups, depth) ring of log waits
        self.count = np.zeros(0, dtype=np.int64)  # values learnt per row (all time)
        self.stall_rate = np.zeros(0)  # per row: how often it showed a stall lately (EWMA)
        self.slow_rate = np.zeros(0)  # per row: how often it waited long on one member (EWMA)
        # per row, its last WINDOW steps: each suspect step's wait (NaN: learnt or none) and
        # whether it was a suspect; ring slot = `seen` mod WINDOW
        self.held = np.full((0, WINDOW), np.nan)
        self.was_suspect = np.zeros((0, WINDOW), dtype=bool)
        self.seen = np.zeros(0, dtype=np.int64)

    def _rows(self, names: list[str]) -> np.ndarray:
        """Row of each group, new groups getting fresh rows."""
        rows = np.fromiter(
            (self.row.setdefault(n, len(self.row)) for n in names), dtype=np.int64, count=len(names)
        )
        grow = len(self.row) - self.count.size
        if grow > 0:
            self.values = np.vstack([self.values, np.full((grow, self.depth), np.nan)])
            self.count = np.concatenate([self.count, np.zeros(grow, dtype=np.int64)])
            self.stall_rate = np.concatenate([self.stall_rate, np.zeros(grow)])
            self.slow_rate = np.concatenate([self.slow_rate, np.zeros(grow)])
            self.held = np.vstack([self.held, np.full((grow, WINDOW), np.nan)])
            self.was_suspect = np.vstack([self.was_suspect, np.zeros((grow, WINDOW), bool)])
            self.seen = np.concatenate([self.seen, np.zeros(grow, dtype=np.int64)])
        return rows

    def stall_rates(self, names: list[str], stalled: np.ndarray) -> np.ndarray:
        """Add this step's stall readings (bool per group) to each group's recent rate and
        return the rates."""
        return self._rates("stall_rate", names, stalled)

    def slow_rates(self, names: list[str], slow: np.ndarray) -> np.ndarray:
        """As `stall_rates`, for the readings that a group waited long on one member."""
        return self._rates("slow_rate", names, slow)

    def _rates(self, which: str, names: list[str], seen: np.ndarray) -> np.ndarray:
        rows = self._rows(names)  # may grow the rate arrays: read them after
        rates: np.ndarray = getattr(self, which)
        rate = rates[rows] * (1 - _RATE_WEIGHT) + _RATE_WEIGHT * seen
        rates[rows] = rate
        return rate

    def change(
        self, names: list[str], log_wait: np.ndarray, floor: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(N,) change of each group's log wait from its usual level, less the median change
        of the groups of this step; and (N,) that change in units of the group's own spread
        (its standard deviation, which sees the tail a MAD would not; at least the groups'
        median spread and `floor`). NaN: too little history."""
        rows = self._rows(names)
        known = self.count[rows] >= _MIN_HISTORY
        if known.sum() < _MIN_PEERS:
            return np.full(len(names), np.nan), np.full(len(names), np.nan)
        hist = self.values[rows[known]]
        base = np.full(len(names), np.nan)
        spread = np.full(len(names), np.nan)
        base[known] = np.nanmedian(hist, axis=1)
        spread[known] = np.nanstd(hist, axis=1, ddof=1)
        d = log_wait - base
        d -= float(np.median(d[known]))
        spread = np.maximum(spread, max(float(np.median(spread[known])), floor))
        return d, d / spread

    def change_alone(self, name: str, value: float, floor: float) -> tuple[float, float]:
        """`change` of one series judged alone: its change from its usual level, and that
        change in units of its own spread (at least `floor`); NaN with too little history.
        Nothing is taken off: the caller's series is already relative to the job."""
        row = int(self._rows([name])[0])
        if self.count[row] < _MIN_HISTORY:
            return float("nan"), float("nan")
        hist = self.values[row]
        d = value - float(np.nanmedian(hist))
        return d, d / max(float(np.nanstd(hist, ddof=1)), floor)

    def learn(self, names: list[str], log_wait: np.ndarray, suspect: np.ndarray) -> None:
        """Add this step's waits to the usual level, holding back a suspect's once it has one;
        learn the wait held `WINDOW` steps ago unless the group stayed a suspect."""
        rows = self._rows(names)
        slot = self.seen[rows] % WINDOW
        old = self.held[rows, slot]
        passed = np.isfinite(old) & (self.was_suspect[rows].sum(axis=1) < NEED)
        self._add(rows[passed], old[passed])
        hold = suspect & (self.count[rows] >= _MIN_HISTORY)
        self._add(rows[~hold], log_wait[~hold])
        self.held[rows, slot] = np.where(hold, log_wait, np.nan)
        self.was_suspect[rows, slot] = hold
        self.seen[rows] += 1

    def _add(self, rows: np.ndarray, log_wait: np.ndarray) -> None:
        self.values[rows, self.count[rows] % self.depth] = log_wait
        self.count[rows] += 1


def partial_groups(
    frame: StepFrame, group_size: dict[str, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(G,) bool over `frame.groups`: a collective group with fewer traced members than the
    layout says it has; (G,) the number of its traced members; and (G,) bool: a group whose
    waits are measured at all (its size is known, it is not an expert all-to-all)."""
    coll = frame.op_kind == COLL
    g = frame.op_group[coll]
    r = frame.op_rank_index()[coll]
    n_groups = len(frame.groups)
    pairs = np.unique(g.astype(np.int64) * max(frame.n_ranks, 1) + r)
    observed = np.bincount(pairs // max(frame.n_ranks, 1), minlength=n_groups)
    size = layout_sizes(frame.groups, group_size)
    # expert-parallel all-to-alls wait on the routing imbalance of the whole group (workload,
    # not a device): their members' lateness shows in their tp and dp groups instead
    judged = np.array([not name.startswith("ep.") for name in frame.groups], dtype=bool)
    measured = (observed > 0) & (size > 1) & judged
    return measured & (observed < size), observed, measured


def untraced_home(frame: StepFrame, topo: Topology) -> str | None:
    """The one node every untraced rank must be on, or None.

    A node the job start named that reports no rank is dark (its agent is down); when it is
    the only one and no more ranks are missing than a reporting node holds, every untraced
    member of every group is one of its ranks."""
    if not topo.nodes or topo.world <= frame.n_ranks:
        return None
    dark = set(topo.nodes) - set(frame.nodes[i] for i in np.unique(frame.node).tolist())
    per_node = int(np.bincount(frame.node).max()) if frame.n_ranks else 0
    if len(dark) == 1 and topo.world - frame.n_ranks <= per_node:
        return dark.pop()
    return None


def untraced_suspects(
    frame: StepFrame,
    feats: StepFeatures,
    topo: Topology,
    stages: tuple[np.ndarray, int],
    noise: NoiseMemory,
    history: WaitHistory,
    out: Candidates,
) -> None:
    """Add `gpu` suspects on the node a group with a long least wait must wait on."""
    if not topo.group_size or frame.n_ops == 0:
        return
    home = untraced_home(frame, topo)
    if any(k in ("link", "switch") or z >= Z_ON for k, z in zip(out.kind, out.z, strict=True)):
        # The dark node's ranks can be late because of something the traced views see: a
        # slow network stretches every traced copy as a late untraced rank would, and a slow
        # GPU or starved host upstream in their replica delays them through the pipeline.
        # Their own waits, which would show that, are dark: the traced culprit is the
        # explanation, not the dark node.
        home = None
    partial, observed, measured = partial_groups(frame, topo.group_size)
    if partial.any():
        _group_suspects(frame, feats, topo, stages, noise, history, out, home,
                        (partial, observed, measured))
    elif home is not None:  # the dark node holds whole groups: a pipeline stage of its own
        _dark_node_waits(frame, feats, topo, home, history, out)


def _group_suspects(
    frame: StepFrame,
    feats: StepFeatures,
    topo: Topology,
    stages: tuple[np.ndarray, int],
    noise: NoiseMemory,
    history: WaitHistory,
    out: Candidates,
    home: str | None,
    groups: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    """The suspects of the collective groups with untraced members (`partial_groups`:
    partial, observed members, measured), placed on a node (`_places`; `home`: the one node
    every untraced rank is on, or None)."""
    partial, observed, measured = groups
    p_group, p_rank, rep, wait, typical = _least_waits(frame, feats, measured)
    # a group is as unusual as the less unusual of its two waits says (`_least_waits`)
    all_names = [frame.groups[int(g)] for g in p_group[rep]]
    all_log_wait = np.log(np.maximum(wait[rep], 1e-9))
    all_log_typical = np.log(np.maximum(typical[p_group[rep]], 1e-9))
    typical_names = [f"{n} typical" for n in all_names]
    keys, n_keys = stages
    # the usual level of every measured group, fully traced ones included: they are what a
    # job-wide change is measured on when every partially traced group waits on one node
    all_own, all_z_total = history.change(all_names, all_log_wait, _SIGMA_FLOOR)
    typical_own, z_typical = history.change(typical_names, all_log_typical, _SIGMA_FLOOR)
    all_z_own = np.fmin(all_z_total, z_typical)
    sel = np.flatnonzero(partial[p_group[rep]])
    rep = rep[sel]
    g_id, g_rank = p_group[rep], p_rank[rep]
    g_wait = wait[rep]
    own, z_own = all_own[sel], all_z_own[sel]
    z_total = np.nan_to_num(all_z_total[sel])
    kinds = [frame.groups[int(g)].partition(".")[0] for g in g_id]
    untraced = np.array([topo.group_size[k] for k in kinds]) - observed[g_id]
    kind_code = np.unique(kinds, return_inverse=True)[1].reshape(-1)
    peer_key = kind_code * n_keys + keys[g_rank]
    n_peer = int(peer_key.max()) + 1
    enough = np.bincount(peer_key, minlength=n_peer)[peer_key] >= _MIN_PEERS
    ref = grouped_median(g_wait, peer_key, n_peer)[peer_key]
    with np.errstate(divide="ignore", invalid="ignore"):
        x = np.log(g_wait / ref)
    x = np.where(enough & np.isfinite(x), x, 0.0)
    # slow against the peers AND against its own usual level: each alone has its bias (see
    # WaitHistory); the smaller of the two says how slow the group surely is
    z_peer = x / noise.sigma("untraced", x[enough], _SIGMA_FLOOR)
    _whole_node_or_gpu(frame, g_rank[enough], np.array(kinds)[enough], z_peer[enough], out)
    place = _places(frame, p_group, p_rank, g_id, kinds, home)
    local = np.array([p is not None and p != home for p in place], dtype=bool)
    z_own = np.where(np.isfinite(z_own), z_own, 0.0)
    # A group inside a node is judged against its peers AND its own usual level (the smaller
    # z). A group across nodes is placed only on the node that holds every untraced rank; a
    # slow rank there delays its whole replica, so every such group of its stage waits alike
    # and the peer comparison is blind: its own usual level alone judges it. So it does a
    # group inside a node with too few peers on its stage (a small job: two nodes a stage).
    vs_peers = local & enough
    z = np.where(vs_peers, np.minimum(z_peer, z_own), z_own)
    upstream = _downstream(frame, stages, noise, g_rank, g_wait - ref)
    z = np.where(upstream, 0.0, z)
    z = _where_it_starts(z, local & ~enough)
    # a group with too few stage peers (a small job: two nodes a stage) measures a stall's
    # excess against its own usual total, and its own history stands for the peers' verdict
    lone = ~enough & np.isfinite(all_own[sel])
    ref = np.where(lone, g_wait * np.exp(-np.where(lone, all_own[sel], 0.0)), ref)
    z_stall = _stall_z(feats, g_wait, ref, np.where(lone, z_total, z_peer), z_total, noise)
    lump = _lump(g_wait - ref, all_log_typical[sel], typical_own[sel])
    z_stall = np.where(local & ~upstream & ((z < Z_REPORT) | lump), z_stall, 0.0)
    z = np.where(lump & (z_stall >= Z_REPORT), 0.0, z)
    if (z[lone] >= Z_REPORT).any():
        # a slow GPU judged alone holds its data-parallel peers' groups once per step,
        # which is what a stall looks like: it explains them
        z_stall = np.where(lone, 0.0, z_stall)
    z_stall = _stall_origins(frame, [all_names[i] for i in sel], g_rank, z_stall, history, out)
    lead = ~upstream & enough & (z_peer >= Z_REPORT)
    in_replica = np.array([k == "tp" for k in kinds], dtype=bool)
    held = _held_for_origin(frame, [all_names[i] for i in sel], g_rank, in_replica,
                            np.maximum(z, z_stall), (lead, np.where(enough, g_wait - ref, 0.0)),
                            history)
    z, z_stall = np.where(held, 0.0, z), np.where(held, 0.0, z_stall)
    # a change its own history calls significant is not learnt as usual, whatever the peers;
    # nor is a stall's long total (its typical instance stays usual, and is learnt)
    unusual = np.nan_to_num(all_z_own) >= Z_REPORT
    unusual[sel] |= upstream
    history.learn(typical_names, all_log_typical, unusual)
    unusual[sel] |= z_stall >= Z_REPORT
    history.learn(all_names, all_log_wait, unusual)
    # a node the host or compute view already blames as a whole delays its untraced members
    # too: that is the explanation, not one of its GPUs
    whole = {e[5:] for e, k in zip(out.entity, out.kind, strict=True) if k in ("host", "node")}
    for node, i in _strongest(z_stall, place, whole).items():
        out.add(
            f"node:{node}",
            "host",
            z_stall[i],
            g_wait[i] - ref[i],
            f"{frame.groups[int(g_id[i])]} waits +{(g_wait[i] - ref[i]) * 1e3:.0f} ms per step "
            f"over {'its usual wait' if lone[i] else 'its stage peers'} (its traced rank "
            f"{int(frame.rank[g_rank[i]])} included) "
            f"while its typical collective does not: one of its {int(untraced[i])} untraced "
            "member(s) stalls once per step (a GC pause, a late data loader; its host or one "
            "long kernel, which the data cannot tell apart)",
        )
    for node, i in _strongest(z, place, whole).items():
        g = int(g_id[i])
        ratio = np.exp(x[i] if vs_peers[i] else own[i])
        vs = "its stage peers" if vs_peers[i] else "its usual wait"
        out.add(
            f"node:{node}",
            "gpu",
            z[i],
            g_wait[i] * (1 - 1 / ratio),
            f"{frame.groups[g]} waits ×{ratio:.2f} vs {vs} (its traced rank "
            f"{int(frame.rank[g_rank[i]])} included) on {int(untraced[i])} member(s) that are "
            "not traced",
        )


def _dark_node_waits(
    frame: StepFrame,
    feats: StepFeatures,
    topo: Topology,
    home: str,
    history: WaitHistory,
    out: Candidates,
) -> None:
    """A `gpu` suspect on the dark node `home` when the traced ranks' time in transfers with
    an untraced member (all of them on `home`) grew against their own work. Only when no
    collective group misses members: where some do, their waits are the sharper evidence
    (`_group_suspects`), and a job-wide shift moved this share in a 32-GPU clean run.

    A job of two nodes with one dark is a traced stage and a dark one: the traced groups are
    complete, and what the dark stage does shows only in the pipeline transfers that wait on
    it. A slow GPU, host or NIC there lengthens those waits while the traced ranks' own work
    (the rest of their step) does not; a change of the whole job (longer sequences, a slower
    model) lengthens both. So the waits are measured as a share of the own work, against
    that share's usual level (`WaitHistory.change_alone`); which part of the dark node is
    slow, nothing traced can tell. If the own work grew at least as much, the traced side
    changed (a starved host there makes its own ranks late, and the dark stage with them).

    Nor can it tell that part of the dark node from the network to it. The simulator's
    quickest transfers (its sends, never waiting on their receiver) could: they stretch with
    a slow link and not with a slow GPU. Real gloo training's cannot: a starved receiver
    drains its sockets slowly, so the sends to it block as with a slow NIC, and the quickest
    send, 0.2 ms, jitters ×10 from step to step on a busy host (tried: two drills of a
    throttled dark rank of three were named the link, a NIC drill the node). So the dark
    node is named, and its summary says what else would look the same."""
    inst = feats.inst
    judged = np.array([not g.startswith("ep.") for g in frame.groups], dtype=bool)
    partial = judged[inst.group] & short_of_members(frame.groups, inst.group, inst.n_copies,
                                                    topo.group_size)
    if not partial.any():
        return
    # the traced ranks with a copy of such an instance: they wait on the dark node
    waiting = np.bincount(inst.copy_rank[partial[inst.copy_inst]],
                          minlength=frame.n_ranks) > 0
    # the traced ranks' own work (compute, and the host's gaps) and the rest of their step:
    # the waits on the dark node, and what they pass on (a rank that waited longer makes its
    # traced group wait for it in their next all-reduce)
    own_s = feats.compute_s + feats.gap_s
    own = float(np.median(own_s[waiting]))
    dark = float(np.median((feats.span_s - own_s)[waiting]))
    if own <= 0 or dark <= 0:
        return
    share = float(np.log(dark / own))
    levels = np.array([share, np.log(own)])
    names = [f"dark:{home}", f"dark own:{home}"]
    d, z = history.change_alone(names[0], share, _DARK_SIGMA_FLOOR)
    d_own, _ = history.change_alone(names[1], float(levels[1]), _DARK_SIGMA_FLOOR)
    unusual = bool(np.isfinite(z) and z >= Z_REPORT)
    history.learn(names, levels, np.full(2, unusual))
    if not unusual or (np.isfinite(d_own) and d_own >= d):
        return  # usual, or the traced ranks' own work grew as much: the traced side changed
    out.add(f"node:{home}", "gpu", z, dark * (1 - float(np.exp(-d))),
            f"the traced ranks wait ×{np.exp(d):.2f} their usual on it (its agent is down, so "
            "its ranks report nothing: its host, its NIC or the path to it would look the "
            "same)")


def _where_it_starts(z: np.ndarray, lone: np.ndarray) -> np.ndarray:
    """`z` kept, of the `lone` groups (judged by their own usual wait alone), only on the
    one that rose most.

    A slow untraced GPU holds its own group at every collective, and its data-parallel
    peers' groups once per step, through the peers it made late: in a job too small for
    stage peers every one of those rises against its own usual wait, the first by most.

    >>> _where_it_starts(np.array([5.0, 9.0, 3.0, 7.0]), np.array([True, True, False, True]))
    array([0., 9., 3., 0.])
    """
    if int(lone.sum()) < 2:
        return z
    keep = np.flatnonzero(lone)[int(np.argmax(z[lone]))]
    return np.where(lone & (np.arange(z.size) != keep), 0.0, z)


def _strongest(z: np.ndarray, place: list[str | None], skip: set[str]) -> dict[str, int]:
    """Node → the index of its group with the strongest evidence (z ≥ Z_REPORT), over the
    groups placed on a node that `skip` does not hold."""
    best: dict[str, int] = {}
    for hit in np.flatnonzero(z >= Z_REPORT).tolist():
        node = place[hit]
        if node is None or node in skip:
            continue
        if node not in best or z[hit] > z[best[node]]:
            best[node] = hit
    return best


def _stall_z(
    feats: StepFeatures,
    wait: np.ndarray,
    ref: np.ndarray,
    z_peer: np.ndarray,
    z_total: np.ndarray,
    noise: NoiseMemory,
) -> np.ndarray:
    """(N,) how surely each group's traced members waited out one untraced member's stall.

    A process that idles once per step (a GC pause, a late batch) while its GPU is healthy
    makes its group wait once, at whichever collective follows: the group's total wait
    rises, its typical instance does not, which is also what MoE routing does to a group of
    short waits. So the total must be long against the stage peers (`z_peer`), against
    its own usual total (`z_total`), and in absolute terms: the excess is a share of the
    step, with the same 1% σ floor as a traced rank's own stall (`host_suspects`), so a
    swing of a few milliseconds in a short wait never is a stall."""
    step_s = float(np.median(feats.span_s)) if feats.span_s.size else 0.0
    if step_s <= 0:
        return np.zeros_like(wait)
    share = (wait - ref) / step_s
    z_share = share / noise.sigma("untraced_stall", share, _STALL_SIGMA_FLOOR)
    return np.minimum(np.minimum(z_share, z_peer), z_total)


def _lump(excess: np.ndarray, log_typical: np.ndarray, typical_own: np.ndarray) -> np.ndarray:
    """(N,) bool per group (its extra total wait `excess` s, its typical instance's log
    total now and log change from its usual level): the total rose far more than the
    typical instance's rise accounts for (`_LUMP_RATIO`).

    Then one lump per step explains the wait, even when the typical instance rose
    significantly too: a stalled process whose sends it drives itself (gloo, NCCL's proxy)
    also makes its group wait a little at every collective after a transfer, and that alone
    read the stall as a slow member. A slow member raises every instance alike, so its
    total rises about as its typical instance does. Too little history: no lump."""
    typical_now = np.exp(log_typical)
    with np.errstate(invalid="ignore"):
        typical_excess = typical_now * -np.expm1(-typical_own)
        return np.isfinite(typical_own) & (excess > _LUMP_RATIO * np.maximum(typical_excess, 0.0))


def _stall_origins(
    frame: StepFrame, names: list[str], rank: np.ndarray, z_stall: np.ndarray,
    history: WaitHistory, out: Candidates,
) -> np.ndarray:
    """`z_stall` kept only on the groups that stall most often in their data replica, and
    not in a replica where a traced rank or a node is already a suspect.

    A stall travels down the pipeline: when the lump falls before a send, the next stage's
    untraced receiver is late by as much and its group waits as long as the stalled one's.
    The stalled process's own group waits whatever op the lump falls before; its pipeline
    neighbours only when it falls before a send. Over a few steps the origin is the group of
    its replica (same data-parallel coordinates, any stage) that stalls most often. When the
    stalled (or slow) rank is traced, the views that see it name it, and its replica's
    untraced groups only pass its lateness on. Without coordinates every group keeps its
    reading."""
    rate = history.stall_rates(names, z_stall >= Z_REPORT)
    if rank.size == 0 or (frame.coord("dp") < 0).any():
        return z_stall
    column = _replica_columns(frame)
    most = np.zeros(int(column.max()) + 1)
    np.maximum.at(most, column[rank], rate)
    explained = np.zeros(most.size, dtype=bool)
    explained[column[_suspect_ranks(frame, out)]] = True
    return np.where((rate >= most[column[rank]]) & ~explained[column[rank]], z_stall, 0.0)


def _held_for_origin(
    frame: StepFrame,
    names: list[str],
    rank: np.ndarray,
    inside: np.ndarray,
    z: np.ndarray,
    waits: tuple[np.ndarray, np.ndarray],
    history: WaitHistory,
) -> np.ndarray:
    """(N,) bool: a group named (`z` ≥ Z_REPORT, either reading) that is held, since
    another group of its data replica waited at least half as long and has led at least as
    often lately. Only groups `inside` one replica (tensor-parallel groups; a data-parallel
    one spans them all) are held or hold. `waits`: (N,) lead: the
    group waited long against its stage peers and its traced rank's transfers do not
    explain it (`_downstream`); (N,) excess: seconds over its stage peers.

    An untraced member that stalls, or whose own sends slow with it, makes its pipeline
    neighbour's group wait too whenever the lump falls before a send to it, and the
    neighbour's traced member need not see it in its transfers (it exchanges with the
    stalled one's traced member, on time). One step then shows two groups of a replica
    waiting alike, and cannot tell which waits on the other. The stalled or slow member's
    own group waits in every step, its neighbour's only in some: the group that led most
    often lately is the origin, and a tie names neither until one leads. A group that
    waited far longer than any other of its replica is its own evidence. Without
    coordinates every group keeps its reading."""
    lead, excess = waits
    rate = history.slow_rates(names, lead)
    held = np.zeros(z.size, dtype=bool)
    hit = np.flatnonzero((z >= Z_REPORT) & inside)
    if hit.size == 0 or (frame.coord("dp") < 0).any():
        return held
    column = _replica_columns(frame)[rank]
    rival = (
        (column[None, :] == column[hit, None])
        & (np.arange(z.size)[None, :] != hit[:, None])
        & (lead & inside)[None, :]
        & (excess[None, :] >= 0.5 * excess[hit, None])
        & (rate[None, :] >= rate[hit, None])
    )
    held[hit[rival.any(axis=1)]] = True
    return held


def _replica_columns(frame: StepFrame) -> np.ndarray:
    """(R,) one key per data replica (its dp and cp coordinates, any pipeline stage)."""
    dp, cp = frame.coord("dp").astype(np.int64), frame.coord("cp").astype(np.int64)
    return np.unique(dp * (int(cp.max()) + 2) + cp + 1, return_inverse=True)[1].reshape(-1)


def _suspect_ranks(frame: StepFrame, out: Candidates) -> np.ndarray:
    """Rank indices the step's other views already name: a rank suspect itself, or every
    traced rank of a node suspect."""
    ranks = {int(e[5:]) for e in out.entity if e.startswith("rank:")}
    nodes = {e[5:] for e in out.entity if e.startswith("node:")}
    idx = np.searchsorted(frame.rank, np.fromiter(ranks, dtype=np.int64, count=len(ranks)))
    idx = idx[(idx < frame.n_ranks)]
    idx = idx[np.isin(frame.rank[idx], list(ranks))]
    on_node = np.isin(np.asarray(frame.nodes, dtype=object)[frame.node], list(nodes))
    return np.union1d(idx, np.flatnonzero(on_node)).astype(np.int64)


def _least_waits(
    frame: StepFrame, feats: StepFeatures, measured: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A group's wait in this step, measured twice, over the (group, rank) pairs of the
    measured groups' collectives: (pair group, pair rank, the pair of each group whose rank
    waits least, each pair's total wait s, each group's typical wait s).

    The first is the least-waiting traced member's total. The second is the group's typical
    instance's least wait (its shortest copy) times its instances. A slow GPU makes every
    collective of its group wait and raises both; a GC pause or one long kernel on an
    untraced member makes one of them wait and raises the total only; MoE routing moves
    every instance of a step alike, but the totals' history also holds their wider swings."""
    ri = frame.op_rank_index()
    rows = np.flatnonzero((frame.op_kind == COLL) & measured[frame.op_group])
    pair_key = frame.op_group[rows].astype(np.int64) * frame.n_ranks + ri[rows]
    pairs, inv = np.unique(pair_key, return_inverse=True)
    wait = np.bincount(inv.reshape(-1), weights=frame.op_dur_ns[rows] / 1e9)
    p_group, p_rank = pairs // frame.n_ranks, pairs % frame.n_ranks
    order = np.lexsort((wait, p_group))  # pairs are sorted by group: the first is its least
    rep = order[np.r_[True, p_group[order][1:] != p_group[order][:-1]]]
    inst = feats.inst
    of_group = (inst.kind == COLL) & measured[inst.group]
    n_groups = len(frame.groups)
    typical = grouped_median(inst.transfer_s[of_group], inst.group[of_group], n_groups)
    typical *= np.bincount(inst.group[of_group], minlength=n_groups)
    return p_group, p_rank, rep, wait, typical


def _downstream(
    frame: StepFrame,
    stages: tuple[np.ndarray, int],
    noise: NoiseMemory,
    rank: np.ndarray,
    excess: np.ndarray,
) -> np.ndarray:
    """(N,) bool per group (its traced rank `rank`, its wait `excess` s over its stage
    peers): the rank's p2p transfers also took longer than its stage peers', by at least
    half the group's excess.

    Its group members then arrive late because they wait for the same upstream peer
    (propagation, Holmes' upstream rule), not because one of them is slow. A group that
    waits far longer than its traced rank's transfers ran late waits on a member of its
    own: an untraced straggler whose own sends slow with it holds every all-reduce of its
    group for seconds, and makes its traced peer's transfers a little late too (tens of ms:
    the neighbour stage waited on its late data, and answers late)."""
    keys, n_keys = stages
    ri = frame.op_rank_index()
    p2p = frame.op_kind == P2P
    p2p_s = np.bincount(ri[p2p], weights=frame.op_dur_ns[p2p] / 1e9, minlength=frame.n_ranks)
    p2p_ref = grouped_median(p2p_s, keys, n_keys)[keys]
    with np.errstate(divide="ignore", invalid="ignore"):
        xp = np.where(p2p_ref > 0, np.log(np.maximum(p2p_s, 1e-12) / p2p_ref), 0.0)
    zp = xp / noise.sigma("untraced_p2p", xp[p2p_ref > 0], _SIGMA_FLOOR)
    return (zp[rank] >= Z_REPORT) & ((p2p_s - p2p_ref)[rank] >= 0.5 * excess)


def _places(
    frame: StepFrame,
    pair_group: np.ndarray,
    pair_rank: np.ndarray,
    groups: np.ndarray,
    kinds: list[str],
    home: str | None,
) -> list[str | None]:
    """The node each group's untraced member must be on (see the module docstring), or
    None: a tensor-parallel group whose traced members (the (group, rank) pairs) share a
    node names it; any other group names `home`."""
    lo = np.full(len(frame.groups), np.iinfo(np.int64).max)
    hi = np.full(len(frame.groups), -1)
    nodes = frame.node[pair_rank].astype(np.int64)
    np.minimum.at(lo, pair_group, nodes)
    np.maximum.at(hi, pair_group, nodes)
    return [
        frame.nodes[int(lo[g])] if k == "tp" and lo[g] == hi[g] else home
        for g, k in zip(groups.tolist(), kinds, strict=True)
    ]


def _whole_node_or_gpu(
    frame: StepFrame, rank: np.ndarray, kind: np.ndarray, z_wait: np.ndarray, out: Candidates
) -> None:
    """Re-read a slow rank that is its node's only traced rank: its GPU, or its whole node?

    With one traced rank per node the compute view cannot tell (one rank is all the node it
    sees). The rank's tensor-parallel all-reduces can: a slow GPU arrives last, so its
    untraced peers wait for it and its own copies are SHORTER than its stage peers'; when
    the whole node is slow its peers are as late as it is, and its wait stays usual. A rank
    whose wait is not significantly short is therefore read as its node (`node`).
    """
    counts = np.bincount(frame.node, minlength=len(frame.nodes))
    usual = {
        int(r)
        for r, k, z in zip(rank, kind, z_wait, strict=True)
        if k == "tp" and z > -Z_REPORT and counts[frame.node[r]] == 1
    }
    for c, (entity, kd) in enumerate(zip(out.entity, out.kind, strict=True)):
        if kd != "gpu" or not entity.startswith("rank:"):
            continue
        i = int(np.searchsorted(frame.rank, int(entity[5:])))
        if i in usual and int(frame.rank[i]) == int(entity[5:]):
            out.entity[c] = f"node:{frame.nodes[frame.node[i]]}"
            out.kind[c] = "node"
            out.detail[c] += (
                f" on rank {entity[5:]}, its only traced rank, whose untraced "
                "tensor-parallel peers keep pace with it"
            )
