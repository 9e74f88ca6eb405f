"""The clock machine: one training step of every rank, from per-rank clocks and collective physics.

Each rank keeps its own true clock (ns, float64, relative to job start). An op starts after a
launch gap; a compute op then lasts base × factor × jitter; a collective ends when its LAST
member has arrived plus the transfer time, so every member's copy lasts from its own arrival
to that common end (a late rank's own copy is short, its peers' are long); a p2p transfer ends
when both ends have posted, plus the transfer. A rank that never arrives has clock +inf, which
propagates through max() to everyone who (transitively) waits for it: that is the hang model.

Vectorized over the S ranks of a pipeline stage; Python loops only over microbatches, stages
and op slots (GPipe: all forwards, then all backwards, then dp reduce_scatter, optimizer, dp
all_gather). Ops are recorded as (K, S) arrays per stage, one contiguous row per op slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from producers.simulator.costs import CostModel
from producers.simulator.topology import (
    G_DP,
    G_EP,
    G_NONE,
    G_PP_NEXT,
    G_PP_PREV,
    G_TP,
    Topology,
)
from schemas.rankstep import COLL, COMPUTE, P2P

NAMES: tuple[str, ...] = (
    "embed", "fwd", "bwd", "loss", "expert", "expert_bwd", "optimizer", "checkpoint",
    "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send", "recv",
)  # fmt: skip
(
    EMBED, FWD, BWD, LOSS, EXPERT, EXPERT_BWD, OPTIMIZER, CHECKPOINT,
    ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, ALL_TO_ALL, SEND, RECV,
) = range(len(NAMES))  # fmt: skip


@dataclass
class SeqCounters:
    """Per-group instance counters over the life of the job (never reset per step).

    All groups of one kind on one stage run the same program, so one counter per (kind,
    stage) stands for all of them; p2p has one per pair of neighbouring stages.
    """

    tp: list[int]
    dp: list[int]
    ep: list[int]
    pp: list[int]

    @classmethod
    def fresh(cls, pp: int) -> SeqCounters:
        return cls([0] * pp, [0] * pp, [0] * pp, [0] * max(pp - 1, 0))


@dataclass
class StepInputs:
    """Everything random or faulty about one step, drawn before the step runs."""

    train: bool  # False: forward-only eval step (no bwd, no dp collectives)
    checkpoint_ns: float  # > 0: a trailing 'checkpoint' compute op of about this length
    gaps: list[np.ndarray]  # per stage (K, S) launch gap before each op, ns
    jit: list[np.ndarray]  # per stage (K, S) compute noise factors
    net: list[np.ndarray]  # per stage (K, S) transfer noise (the first member's entry is used)
    main: np.ndarray  # (W,) factor of data-dependent compute (fwd, bwd, ...)
    dev: np.ndarray  # (W,) factor of the optimizer (device only, no data dependence)
    moe: np.ndarray | None  # (W,) expert load of each rank (mean 1 in its ep group)
    xfer: dict[int, list[np.ndarray]]  # per group kind, per stage: transfer ns per instance
    stop: tuple[int, int, int] | None = None  # (stage, op slot, j): a rank stops for good
    hang_dp: tuple[int, int] | None = None  # (stage, tp): that dp reduce_scatter never ends


@dataclass
class StepRecord:
    """One simulated step: per stage (K, S) op times, per slot metadata, rank windows."""

    step: int
    t_start: np.ndarray  # (W,) true clock at step begin (inf: blocked earlier)
    t_end: np.ndarray  # (W,) true clock after the last op (inf: never completes)
    start: list[np.ndarray]  # per stage (K, S)
    end: list[np.ndarray]  # per stage (K, S)
    kind: list[np.ndarray]  # per stage (K,) uint8
    name: list[np.ndarray]  # per stage (K,) int32 index into NAMES
    gtype: list[np.ndarray]  # per stage (K,) int8 group kind (row of Topology.gid)
    seq: list[np.ndarray]  # per stage (K,) int64
    nbytes: list[np.ndarray]  # per stage (K,) int64 (all_to_all rows: see a2a_bytes)
    a2a_bytes: np.ndarray | None  # (W,) all_to_all buffer of each rank (MoE imbalance)
    hang_ns: float | None  # true time the fault stopped a rank / collective, if this step


class StepEngine:
    """Runs steps of one layout; costs are unscaled, `scale` stretches compute and bandwidth."""

    def __init__(self, topo: Topology, microbatches: int, chunks: int, costs: CostModel) -> None:
        self.topo = topo
        self.microbatches = microbatches
        self.chunks = chunks
        self.costs = costs
        self.scale = 1.0

    def n_ops(self, s: int, train: bool, checkpoint: bool) -> int:
        """Ops of a stage-s rank in one step (the engine asserts it fills exactly this many)."""
        lay = self.topo.layout
        inner = self.chunks * (1 + (lay.tp > 1) + 3 * (lay.ep > 1))
        fwd = 2 + inner  # (embed | recv) + chunks + (send | loss)
        n = self.microbatches * fwd
        if train:
            bwd = inner + (s < lay.pp - 1) + (s > 0)
            n += self.microbatches * bwd + 1 + 2 * (lay.dp > 1)
        return n + bool(checkpoint)

    def run(self, step: int, clock: np.ndarray, ctr: SeqCounters, inp: StepInputs) -> StepRecord:
        """Advance `clock` (W,) in place through one step and record every op."""
        topo, lay, c = self.topo, self.topo.layout, self.costs
        P, S, tp, dp, ep = lay.pp, topo.stage_size, lay.tp, lay.dp, lay.ep
        ne = dp // ep
        ns = self.scale * 1e9
        has_ckpt = inp.checkpoint_ns > 0
        K = [self.n_ops(s, inp.train, has_ckpt) for s in range(P)]
        start = [np.empty((k, S)) for k in K]
        end = [np.empty((k, S)) for k in K]
        kind = [np.zeros(k, np.uint8) for k in K]
        name = [np.zeros(k, np.int32) for k in K]
        gtype = [np.zeros(k, np.int8) for k in K]
        seqs = [np.zeros(k, np.int64) for k in K]
        nbytes = [np.zeros(k, np.int64) for k in K]
        cur = [0] * P
        cseq = [0] * P
        t_start = clock.copy()
        clk = [t_start[s * S : (s + 1) * S].copy() for s in range(P)]
        gaps, jit, net = inp.gaps, inp.jit, inp.net
        main = [inp.main[s * S : (s + 1) * S] for s in range(P)]
        dev = [inp.dev[s * S : (s + 1) * S] for s in range(P)]
        if inp.moe is not None:
            moe = [inp.moe[s * S : (s + 1) * S] for s in range(P)]
            expert = [main[s] * moe[s] for s in range(P)]
            a2a_x = [inp.xfer[G_EP][s] * moe[s].reshape(ne, ep, tp).max(axis=1) for s in range(P)]
            a2a_bytes = np.rint(c.a2a_bytes * inp.moe).astype(np.int64)
        else:
            expert, a2a_x, a2a_bytes = main, inp.xfer.get(G_EP, []), None
        xtp, xdp, xpp = inp.xfer[G_TP], inp.xfer[G_DP], inp.xfer[G_PP_NEXT]
        stop = inp.stop
        hang_ns: float | None = None

        def slot(s: int, k: int, nm: int, gt: int, sq: int, nb: int) -> int:
            nonlocal hang_ns
            col = cur[s]
            cur[s] = col + 1
            kind[s][col] = k
            name[s][col] = nm
            gtype[s][col] = gt
            seqs[s][col] = sq
            nbytes[s][col] = nb
            if stop is not None and stop[0] == s and stop[1] == col:
                clk[s] = clk[s].copy()  # clk[s] may be a row of `end`: never write through
                hang_ns = float(clk[s][stop[2]])
                clk[s][stop[2]] = np.inf
            return col

        def compute(s: int, nm: int, base_ns: float, factor: np.ndarray | None) -> None:
            col = slot(s, COMPUTE, nm, G_NONE, cseq[s], 0)
            cseq[s] += 1
            a = start[s][col]
            np.add(clk[s], gaps[s][col], out=a)
            e = end[s][col]
            np.multiply(jit[s][col], base_ns, out=e)
            if factor is not None:
                e *= factor
            e += a
            clk[s] = e

        def coll(s: int, gt: int, nm: int, nb: int) -> None:
            nonlocal hang_ns
            if gt == G_TP:
                sq = ctr.tp[s]
                ctr.tp[s] += 1
            elif gt == G_DP:
                sq = ctr.dp[s]
                ctr.dp[s] += 1
            else:
                sq = ctr.ep[s]
                ctr.ep[s] += 1
            col = slot(s, COLL, nm, gt, sq, nb)
            a = start[s][col]
            np.add(clk[s], gaps[s][col], out=a)
            e = end[s][col]
            n_row = net[s][col]
            if gt == G_TP:
                mx = a.reshape(dp, tp).max(axis=1)
                mx += xtp[s] * n_row[::tp]
                e.reshape(dp, tp)[...] = mx[:, None]
            elif gt == G_DP:
                mx = a.reshape(dp, tp).max(axis=0)
                if inp.hang_dp is not None and inp.hang_dp[0] == s and nm == REDUCE_SCATTER:
                    hang_ns = float(mx[inp.hang_dp[1]])  # the last member just entered
                    mx[inp.hang_dp[1]] = np.inf
                mx += xdp[s] * n_row[:tp]
                e.reshape(dp, tp)[...] = mx[None, :]
            else:
                mx = a.reshape(ne, ep, tp).max(axis=1)
                mx += a2a_x[s] * n_row.reshape(ne, ep, tp)[:, 0, :]
                e.reshape(ne, ep, tp)[...] = mx[:, None, :]
            clk[s] = e

        def p2p(src: int, dst: int, gt_src: int, gt_dst: int, pair: int) -> None:
            sq = ctr.pp[pair]
            ctr.pp[pair] += 1
            cs = slot(src, P2P, SEND, gt_src, sq, c.act_bytes)
            cr = slot(dst, P2P, RECV, gt_dst, sq, c.act_bytes)
            a = start[src][cs]
            np.add(clk[src], gaps[src][cs], out=a)
            b = start[dst][cr]
            np.add(clk[dst], gaps[dst][cr], out=b)
            e = end[src][cs]
            np.maximum(a, b, out=e)
            e += xpp[pair] * net[src][cs]
            e2 = end[dst][cr]
            e2[...] = e
            clk[src] = e
            clk[dst] = e2

        def layer(s: int, nm: int, base: float, enm: int, ebase: float) -> None:
            compute(s, nm, base, main[s])
            if tp > 1:
                coll(s, G_TP, ALL_REDUCE, c.tp_bytes)
            if ep > 1:
                coll(s, G_EP, ALL_TO_ALL, c.a2a_bytes)
                compute(s, enm, ebase, expert[s])
                coll(s, G_EP, ALL_TO_ALL, c.a2a_bytes)

        fwd_ns, exp_ns = c.fwd_s * ns, c.expert_s * ns
        for _m in range(self.microbatches):
            for s in range(P):
                if s == 0:
                    compute(s, EMBED, c.embed_s * ns, main[s])
                for _ in range(self.chunks):
                    layer(s, FWD, fwd_ns, EXPERT, exp_ns)
                if s == P - 1:
                    compute(s, LOSS, c.loss_s * ns, main[s])
                else:
                    p2p(s, s + 1, G_PP_NEXT, G_PP_PREV, s)
        if inp.train:
            bwd_ns, ebwd_ns = c.bwd_s * ns, c.expert_bwd_s * ns
            for _m in range(self.microbatches):
                for s in range(P - 1, -1, -1):
                    for _ in range(self.chunks):
                        layer(s, BWD, bwd_ns, EXPERT_BWD, ebwd_ns)
                    if s > 0:
                        p2p(s, s - 1, G_PP_PREV, G_PP_NEXT, s - 1)
            for s in range(P):
                if dp > 1:
                    coll(s, G_DP, REDUCE_SCATTER, c.grad_bytes)
                compute(s, OPTIMIZER, c.optimizer_s * ns, dev[s])
                if dp > 1:
                    coll(s, G_DP, ALL_GATHER, c.grad_bytes // dp)
        if has_ckpt:
            for s in range(P):
                compute(s, CHECKPOINT, inp.checkpoint_ns, None)
        if cur != K:
            raise AssertionError(f"engine filled {cur} op slots, expected {K}")
        for s in range(P):
            clock[s * S : (s + 1) * S] = clk[s]
        return StepRecord(
            step=step, t_start=t_start, t_end=clock.copy(), start=start, end=end, kind=kind,
            name=name, gtype=gtype, seq=seqs, nbytes=nbytes, a2a_bytes=a2a_bytes,
            hang_ns=hang_ns,
        )  # fmt: skip
