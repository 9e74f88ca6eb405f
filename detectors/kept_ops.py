"""Which ranks' raw ops a kept step stores: all of them up to a bound, past it the ranks the
step names and an even spread of the rest.

WHY: the worker keeps the raw ops of irregular steps and of every 100th step, for
`flare trace` and the incident page. A 16,384-GPU step is 13.6 M ops: writing one stalled
the worker for 40 s and took 6 GB more memory (BENCHMARKS.md, "Steps as binary columns"),
a lag a real-time worker cannot afford every 100 steps, for a trace no viewer opens (16,384
tracks of 830 ops). What an on-call looks at in a trace is the ranks the step names and
their node peers (the tensor-parallel group), against a sample of healthy ranks. So past
`max_ops` a kept step stores whole ranks: first every rank of a node that a candidate names
(as a node, or through one of its ranks), then ranks evenly spaced over the others, until
the bound. Codes keep their tables, so the kept frame reads like the whole one.

>>> import numpy as np
>>> from detectors.testing import rank_step
>>> from detectors.assembly import StepAssembler
>>> asm = StepAssembler("j")
>>> ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0),
...        ("coll", "all_reduce", "dp.0", 1, 12.0, 5.0, 64)]
>>> for r in range(8):
...     _ = asm.add(rank_step(r, f"n{r // 2}", 0, ops, t0_ns=10**18), 10**18)
>>> [f] = asm.flush()
>>> kept_frame(f, ["rank:5"], max_ops=16) is f   # under the bound: the whole step
True
>>> small = kept_frame(f, ["rank:5"], max_ops=8)
>>> small.rank.tolist(), small.off.tolist(), small.nodes == f.nodes
([0, 4, 5, 7], [0, 2, 4, 6, 8], True)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from schemas.frame import StepFrame


def kept_frame(frame: StepFrame, named: Sequence[str], max_ops: int) -> StepFrame:
    """`frame` itself when it holds at most `max_ops` ops; else its named ranks' nodes and
    an even spread of its other ranks, whole ranks up to `max_ops` ops (at least the named)."""
    if frame.n_ops <= max_ops:
        return frame
    per_rank = np.diff(frame.off)
    chosen = np.zeros(frame.n_ranks, dtype=bool)
    chosen[_named_nodes(frame, named)] = True
    budget = max_ops - int(per_rank[chosen].sum())
    rest = np.flatnonzero(~chosen)
    if budget > 0 and rest.size:
        mean = max(float(per_rank[rest].mean()), 1.0)
        k = min(rest.size, int(budget // mean))
        if k:
            pick = rest[np.unique(np.linspace(0, rest.size - 1, k).round().astype(np.int64))]
            fits = np.cumsum(per_rank[pick]) <= budget
            chosen[pick[fits]] = True
    return _ranks_of(frame, chosen)


def _named_nodes(frame: StepFrame, named: Sequence[str]) -> np.ndarray:
    """Rank indices on the nodes the entities name: a node itself, or a rank's node."""
    want = np.asarray([int(e[5:]) for e in named if e.startswith("rank:") and e[5:].isdigit()],
                      dtype=np.int64)
    nodes = {e[5:] for e in named if e.startswith("node:")}
    idx = np.searchsorted(frame.rank, want)
    inside = idx < frame.n_ranks
    idx, want = idx[inside], want[inside]
    idx = idx[frame.rank[idx] == want]
    node_codes = set(frame.node[idx].tolist())
    node_codes |= {i for i, n in enumerate(frame.nodes) if n in nodes}
    return np.flatnonzero(np.isin(frame.node, list(node_codes)))


def _ranks_of(frame: StepFrame, chosen: np.ndarray) -> StepFrame:
    """The frame of the ranks `chosen` (a mask over the rank rows): their rows, ops and
    stalls."""
    per_rank = np.diff(frame.off)
    keep = np.flatnonzero(chosen)
    op_rows = np.repeat(chosen, per_rank)
    new_index = np.full(frame.n_ranks, -1, dtype=np.int64)
    new_index[keep] = np.arange(keep.size)
    stall = new_index[frame.stall_rank] >= 0
    return StepFrame(
        job=frame.job, step=frame.step, rank=frame.rank[keep], node=frame.node[keep],
        nodes=frame.nodes, local_rank=frame.local_rank[keep], coords=frame.coords[keep],
        t_start_ns=frame.t_start_ns[keep], t_end_ns=frame.t_end_ns[keep],
        off=np.concatenate(([0], np.cumsum(per_rank[keep]))).astype(np.int64),
        op_kind=frame.op_kind[op_rows], op_name=frame.op_name[op_rows],
        op_group=frame.op_group[op_rows], op_seq=frame.op_seq[op_rows],
        op_start_ns=frame.op_start_ns[op_rows], op_dur_ns=frame.op_dur_ns[op_rows],
        op_bytes=frame.op_bytes[op_rows], names=frame.names, groups=frame.groups,
        missing=frame.missing, stall_rank=new_index[frame.stall_rank[stall]],
        stall_name=frame.stall_name[stall], stall_ns=frame.stall_ns[stall],
    )
