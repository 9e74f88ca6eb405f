"""Node clocks on one scale: the offsets that line up the ends of collectives across nodes.

Durations carry most of the signal because node clocks disagree (DESIGN §1). A few things are
only seen across clocks: a buffered send returns as soon as its data is queued, and the
transfer it started then shows only as part of the receiver's wait (gloo, and NCCL for small
messages). Every copy of a collective instance ends at the same moment (the last arrival plus
the transfer), so each node's offset is the one that best lines up its copies' ends with the
other nodes' (least squares on the graph of nodes that share instances: conjugate gradients
on its Laplacian, a few iterations).

Offsets within one connected part of that graph are known. Parts that exchange only p2p
transfers (the pipeline stages of a job whose data-parallel groups stay within a stage) are
joined by those (`join_by_p2p`): by the ends of sends that block until their data is taken,
which end with their receives, or, where sends are buffered, as NTP joins two hosts (the
quickest a→b transfer is a transfer plus the offset, the quickest b→a one a transfer less
it). `NodeClocks.comparable` says which pairs of nodes can be compared then.

Two nodes whose clocks differ by 5 ms, one all-reduce across them:

>>> import numpy as np
>>> ends = np.array([105e6, 100e6])  # the same instant on each node's clock (ns)
>>> clocks = solve_offsets(ends, np.array([0, 0]), np.array([0, 1]), 2)
>>> (clocks.offset_ns / 1e6).round(3).tolist()
[2.5, -2.5]
>>> bool(clocks.comparable(np.array([0]), np.array([1]))[0])
True
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.frame import StepFrame
from schemas.rankstep import COLL


@dataclass(slots=True)
class NodeClocks:
    """(nodes,) each node's clock offset (ns, mean zero per part) and the part of the graph of
    shared collectives it is in (-1: it shares none with another node)."""

    offset_ns: np.ndarray
    part: np.ndarray

    def comparable(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """(n,) bool: nodes `a` and `b` are one node, or their offsets are known relative to
        each other."""
        return (a == b) | ((self.part[a] >= 0) & (self.part[a] == self.part[b]))


def unaligned(n_nodes: int) -> NodeClocks:
    """Clocks with nothing to line them up: offsets 0, and no node comparable with another."""
    return NodeClocks(np.zeros(n_nodes), np.full(n_nodes, -1, dtype=np.int64))


def step_clocks(frame: StepFrame, rows: np.ndarray, ids: np.ndarray, group: np.ndarray,
                kind: np.ndarray, cross: np.ndarray) -> NodeClocks:
    """The step's node clocks from the first and last instance of each group whose
    collectives span nodes: their copies are about as many as the job's ranks, where every
    instance's are millions in a large job's step (`rows`: the communication ops, `ids`
    their instance; `group`, `kind` and `cross` per instance, numbered in (group, seq)
    order, `features.instance_ids`)."""
    n_inst = kind.size
    if n_inst == 0 or len(frame.nodes) < 2:
        return unaligned(len(frame.nodes))
    edge = np.zeros(n_inst, dtype=bool)
    edge[0] = edge[-1] = True
    change = np.flatnonzero(group[1:] != group[:-1])
    edge[change] = edge[change + 1] = True
    use = (edge & cross & (kind == COLL))[ids]
    if not use.any():
        return unaligned(len(frame.nodes))
    r = rows[use]
    rank = frame.rank_index_of(r)
    end = ((frame.t_start_ns - frame.t_start_ns.min()).astype(np.float64)[rank]
           + frame.op_start_ns[r] + frame.op_dur_ns[r])
    return solve_offsets(end, ids[use], frame.node[rank], len(frame.nodes))


def solve_offsets(end_ns: np.ndarray, copy_inst: np.ndarray, node: np.ndarray, n_nodes: int,
                  tol_ns: float = 100.0) -> NodeClocks:
    """Offsets from copies (`end_ns` on their node's clock, their instance, their node) of
    instances that each should end at one moment."""
    if end_ns.size == 0 or n_nodes < 2:
        return unaligned(n_nodes)
    _, inst = np.unique(copy_inst, return_inverse=True)
    inst = inst.reshape(-1)
    n_inst = int(inst.max()) + 1
    per_inst = np.maximum(np.bincount(inst, minlength=n_inst), 1)

    def centred(v: np.ndarray) -> np.ndarray:  # v less its instance's mean, summed by node
        mean = np.bincount(inst, weights=v, minlength=n_inst) / per_inst
        return np.bincount(node, weights=v - mean[inst], minlength=n_nodes)

    x = np.zeros(n_nodes)
    r = centred(end_ns.astype(np.float64))
    p = r.copy()
    rs = float(r @ r)
    for _ in range(2 * n_nodes):
        if rs < tol_ns * tol_ns:
            break
        ap = centred(p[node])
        curv = float(p @ ap)
        if curv <= 0:
            break
        x += rs / curv * p
        r -= rs / curv * ap
        rs, last = float(r @ r), rs
        p = r + rs / last * p
    part = _parts(inst, node, n_inst, n_nodes)
    for q in np.unique(part[part >= 0]):
        mine = part == q
        x[mine] -= x[mine].mean()
    return NodeClocks(x, part)


def _parts(inst: np.ndarray, node: np.ndarray, n_inst: int, n_nodes: int) -> np.ndarray:
    """(nodes,) the smallest node of each connected part of the node graph (instances join
    the nodes of their copies); -1 for a node on no instance with another node."""
    label = np.arange(n_nodes)
    for _ in range(n_nodes):
        low = np.full(n_inst, n_nodes)
        np.minimum.at(low, inst, label[node])
        new = label.copy()
        np.minimum.at(new, node, low[inst])
        if np.array_equal(new, label):
            break
        label = new
    on = np.zeros(n_nodes, dtype=bool)
    on[node] = True
    return np.where(on, label, -1)


def join_by_p2p(clocks: NodeClocks, src: np.ndarray, dst: np.ndarray, send_ns: np.ndarray,
                recv_ns: np.ndarray) -> NodeClocks:
    """`clocks` with the parts that p2p transfers run between both ways put on one scale.

    Each transfer (n,): its sending and receiving node, and its send's and its receive's
    (start, end) as (n, 2) arrays on `clocks`' scale. Between two parts, sends that block
    until their data is taken end with their receives, each way: the offset is what lines
    those ends up (the median each way; the two directions' differences then cancel).
    Buffered sends end before their data arrives, and the two directions' end differences
    add up to their transfers; then the quickest transfer each way, from the send's post to
    the receive's end, is a transfer plus the offset one way and less it the other, and half
    their difference is the offset when both ways are equally quick (NTP's estimate). Parts
    are joined along a tree of such pairs, from the part with the most nodes."""
    n_nodes = clocks.part.size
    part = np.where(clocks.part >= 0, clocks.part, n_nodes + np.arange(n_nodes))
    a, b = part[src], part[dst]
    across = a != b
    if not across.any():
        return clocks
    n_parts = 2 * n_nodes
    send, recv = send_ns[across], recv_ns[across]
    key = a[across] * n_parts + b[across]
    order = np.argsort(key, kind="stable")
    key = key[order]
    trip = (recv[:, 1] - send[:, 0])[order]  # from the send's post to the data received
    ends = (recv[:, 1] - send[:, 1])[order]  # received, less the send's return
    copy = np.minimum(recv[:, 1] - recv[:, 0], send[:, 1] - send[:, 0])[order]
    cut = np.flatnonzero(np.r_[True, key[1:] != key[:-1], True])
    per: dict[int, tuple[float, float, float]] = {}  # direction → quickest trip, ends, copy
    for lo, hi in zip(cut[:-1].tolist(), cut[1:].tolist(), strict=True):
        per[int(key[lo])] = (float(trip[lo:hi].min()), float(np.median(ends[lo:hi])),
                             float(np.median(copy[lo:hi])))
    # how far the clock of the second part of each pair runs ahead of the first's
    ahead: dict[int, list[tuple[int, float]]] = {}
    for k, (quick, end, copy_ns) in per.items():
        x, y = divmod(k, n_parts)
        back = per.get(y * n_parts + x)
        if back is None:
            continue
        blocking = abs(end + back[1]) < 0.5 * min(copy_ns, back[2])
        ahead.setdefault(x, []).append((y, (end - back[1]) / 2 if blocking
                                        else (quick - back[0]) / 2))
    if not ahead:
        return clocks
    parts, sizes = np.unique(part, return_counts=True)
    shift = {int(parts[np.argmax(sizes)]): 0.0}
    frontier = list(shift)
    while frontier:
        x = frontier.pop()
        for y, t in ahead.get(x, []):
            if y not in shift:
                shift[y] = shift[x] + t
                frontier.append(y)
    offset = clocks.offset_ns.copy()
    label = clocks.part.copy()
    root = min(shift)
    for q, t in shift.items():
        mine = part == q
        offset[mine] += t
        label[mine] = root
    return NodeClocks(offset, label)
