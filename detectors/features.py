"""Per-step features: where each rank's time went, and what each collective instance shows.

Durations, not absolute timestamps, carry the signal (DESIGN §1): clocks of different nodes
disagree, but within one rank the offsets are exact. For a collective instance the copies end
together when the last member arrives plus the transfer time, so the SHORTEST copy is the
last arriver's and approximates the transfer; every other member's excess over it is waiting.

Two ranks all-reduce after computing 10 ms and 30 ms; the all-reduce ends 5 ms after the
last arrival, so rank 0 waits 20 ms for rank 1 and the transfer is 5 ms:

>>> from detectors.testing import frame_of, rank_step
>>> frame = frame_of([
...     rank_step(r, "n0", 0, [("compute", "fwd", "", 0, 0.0, c, 0),
...                            ("coll", "all_reduce", "tp.0", 1, c, 35.0 - c, 1024)])
...     for r, c in ((0, 10.0), (1, 30.0))
... ])
>>> f = step_features(frame)
>>> (f.compute_s * 1e3).round(3).tolist(), (f.wait_s * 1e3).round(3).tolist()
([10.0, 30.0], [20.0, 0.0])
>>> (f.inst.transfer_s * 1e3).round(3).tolist(), (f.caused_wait_s * 1e3).round(3).tolist()
([5.0], [0.0, 10.0])
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.clock import NS_PER_S
from schemas.frame import StepFrame
from schemas.rankstep import COMPUTE, P2P

# Durations become seconds by multiplying with the reciprocal, as the detectors were
# calibrated: dividing by NS_PER_S rounds the last bit of some durations differently.
_S_PER_NS = 1 / NS_PER_S
_SEQ_BITS = 40  # seq bits in the sort key of the sparse fallback (group code above them)


@dataclass(slots=True)
class Instances:
    """Collective / p2p instances of one step: one (group, seq) each, arrays (I,)."""

    group: np.ndarray  # int32 frame group code
    seq: np.ndarray  # int64
    kind: np.ndarray  # uint8
    name: np.ndarray  # int32 frame name code (of the first copy)
    n_copies: np.ndarray  # int64
    transfer_s: np.ndarray  # shortest copy: the last arriver's, ≈ pure transfer
    mean_s: np.ndarray  # mean copy duration
    bytes: np.ndarray  # the first copy's buffer size
    cross_node: np.ndarray  # bool: members on more than one node
    # copy-level view (C copies, in op order)
    copy_inst: np.ndarray  # (C,) instance index
    copy_rank: np.ndarray  # (C,) rank index
    copy_wait_s: np.ndarray  # (C,) own duration - transfer: time spent waiting for peers
    copy_late_s: np.ndarray  # (C,) mean duration - own duration: arrived later than average
    send_copy: np.ndarray  # (I,) position of a p2p instance's send copy among the C, else -1
    recv_copy: np.ndarray  # (I,) position of a p2p instance's recv copy among the C, else -1

    def copy_rank_at(self, copy: np.ndarray) -> np.ndarray:
        """Rank index of each copy position in `copy` (-1 stays -1): e.g. which rank sent
        each p2p instance, `copy_rank_at(send_copy)`."""
        if self.copy_rank.size == 0:
            return np.full(copy.size, -1, dtype=np.int64)
        return np.where(copy >= 0, self.copy_rank[np.maximum(copy, 0)], -1)


@dataclass(slots=True)
class StepFeatures:
    """Per-rank time budget (arrays (R,), seconds) and the step's instances."""

    span_s: np.ndarray
    compute_s: np.ndarray
    routed_s: np.ndarray  # the part of compute_s whose amount the data routes (`routed_compute`)
    comm_s: np.ndarray
    gap_s: np.ndarray
    wait_s: np.ndarray
    caused_wait_s: np.ndarray
    n_ops: np.ndarray
    has_compute: bool
    inst: Instances


def rank_sums(frame: StepFrame, values: np.ndarray) -> np.ndarray:
    """(R,) float sum of a per-op column over each rank's rows (0 for a rank with none).

    One sequential pass over the rows, which lie rank after rank: `bincount` with weights
    costs twice as much on the ~14 M ops of a 16,384-GPU step.
    """
    return _per_rank(frame, values, np.add, 0.0)


def rank_max(frame: StepFrame, values: np.ndarray) -> np.ndarray:
    """(R,) the largest of a per-op column over each rank's rows (-inf for a rank with none),
    in the same one pass as `rank_sums` (`ufunc.at` costs several times as much)."""
    return _per_rank(frame, values, np.maximum, -np.inf)


def _per_rank(frame: StepFrame, values: np.ndarray, ufunc: np.ufunc, empty: float) -> np.ndarray:
    first, has = frame.off[:-1], frame.off[:-1] < frame.off[1:]
    out = np.full(frame.n_ranks, empty)
    if has.any():
        out[has] = ufunc.reduceat(values, first[has])
    return out


