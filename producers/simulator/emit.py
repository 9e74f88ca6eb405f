"""Turn simulated steps into what the outside sees: StepFrames, rank-step messages, heartbeats.

Times are rounded to integer ns once, on the true clock, and every derived number (offsets,
durations, window ends) is a difference of rounded values, so ops stay inside their window,
`t_end_ns` is exactly the end of the last op, and ops of one stream never overlap. Absolute
stamps then get the node's clock offset added (clocks of different nodes disagree; durations
do not). A rank's ops are emitted in start order, as the step assembler orders them: with a
second stream (1F1B's dp reduce_scatter, batched p2p) program order is not start order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from producers.agent.cadence import GridCadence
from producers.simulator.engine import ALL_TO_ALL, NAMES, StepRecord
from producers.simulator.topology import Topology
from schemas.frame import StepFrame
from schemas.rankstep import COMPUTE, COORD_DIMS, RankStep
from schemas.wire import HeartbeatV1, InflightOp


@dataclass
class Clocks:
    """How true (relative, float ns) time becomes each node's absolute stamps."""

    epoch_ns: int  # absolute ns of true time 0 (job start)
    skew_ns: np.ndarray  # (n_nodes,) int64 offset of each node's clock


def _rint(a: np.ndarray) -> np.ndarray:
    return np.rint(a).astype(np.int64)


