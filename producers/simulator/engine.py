"""The clock machine: one training step of every rank, from per-rank clocks and collective physics.

Each rank keeps its own true clock (ns, float64, relative to job start). An op starts after a
launch gap; a compute op then lasts base × factor × jitter; a collective ends when its LAST
member has arrived plus the transfer time, so every member's copy lasts from its own arrival
to that common end (a late rank's own copy is short, its peers' are long); a p2p transfer ends
when both ends have posted, plus the transfer. A rank that never arrives has clock +inf, which
propagates through max() to everyone who (transitively) waits for it: that is the hang model.

Vectorized over the S ranks of a pipeline stage; Python loops only over microbatches, stages
and op slots. Each stage runs a program (`stage_program`) of forward and backward phases and
batches of p2p transfers; a scheduler advances every stage until it waits for a neighbour that
has not posted its side of a transfer yet, so any pipeline schedule runs without a global
order. Ops are recorded as (K, S) arrays per stage, one contiguous row per op slot, in
program order.

Schedules (`SCHEDULES`):
- "gpipe": all forwards, then all backwards, then dp reduce_scatter, optimizer, dp all_gather;
  every p2p op alone. One stream: a rank's ops never overlap.
- "1f1b" (Megatron's non-interleaved schedule): stage s runs min(P-s-1, M) warm-up forwards,
  then alternates one forward and one backward, then the remaining backwards; in the steady
  state a send is posted together with the next recv of the other direction (Megatron's
  batched send_forward_recv_backward / send_backward_recv_forward, without which blocking
  sends deadlock). Data-parallel gradients are reduce_scattered in one bucket per chunk,
  each launched right after that chunk's backward of the last microbatch on a separate
  communication stream, overlapped with the remaining backward; the optimizer waits for
  the last bucket, the all_gather follows it as in GPipe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from producers.simulator.costs import CostModel
from producers.simulator.scenario import SCHEDULES, Schedule
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
    hang_dp: tuple[int, int] | None = None  # (stage, tp): its (first) dp reduce_scatter never ends
    # a burst within the step: `xfer` as the fault stretches it, and per stage the op slots
    # [from, to) it holds for (a transfer by its sending slot); `xfer` holds elsewhere
    burst: tuple[dict[int, list[np.ndarray]], list[tuple[int, int]]] | None = None
    # a NIC slow only sending: (W,) its node's ranks, and every transfer as it is healthy
    # (kind → per stage, as `xfer`); those ranks' copies end with the healthy transfer,
    # and a pipeline transfer is slow only from them
    oneway: tuple[np.ndarray, dict[int, list[np.ndarray]]] | None = None


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


class Xfer(NamedTuple):
    """One p2p transfer of a step, as the two stages' programs both name it."""

    pair: int  # between stages pair and pair + 1
    back: bool  # False: activations pair → pair+1 (forward); True: gradients pair+1 → pair
    m: int  # microbatch


class Item(NamedTuple):
    """One entry of a stage's program: a compute phase, or p2p ops posted together."""

    phase: int  # FWD_PHASE, BWD_PHASE or P2P_BATCH
    m: int = 0  # microbatch of a compute phase
    ops: tuple[tuple[Xfer, bool], ...] = ()  # P2P_BATCH: (transfer, this stage sends it)


FWD_PHASE, BWD_PHASE, P2P_BATCH = range(3)