def _busy_ns(frame: StepFrame, ri: np.ndarray) -> np.ndarray:
    """Time covered by at least one op per rank (ops may overlap: async p2p, streams)."""
    n = frame.n_ops
    if n == 0:
        return np.zeros(frame.n_ranks)
    start = frame.op_start_ns
    end = start + frame.op_dur_ns
    run = ri << 42  # offsets < 2^42 ns (~73 min); ranks < 2^21
    run += end
    np.maximum.accumulate(run, out=run)  # the latest end so far, never across a rank
    prev = np.empty_like(run)  # the latest end before each op in its rank (0 at its first)
    prev[0] = 0
    np.subtract(run[:-1], ri[1:] << 42, out=prev[1:])
    first = frame.off[:-1]
    prev[first[first < n]] = 0
    np.maximum(start, prev, out=prev)
    np.subtract(end, prev, out=end)
    return rank_sums(frame, np.maximum(end, 0, out=end))


def instance_ids(group: np.ndarray, seq: np.ndarray, n_groups: int) -> tuple[np.ndarray, int]:
    """Dense instance id of every (group, seq) copy, without sorting the copies by seq.

    >>> ids, n = instance_ids(np.array([0, 1, 0, 1, 0]), np.array([7, 3, 7, 3, 8]), 2)
    >>> ids.tolist(), n
    ([0, 2, 0, 2, 1], 3)

    `seq` is a per-group counter, so within one step each group's seqs fill a short range:
    ids are the group's base offset plus (seq - the group's first seq this step). Sorting
    millions of (group, seq) keys would cost more than the whole diagnosis of a step.
    """
    if group.size == 0:
        return np.zeros(0, dtype=np.int64), 0
    gmin, gmax = _seq_range(group, seq, n_groups)
    width = np.where(gmax >= gmin, gmax - gmin + 1, 0)
    if int(width.sum()) > 4 * group.size + 1024:  # sparse seqs: fall back to a sort
        key = (group.astype(np.int64) << _SEQ_BITS) | (seq & ((1 << _SEQ_BITS) - 1))
        _, inv = np.unique(key, return_inverse=True)
        inv = inv.reshape(-1)
        return inv, int(inv.max()) + 1
    base = np.zeros(n_groups, dtype=np.int64)
    np.cumsum(width[:-1], out=base[1:])
    slot = base[group] + (seq - gmin[group])
    used = np.bincount(slot, minlength=int(width.sum())) > 0
    renum = np.cumsum(used) - 1
    return renum[slot], int(used.sum())


