"""A p2p transfer as its receiver saw it: what a buffered send's short copy does not show.

An instance's transfer is its shortest copy, the last arriver's (`features`): when the send
blocks until its data is taken (NCCL's rendezvous, the simulator), the two copies end
together and the later poster's copy is the transfer. A buffered send returns as soon as its
data is queued (gloo; NCCL for small messages), and its copy lasts microseconds however long
the data then takes: a NIC held to 20 Mbit/s made a pipeline send's data arrive 264 ms after
it was posted, its copy 0 ms and its receiver's 1,508 ms. Replayed from the shortest copy,
that transfer took no time and the receiver waited on its sender (the what-if priced a drill's
NIC at half what it cost, `whatif`).

On one clock (`clocks`) a send is buffered when it returned well before its data was
received, and when its receiver was there first, from the send's post to the receive's end
is what the data took (`delivered`, which the what-if replays, `whatif.job_cost`). For a
blocking send that is the send's own copy: the same figure. When the receiver came after a
buffered send had returned, the data may have waited for it, and the shortest copy stays:
that transfer is hidden.

The step's comparisons of transfers (`network_suspects`) keep the shortest copy: what the
receiver saw includes its own wake-up, which on a busy host varies ×10 from step to step,
and judged by that spread a drill's flapping NIC was named in 7 drills of 10 instead of 10.

Rank 0 on node a sends 1 MB to rank 1 on node b, whose clock is 3 ms ahead; the send is
buffered (its copy 0.01 ms) and the receive, posted first, ends 40 ms after the send's post.
The two nodes' data-parallel all-reduce lines their clocks up:

>>> from detectors.features import step_features
>>> from detectors.testing import frame_of, rank_step
>>> frame = frame_of([
...     rank_step(0, "a", 0, [("p2p", "send", "pp.0", 1, 10.0, 0.01, 1 << 20),
...                           ("coll", "all_reduce", "dp.0", 1, 60.0, 5.0, 1024)]),
...     rank_step(1, "b", 0, [("p2p", "recv", "pp.0", 1, 3.0, 50.0, 1 << 20),
...                           ("coll", "all_reduce", "dp.0", 1, 66.0, 2.0, 1024)]),
... ])
>>> inst = step_features(frame).inst
>>> seen, clocks = delivered(frame, inst)
>>> p2p = inst.kind == 2
>>> (inst.transfer_s[p2p] * 1e3).round(2).tolist(), (seen[p2p] * 1e3).round(2).tolist()
([0.01], [40.0])
>>> (clocks.offset_ns / 1e6).round(3).tolist()  # node b's clock 3 ms ahead of a's
[-1.5, 1.5]
"""

from __future__ import annotations

import numpy as np

from detectors.clocks import NodeClocks, join_by_p2p, step_clocks
from detectors.features import Instances
from schemas.clock import NS_PER_S
from schemas.frame import StepFrame
from schemas.rankstep import COMPUTE

_S_PER_NS = 1 / NS_PER_S


def delivered(frame: StepFrame, inst: Instances, known_ns: np.ndarray | None = None
              ) -> tuple[np.ndarray, NodeClocks]:
    """(I,) each instance's transfer as its data's receiver saw it (module doc; the
    shortest copy where nothing more is known), and the step's node clocks on one scale
    (`clocks`), which the what-if replays on. Only a step the what-if prices needs them:
    on an 8,192-GPU step they take about a tenth of the detectors' time. `known_ns`: (nodes,)
    each node's clock offset as the job's healthy steps showed it (`whatif.UsualStep`),
    used instead of the step's own, which a NIC slow one way pulls off (`clocks`)."""
    rows = np.flatnonzero(frame.op_kind != COMPUTE)  # the copies, in `inst.copy_inst` order
    ids, transfer = inst.copy_inst, inst.transfer_s
    clocks = (step_clocks(frame, rows, ids, inst.group, inst.kind, inst.cross_node)
              if known_ns is None else NodeClocks(known_ns, np.zeros(known_ns.size, np.int64)))
    pair = np.flatnonzero((inst.send_copy >= 0) & (inst.recv_copy >= 0))
    if pair.size == 0:
        return transfer, clocks
    origin = (frame.t_start_ns - frame.t_start_ns.min()).astype(np.float64)
    # each side's node and (start, end) on its node's clock
    ends = []
    for copy in (inst.send_copy[pair], inst.recv_copy[pair]):
        row, rank = rows[copy], inst.copy_rank[copy]
        start = origin[rank] + frame.op_start_ns[row]
        ends.append((frame.node[rank], np.stack([start, start + frame.op_dur_ns[row]], axis=1)))
    (s_node, send), (r_node, recv) = ends
    if known_ns is None:
        clocks = join_by_p2p(clocks, s_node, r_node, send - clocks.offset_ns[s_node, None],
                             recv - clocks.offset_ns[r_node, None])
    ok = clocks.comparable(s_node, r_node)
    send = send[ok] - clocks.offset_ns[s_node[ok], None]
    recv = recv[ok] - clocks.offset_ns[r_node[ok], None]
    pair = pair[ok]
    seen = recv[:, 1] - np.maximum(send[:, 0], recv[:, 0])  # from the later post to the data
    # the send returned well before its data arrived, and the receiver was there first
    took = (send[:, 1] < recv[:, 1] - seen / 2) & (recv[:, 0] <= send[:, 0])
    out = transfer.copy()
    out[pair[took]] = np.maximum(out[pair[took]], seen[took] * _S_PER_NS)
    return out, clocks