def stage_program(
    schedule: Schedule, s: int, pp: int, microbatches: int, train: bool
) -> list[Item]:
    """The program of a stage-s rank in one step: compute phases and p2p batches in order.

    A forward phase is (embed | recv) + chunks + (send | loss), a backward phase (recv) +
    chunks + (send); the p2p ops at their edges are items of their own so that 1F1B can post
    a send together with the recv that follows it in the other direction.
    """
    M = microbatches

    def fwd(m: int) -> list[Item]:
        out = [Item(P2P_BATCH, ops=((Xfer(s - 1, False, m), False),))] if s > 0 else []
        out.append(Item(FWD_PHASE, m))
        if s < pp - 1:
            out.append(Item(P2P_BATCH, ops=((Xfer(s, False, m), True),)))
        return out

    def bwd(m: int) -> list[Item]:
        out = [Item(P2P_BATCH, ops=((Xfer(s, True, m), False),))] if s < pp - 1 else []
        out.append(Item(BWD_PHASE, m))
        if s > 0:
            out.append(Item(P2P_BATCH, ops=((Xfer(s - 1, True, m), True),)))
        return out

    items = [it for m in range(M) for it in fwd(m)]
    if not train:
        return items
    if schedule == "gpipe":
        return items + [it for m in range(M) for it in bwd(m)]
    warm = min(pp - s - 1, M)
    items = [it for m in range(warm) for it in fwd(m)]
    for i in range(M - warm):
        items += fwd(warm + i) + bwd(i)
    items += [it for m in range(M - warm, M) for it in bwd(m)]
    # a send followed by a recv of the other direction is one batch: with blocking sends,
    # stage s would wait in send_forward for s+1, which waits in send_backward for s
    out: list[Item] = []
    for it in items:
        prev = out[-1] if out else None
        if (
            prev is not None and it.phase == P2P_BATCH and prev.phase == P2P_BATCH
            and len(prev.ops) == 1 and prev.ops[0][1] and not it.ops[0][1]
            and prev.ops[0][0].back != it.ops[0][0].back
        ):  # fmt: skip
            out[-1] = Item(P2P_BATCH, ops=prev.ops + it.ops)
        else:
            out.append(it)
    return out


def transfer_order(programs: list[list[Item]]) -> tuple[dict[Xfer, int], list[int]]:
    """Seq offset of every transfer in its pair's counter, and the transfers per pair.

    Transfers of a pair are numbered in the order of the upstream stage's program: both ends
    then agree on every seq, although the downstream stage may list a batch's two transfers
    the other way round.
    """
    offset: dict[Xfer, int] = {}
    count = [0] * max(len(programs) - 1, 0)
    for s, prog in enumerate(programs[:-1]):
        for it in prog:
            for x, _ in it.ops:
                if x.pair == s:
                    offset[x] = count[s]
                    count[s] += 1
    return offset, count