def _seq_range(group: np.ndarray, seq: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(n_groups,) first and last seq of each group (int64's extremes where it has none).

    A stable argsort of the small group codes and one reduce per group run: `ufunc.at`
    over the millions of copies of a 16,384-GPU step took 4.5× as long. Codes of fewer than
    65,536 groups are sorted as uint16, which numpy radix-sorts: 3.8× faster than int32's
    stable sort on 6 M codes, the same order.
    """
    order = np.argsort(group.astype(np.uint16) if n_groups <= 1 << 16 else group,
                       kind="stable")
    g, s = group[order], seq[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    present = g[starts]
    gmin = np.full(n_groups, np.iinfo(np.int64).max)
    gmax = np.full(n_groups, np.iinfo(np.int64).min)
    gmin[present] = np.minimum.reduceat(s, starts)
    gmax[present] = np.maximum.reduceat(s, starts)
    return gmin, gmax


def _instances(frame: StepFrame, ri: np.ndarray) -> Instances:
    rows = np.flatnonzero(frame.op_kind != COMPUTE)
    ids, n_inst = instance_ids(frame.op_group[rows], frame.op_seq[rows], len(frame.groups))
    dur = frame.op_dur_ns[rows] * _S_PER_NS
    n_copies = np.bincount(ids, minlength=n_inst)
    transfer = np.full(n_inst, np.inf)
    np.minimum.at(transfer, ids, dur)
    mean = np.bincount(ids, weights=dur, minlength=n_inst) / np.maximum(n_copies, 1)
    first = np.zeros(n_inst, dtype=np.int64)
    first[ids[::-1]] = rows[::-1]  # any copy's row; the last write wins = the first copy
    # cross-node: some copy sits on another node than the first copy (no min/max scatter)
    node = frame.node[ri[rows]]
    other = node != frame.node[ri[first]][ids]
    cross = np.bincount(ids, weights=other, minlength=n_inst) > 0
    nbytes = frame.op_bytes[first]  # the signature's size; all_to_all members may differ
    send_copy, recv_copy = _p2p_ends(frame, rows, ids, n_inst)
    return Instances(
        group=frame.op_group[first],
        seq=frame.op_seq[first],
        kind=frame.op_kind[first],
        name=frame.op_name[first],
        n_copies=n_copies,
        transfer_s=transfer,
        mean_s=mean,
        bytes=nbytes,
        cross_node=cross,
        copy_inst=ids,
        copy_rank=ri[rows],
        copy_wait_s=dur - transfer[ids],
        copy_late_s=mean[ids] - dur,
        send_copy=send_copy,
        recv_copy=recv_copy,
    )


def _p2p_ends(frame: StepFrame, rows: np.ndarray, ids: np.ndarray, n_inst: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """(I,) each p2p instance's send and recv copy's position among the copies `rows`
    (-1 where it has none): which way its data went, for a NIC slow one way
    (`network_suspects._add_egress`), and when, for a buffered send (`p2p.delivered`)."""
    out = [np.full(n_inst, -1, dtype=np.int64) for _ in range(2)]
    p2p = np.flatnonzero(frame.op_kind[rows] == P2P)
    for end, op in zip(out, ("send", "recv"), strict=True):
        if op in frame.names:
            at = p2p[frame.op_name[rows[p2p]] == frame.names.index(op)]
            end[ids[at]] = at
    return out[0], out[1]


def routed_compute(frame: StepFrame, ri: np.ndarray, dur_s: np.ndarray) -> np.ndarray:
    """(R,) compute time each rank spent between an expert-parallel dispatch and its combine.

    Under MoE routing each rank's expert kernels process the tokens routed to it this step,
    which varies by tens of percent from rank to rank and step to step: workload, not the
    device's speed. They are the compute ops that sit between a rank's first and second
    `ep.*` all-to-all of a pair (odd count so far on its rank). A step in which some rank
    has an odd number of them does not pair up and gets no such split (all zeros).

    >>> from detectors.testing import frame_of, rank_step
    >>> ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0),
    ...        ("coll", "all_to_all", "ep.0", 1, 10.0, 1.0, 8),
    ...        ("compute", "expert", "", 1, 11.0, 7.0, 0),
    ...        ("coll", "all_to_all", "ep.0", 2, 18.0, 1.0, 8)]
    >>> f = frame_of([rank_step(0, "n0", 0, ops)])
    >>> (routed_compute(f, f.op_rank_index(), f.op_dur_ns / 1e9) * 1e3).round(3).tolist()
    [7.0]
    """
    is_ep = np.zeros(len(frame.groups) + 1, dtype=bool)
    is_ep[: len(frame.groups)] = [g.startswith("ep.") for g in frame.groups]
    a2a = (frame.op_kind != COMPUTE) & is_ep[frame.op_group]
    if not a2a.any():
        return np.zeros(frame.n_ranks)
    before = np.cumsum(a2a) - a2a  # ep all-to-alls before each op, over the whole frame
    at_rank_start = np.r_[np.int64(0), np.cumsum(a2a)][frame.off[:-1]]
    inside = ((before - at_rank_start[ri]) % 2 == 1) & (frame.op_kind == COMPUTE)
    per_rank = np.diff(np.r_[np.int64(0), np.cumsum(a2a)][frame.off])
    if (per_rank % 2).any():
        return np.zeros(frame.n_ranks)
    return np.bincount(ri, weights=np.where(inside, dur_s, 0.0), minlength=frame.n_ranks)


def step_features(frame: StepFrame) -> StepFeatures:
    """Compute the time budget of every rank and the instance table of one step."""
    R = frame.n_ranks
    ri = frame.op_rank_index()
    dur = frame.op_dur_ns * _S_PER_NS
    is_compute = frame.op_kind == COMPUTE
    compute = rank_sums(frame, np.where(is_compute, dur, 0.0))
    comm = rank_sums(frame, np.where(is_compute, 0.0, dur))
    span = (frame.t_end_ns - frame.t_start_ns) * _S_PER_NS
    gap = np.maximum(span - _busy_ns(frame, ri) * _S_PER_NS, 0.0)
    inst = _instances(frame, ri)
    single = inst.n_copies[inst.copy_inst] < 2 if inst.copy_inst.size else np.zeros(0, bool)
    wait = np.where(single, 0.0, inst.copy_wait_s)
    late = np.where(single, 0.0, np.maximum(inst.copy_late_s, 0.0))
    # a p2p end's "wait" is real waiting too; both kinds count
    return StepFeatures(
        span_s=span,
        compute_s=compute,
        routed_s=routed_compute(frame, ri, dur),
        comm_s=comm,
        gap_s=gap,
        wait_s=np.bincount(inst.copy_rank, weights=wait, minlength=R),
        caused_wait_s=np.bincount(inst.copy_rank, weights=late, minlength=R),
        n_ops=np.diff(frame.off),
        has_compute=bool(is_compute.any()),
        inst=inst,
    )