def _stage_ops(rec: StepRecord, s: int, rows: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """Stage s's start, end (K, S) and kind, name, seq, gtype, nbytes (K,), rows selected."""
    cols = (rec.start[s], rec.end[s], rec.kind[s], rec.name[s], rec.seq[s], rec.gtype[s],
            rec.nbytes[s])  # fmt: skip
    return cols if rows is None else tuple(c[rows] for c in cols)


def build_frame(
    topo: Topology,
    rec: StepRecord,
    job: str,
    clocks: Clocks,
    traced: np.ndarray | None = None,
    comm_only: bool = False,
) -> tuple[StepFrame, np.ndarray] | None:
    """The StepFrame of the ranks that completed `rec` (None if none did) and their true t_end.

    Ranks that never complete the step (hung, or waiting on a hung peer) are `missing`. With
    a `traced` (world,) mask only those ranks report, and only they can be missing: nobody
    expects a rank that never reported. `comm_only` drops every compute op (collective and
    p2p logging); the rank's window is unchanged, its compute simply not itemized.
    """
    P, S = topo.layout.pp, topo.stage_size
    finite = np.isfinite(rec.t_end)
    done = finite if traced is None else finite & traced
    if not done.any():
        return None
    done_s = [done[s * S : (s + 1) * S] for s in range(P)]
    n_s = [int(d.sum()) for d in done_s]
    rows = [np.flatnonzero(rec.kind[s] != COMPUTE) if comm_only else None for s in range(P)]
    k_s = [rec.start[s].shape[0] if r is None else r.size for s, r in enumerate(rows)]
    n_ops = sum(n * k for n, k in zip(n_s, k_s, strict=True))
    op_kind = np.empty(n_ops, np.uint8)
    op_name = np.empty(n_ops, np.int32)
    op_group = np.empty(n_ops, np.int32)
    op_seq = np.empty(n_ops, np.int64)
    op_start = np.empty(n_ops, np.int64)
    op_dur = np.empty(n_ops, np.int64)
    op_bytes = np.empty(n_ops, np.int64)
    ranks, counts = [], []
    lo = 0
    for s in range(P):
        n, k, d = n_s[s], k_s[s], done_s[s]
        if n == 0:
            continue
        hi = lo + n * k
        full = n == S
        sl = slice(s * S, (s + 1) * S)
        start_s, end_s, kind_s, name_s, seq_s, gtype_s, bytes_s = _stage_ops(rec, s, rows[s])
        # each destination is viewed as (n ranks, K ops): writing a transposed (K, n) block
        # into it lays the ops out rank-major without an intermediate copy; per-slot columns
        # (K,) broadcast, unless a rank's ops had to be sorted: then they are (n, K) too
        st = start_s if full else start_s[:, d]
        en = end_s if full else end_s[:, d]
        ts = _rint(rec.t_start[sl] if full else rec.t_start[sl][d])
        # (n ranks, K ops) transposed views: the frame's rank-major layout, without a copy
        sti, eni = _rint(st).T, _rint(en).T
        gid = topo.gid[s][gtype_s]  # (K, S)
        gid = (gid if full else gid[:, d]).T
        if k > 1 and (sti[:, 1:] < sti[:, :-1]).any():  # a second stream: sort by start
            order = np.argsort(sti, axis=1, kind="stable")
            sti, eni, gid = (np.take_along_axis(a, order, 1) for a in (sti, eni, gid))
            kind_s, name_s, seq_s, bytes_s = (kind_s[order], name_s[order], seq_s[order],
                                              bytes_s[order])  # fmt: skip
        np.subtract(sti, ts[:, None], out=op_start[lo:hi].reshape(n, k))
        np.subtract(eni, sti, out=op_dur[lo:hi].reshape(n, k))
        op_kind[lo:hi].reshape(n, k)[...] = kind_s
        op_name[lo:hi].reshape(n, k)[...] = name_s
        op_seq[lo:hi].reshape(n, k)[...] = seq_s
        op_group[lo:hi].reshape(n, k)[...] = gid
        nb = op_bytes[lo:hi].reshape(n, k)
        nb[...] = bytes_s
        if rec.a2a_bytes is not None:
            a2a = (rec.a2a_bytes[sl] if full else rec.a2a_bytes[sl][d])[:, None]
            np.copyto(nb, a2a, where=name_s == ALL_TO_ALL)
        ranks.append(np.flatnonzero(d) + s * S)
        counts.append(np.full(n, k, dtype=np.int64))
        lo = hi
    rank = np.concatenate(ranks).astype(np.int64)
    node = topo.node_of[rank]
    t0 = _rint(rec.t_start[rank])
    t1 = _rint(rec.t_end[rank])
    skew = clocks.epoch_ns + clocks.skew_ns[node]
    off = np.zeros(rank.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.concatenate(counts), out=off[1:])
    frame = StepFrame(
        job=job,
        step=rec.step,
        rank=rank,
        node=node.astype(np.int32),
        nodes=topo.node_names,
        local_rank=topo.local_rank[rank],
        coords=topo.coords[rank],
        t_start_ns=t0 + skew,
        t_end_ns=t1 + skew,
        off=off,
        op_kind=op_kind,
        op_name=op_name,
        op_group=op_group,
        op_seq=op_seq,
        op_start_ns=op_start,
        op_dur_ns=op_dur,
        op_bytes=op_bytes,
        names=list(NAMES),
        groups=topo.groups,
        missing=np.flatnonzero(~finite if traced is None else traced & ~finite).astype(np.int64),
    )
    return frame, t1


def _coords(frame: StepFrame, i: int) -> dict[str, int]:
    return {
        dim: int(v) for dim, v in zip(COORD_DIMS, frame.coords[i].tolist(), strict=True) if v >= 0
    }


def rank_step(frame: StepFrame, i: int) -> RankStep:
    """Row i of a frame as the decoded form of its `flare.steps.v1` message."""
    lo, hi = int(frame.off[i]), int(frame.off[i + 1])
    names, groups = frame.names, frame.groups
    return RankStep(
        job=frame.job,
        rank=int(frame.rank[i]),
        node=frame.nodes[int(frame.node[i])],
        step=frame.step,
        t_start_ns=int(frame.t_start_ns[i]),
        t_end_ns=int(frame.t_end_ns[i]),
        kind=frame.op_kind[lo:hi],
        name=[names[k] for k in frame.op_name[lo:hi].tolist()],
        group=[groups[g] for g in frame.op_group[lo:hi].tolist()],
        seq=frame.op_seq[lo:hi],
        start_ns=frame.op_start_ns[lo:hi],
        dur_ns=frame.op_dur_ns[lo:hi],
        bytes=frame.op_bytes[lo:hi],
        local_rank=int(frame.local_rank[i]),
        coords=_coords(frame, i),
    )


def steps_value(frame: StepFrame, i: int) -> dict[str, Any]:
    """Row i of a frame as its `flare.steps.v1` value (plain lists: any JSON encoder)."""
    return rank_step(frame, i).to_wire()


def rank_steps(frame: StepFrame) -> list[RankStep]:
    return [rank_step(frame, i) for i in range(frame.n_ranks)]


@dataclass
class HeartbeatBatch:
    """Heartbeats of the ranks during one step's windows, sorted by true time."""

    step: int
    t: np.ndarray  # (n,) int64 true time
    rank: np.ndarray  # (n,) int64
    busy: np.ndarray  # (n,) bool: a coll/p2p op is in flight
    group: np.ndarray  # (n,) int32 group index of the op in flight
    name: np.ndarray  # (n,) int32
    seq: np.ndarray  # (n,) int64
    op_start: np.ndarray  # (n,) int64 true start of the op in flight

    def __len__(self) -> int:
        return int(self.t.shape[0])

    def of_ranks(self, mask: np.ndarray) -> HeartbeatBatch | None:
        """The heartbeats of the ranks where the (world,) `mask` is true (None if none)."""
        keep = mask[self.rank]
        if not keep.any():
            return None
        return HeartbeatBatch(self.step, self.t[keep], self.rank[keep], self.busy[keep],
                              self.group[keep], self.name[keep], self.seq[keep],
                              self.op_start[keep])  # fmt: skip


def heartbeat_batch(
    topo: Topology,
    rec: StepRecord,
    phase: np.ndarray,
    period: float,
    stop: float,
    cadence: GridCadence | None = None,
) -> HeartbeatBatch | None:
    """Heartbeats at phase_r + n·period that fall in each rank's window of this step.

    The window ends at the rank's t_end or at `stop` (true time after which every rank has
    stopped reporting, e.g. 40 s after a hang). The op in flight is the coll/p2p whose
    [start, end) holds the heartbeat time; a blocked rank's op has end = inf, so it stays in
    flight; a hung rank's unstarted ops have start = inf, so it reports none. With a
    `cadence`, only the samples it selects are returned and its state moves on (steps must
    then be passed in order); without one, every sample is (1 Hz).
    """
    P, S = topo.layout.pp, topo.stage_size
    out: dict[str, list[np.ndarray]] = {
        k: [] for k in ("t", "rank", "busy", "group", "name", "seq", "op_start")
    }
    for s in range(P):
        sl = slice(s * S, (s + 1) * S)
        ts = rec.t_start[sl]
        te = np.minimum(rec.t_end[sl], stop)
        ok = np.isfinite(ts) & np.isfinite(te) & (te > ts)
        if not ok.any():
            continue
        ph = phase[sl]
        ts_ok = np.where(ok, ts, 0.0)
        te_ok = np.where(ok, te, 0.0)
        lo = np.ceil((ts_ok - ph) / period)
        hi = np.ceil((te_ok - ph) / period)
        cnt = np.where(ok, np.maximum(hi - lo, 0), 0).astype(np.int64)
        tot = int(cnt.sum())
        if tot == 0:
            continue
        j = np.repeat(np.arange(S), cnt)
        first = np.repeat(np.cumsum(cnt) - cnt, cnt)
        n = lo[j] + (np.arange(tot) - first)
        x = ph[j] + n * period
        st = rec.start[s][:, j]
        inside = (st <= x) & (x < rec.end[s][:, j]) & (rec.kind[s] != COMPUTE)[:, None]
        busy = inside.any(axis=0)
        col = inside.argmax(axis=0)
        rank = j + s * S
        group = topo.gid[s][rec.gtype[s][col], j]
        seq = rec.seq[s][col]
        op_st = st[col, np.arange(tot)]
        keep: slice | np.ndarray = slice(None)
        if cadence is not None:
            long = busy & (x - op_st >= cadence.long_ns)
            long_g = np.where(long, group, -1).astype(np.int64)
            long_s = np.where(long, seq, -1).astype(np.int64)
            keep = cadence.select(rank, n.astype(np.int64), cnt, long_g, long_s)
        out["t"].append(_rint(x[keep]))
        out["rank"].append(rank[keep])
        out["busy"].append(busy[keep])
        out["group"].append(group[keep])
        out["name"].append(rec.name[s][col][keep])
        out["seq"].append(seq[keep])
        out["op_start"].append(_rint(np.where(busy, op_st, 0.0)[keep]))
    if not out["t"]:
        return None
    cat = {k: np.concatenate(v) for k, v in out.items()}
    if cat["t"].shape[0] == 0:
        return None
    order = np.argsort(cat["t"], kind="stable")
    return HeartbeatBatch(step=rec.step, **{k: v[order] for k, v in cat.items()})


def _hb_columns(b: HeartbeatBatch, topo: Topology, clocks: Clocks) -> tuple[list, ...]:
    """Per heartbeat: node name, stamp, busy, group, op name, seq, op start (node clock)."""
    node = topo.node_of[b.rank]
    off = clocks.epoch_ns + clocks.skew_ns[node]
    names, groups = topo.node_names, topo.groups
    return (
        [names[n] for n in node.tolist()], (b.t + off).tolist(), b.busy.tolist(),
        [groups[g] for g in b.group.tolist()], [NAMES[k] for k in b.name.tolist()],
        b.seq.tolist(), (b.op_start + off).tolist(),
    )  # fmt: skip


def heartbeat_values(b: HeartbeatBatch, job: str, topo: Topology, clocks: Clocks) -> list[dict]:
    """Every heartbeat of a batch as a `flare.heartbeats.v1` value (node clock stamps)."""
    node, ts, busy, group, name, seq, op_start = _hb_columns(b, topo, clocks)
    out = []
    for i, r in enumerate(b.rank.tolist()):
        inflight = []
        if busy[i]:
            inflight.append(
                {"group": group[i], "name": name[i], "seq": seq[i], "start_ns": op_start[i]}
            )
        out.append({"v": 1, "job": job, "rank": r, "node": node[i], "ts_ns": ts[i],
                    "step": b.step, "inflight": inflight})  # fmt: skip
    return out


def heartbeat_structs(
    b: HeartbeatBatch, job: str, topo: Topology, clocks: Clocks
) -> list[HeartbeatV1]:
    """Every heartbeat of a batch as the decoded message type (built directly: at 60 s
    steps a run has a million of them, and the dict detour doubled their cost)."""
    node, ts, busy, group, name, seq, op_start = _hb_columns(b, topo, clocks)
    step = b.step
    return [
        HeartbeatV1(
            v=1,
            job=job,
            rank=r,
            node=node[i],
            ts_ns=ts[i],
            step=step,
            inflight=[InflightOp(group=group[i], name=name[i], seq=seq[i], start_ns=op_start[i])]
            if busy[i]
            else [],
        )  # fmt: skip
        for i, r in enumerate(b.rank.tolist())
    ]