class StepEngine:
    """Runs steps of one layout; costs are unscaled, `scale` stretches compute and bandwidth."""

    def __init__(
        self,
        topo: Topology,
        microbatches: int,
        chunks: int,
        costs: CostModel,
        schedule: Schedule = "gpipe",
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
        self.topo = topo
        self.microbatches = microbatches
        self.chunks = chunks
        self.costs = costs
        self.schedule = schedule
        self.scale = 1.0
        P = topo.layout.pp
        # programs and p2p numbering depend only on the layout and the kind of step
        self._programs = {
            train: [stage_program(schedule, s, P, microbatches, train) for s in range(P)]
            for train in (False, True)
        }
        self._xfers = {train: transfer_order(self._programs[train]) for train in (False, True)}
        # dp gradient buckets of the overlapped reduce_scatter: one per chunk, same total
        g = costs.grad_bytes
        self.buckets = [g // chunks + (b < g % chunks) for b in range(chunks)]

    @property
    def overlap(self) -> bool:
        """Whether the dp reduce_scatter runs in buckets on a stream of its own (1F1B)."""
        return self.schedule == "1f1b"

    def n_ops(self, s: int, train: bool, checkpoint: bool) -> int:
        """Ops of a stage-s rank in one step (the engine asserts it fills exactly this many)."""
        lay = self.topo.layout
        inner = self.chunks * (1 + (lay.tp > 1) + 3 * (lay.ep > 1))
        fwd = 2 + inner  # (embed | recv) + chunks + (send | loss)
        n = self.microbatches * fwd
        if train:
            bwd = inner + (s < lay.pp - 1) + (s > 0)
            rs = self.chunks if self.overlap else 1  # reduce_scatters: buckets or one
            n += self.microbatches * bwd + 1 + (rs + 1) * (lay.dp > 1)
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
        stream = [t_start[s * S : (s + 1) * S] for s in range(P)]  # dp comm stream (1F1B)
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
        burst = inp.burst
        if burst is not None:
            bx, span = burst
            btp, bdp, bpp = bx[G_TP], bx[G_DP], bx[G_PP_NEXT]
            b_a2a = ([bx[G_EP][s] * moe[s].reshape(ne, ep, tp).max(axis=1) for s in range(P)]
                     if inp.moe is not None else bx.get(G_EP, []))

        def burst_at(s: int, col: int) -> bool:
            return burst is not None and span[s][0] <= col < span[s][1]

        if inp.oneway is not None:
            sender = [inp.oneway[0][s * S : (s + 1) * S] for s in range(P)]
            healthy = inp.oneway[1]
            ok_a2a = ([healthy[G_EP][s] * moe[s].reshape(ne, ep, tp).max(axis=1)
                       for s in range(P)] if inp.moe is not None else healthy.get(G_EP, []))

        def copies_end(s: int, e: np.ndarray, shape: tuple[int, ...], axis: int,
                       late: np.ndarray, on_time: Callable[[], np.ndarray]) -> None:
            """Every copy `e` (stage s's ranks laid out as `shape`) of each instance ends at
            `late` (the instance's end, over `axis`); under a one-way NIC its own ranks'
            copies end `on_time` (their data came in healthy)."""
            view = e.reshape(shape)
            late = np.expand_dims(late, axis)
            if inp.oneway is None or not sender[s].any():
                view[...] = late
                return
            view[...] = np.where(sender[s].reshape(shape), np.expand_dims(on_time(), axis), late)
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

        def coll(s: int, gt: int, nm: int, nb: int, bucket: int | None = None) -> None:
            """A collective on the main stream, or (`bucket`) a dp reduce_scatter of one
            gradient bucket on the comm stream: it starts when both the main stream has
            launched it and the stream's previous op has ended, its transfer is the bucket's
            share of the whole one (latency too), and the main stream does not wait for it."""
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
            if bucket is not None:
                np.maximum(a, stream[s], out=a)
            e = end[s][col]
            n_row = net[s][col]
            hit = burst_at(s, col)
            if gt == G_TP:
                mx = a.reshape(dp, tp).max(axis=1)
                copies_end(s, e, (dp, tp), 1, mx + (btp if hit else xtp)[s] * n_row[::tp],
                           lambda: mx + healthy[G_TP][s] * n_row[::tp])
            elif gt == G_DP:
                mx = a.reshape(dp, tp).max(axis=0)
                hd = inp.hang_dp
                if hd is not None and hd[0] == s and nm == REDUCE_SCATTER and not bucket:
                    hang_ns = float(mx[hd[1]])  # the last member just entered (its 1st bucket)
                    mx[hd[1]] = np.inf
                share = 1.0 if bucket is None else nb / c.grad_bytes
                copies_end(s, e, (dp, tp), 0, mx + (bdp if hit else xdp)[s] * share * n_row[:tp],
                           lambda: mx + healthy[G_DP][s] * share * n_row[:tp])
            else:
                mx = a.reshape(ne, ep, tp).max(axis=1)
                n_ep = n_row.reshape(ne, ep, tp)[:, 0, :]
                copies_end(s, e, (ne, ep, tp), 1, mx + (b_a2a if hit else a2a_x)[s] * n_ep,
                           lambda: mx + ok_a2a[s] * n_ep)
            if bucket is None:
                clk[s] = e
            else:
                stream[s] = e

        offset, n_xfer = self._xfers[inp.train]
        posted: dict[Xfer, list[int]] = {}  # per transfer: [send col, recv col], -1 unposted

        def post(s: int, ops: tuple[tuple[Xfer, bool], ...]) -> None:
            """Post a batch's ops from the stage's clock; a transfer whose other end has
            posted too ends at the later post plus the transfer, on both ends."""
            for x, send in ops:
                gt = G_PP_NEXT if x.pair == s else G_PP_PREV
                col = slot(s, P2P, SEND if send else RECV, gt, ctr.pp[x.pair] + offset[x],
                           c.act_bytes)  # fmt: skip
                np.add(clk[s], gaps[s][col], out=start[s][col])
                cols = posted.setdefault(x, [-1, -1])
                cols[0 if send else 1] = col
                if min(cols) < 0:
                    continue
                src, dst = (x.pair + 1, x.pair) if x.back else (x.pair, x.pair + 1)
                cs, cr = cols
                e = end[src][cs]
                np.maximum(start[src][cs], start[dst][cr], out=e)
                took = (bpp if burst_at(src, cs) else xpp)[x.pair]
                if inp.oneway is not None:  # slow only from the NIC's own ranks
                    took = np.where(sender[src], took, healthy[G_PP_NEXT][x.pair])
                e += took * net[src][cs]
                end[dst][cr][...] = e

        def matched(ops: tuple[tuple[Xfer, bool], ...]) -> bool:
            return all(min(posted[x]) >= 0 for x, _ in ops)

        def finish(s: int, ops: tuple[tuple[Xfer, bool], ...]) -> None:
            """The stage goes on when every op of its batch has ended."""
            rows = [end[s][posted[x][0 if send else 1]] for x, send in ops]
            clk[s] = rows[0] if len(rows) == 1 else np.maximum(rows[0], rows[1])

        def layer(s: int, nm: int, base: float, enm: int, ebase: float) -> None:
            compute(s, nm, base, main[s])
            if tp > 1:
                coll(s, G_TP, ALL_REDUCE, c.tp_bytes)
            if ep > 1:
                coll(s, G_EP, ALL_TO_ALL, c.a2a_bytes)
                compute(s, enm, ebase, expert[s])
                coll(s, G_EP, ALL_TO_ALL, c.a2a_bytes)

        fwd_ns, exp_ns = c.fwd_s * ns, c.expert_s * ns
        bwd_ns, ebwd_ns = c.bwd_s * ns, c.expert_bwd_s * ns
        last = self.microbatches - 1
        overlap = self.overlap and dp > 1

        def run_phase(s: int, it: Item) -> None:
            if it.phase == FWD_PHASE:
                if s == 0:
                    compute(s, EMBED, c.embed_s * ns, main[s])
                for _ in range(self.chunks):
                    layer(s, FWD, fwd_ns, EXPERT, exp_ns)
                if s == P - 1:
                    compute(s, LOSS, c.loss_s * ns, main[s])
                return
            for b in range(self.chunks):
                layer(s, BWD, bwd_ns, EXPERT_BWD, ebwd_ns)
                if overlap and it.m == last:  # this chunk's gradients are final
                    coll(s, G_DP, REDUCE_SCATTER, self.buckets[b], bucket=b)

        programs = self._programs[inp.train]
        pc = [0] * P
        waiting = [False] * P  # the stage has posted the batch at pc and waits for its peers
        while any(pc[s] < len(programs[s]) for s in range(P)):
            moved = False
            for s in range(P):
                prog = programs[s]
                while pc[s] < len(prog):
                    it = prog[pc[s]]
                    if it.phase == P2P_BATCH:
                        if not waiting[s]:
                            post(s, it.ops)
                            waiting[s] = moved = True
                        if not matched(it.ops):
                            break
                        finish(s, it.ops)
                        waiting[s] = False
                    else:
                        run_phase(s, it)
                    pc[s] += 1
                    moved = True
            if not moved:
                raise AssertionError(f"{self.schedule} deadlocked at program items {pc}")
        for pair, n in enumerate(n_xfer):
            ctr.pp[pair] += n
        if inp.train:
            for s in range(P):
                if overlap:
                    clk[s] = np.maximum(clk[s], stream[s])  # every bucket reduced
                elif dp > 1:
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
