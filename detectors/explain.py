"""One sentence per incident, with the numbers an on-call SRE acts on.

The sentence names the culprit as an SRE finds it (node, parallel coordinates), says how it
differs from its peers, and what it costs the job per step: the what-if loss (`whatif`), not
the culprit's own excess, which slack in the schedule may absorb. A slow rank also names the
collective its peers wait for it in, which is where a profiler would show the time.

>>> from detectors.features import step_features
>>> from detectors.testing import frame_of, rank_step
>>> frame = frame_of([rank_step(r, f"n{r // 2}", 0, [], coords={"tp": r % 2, "pp": 0})
...                   for r in range(4)])
>>> rank_label(frame, 3)
'rank 3 (n1, tp 1 pp 0)'
>>> print(summarize("switch", "switch:s1", "transfers ×1.8 on 12", 0.4, 1.25,
...                 frame, step_features(frame), np.ones(4)))
switch s1 is congested: transfers ×1.8 on 12 of its nodes: the job loses 0.40 s per step (×1.25)
"""

from __future__ import annotations

import numpy as np

from detectors.features import StepFeatures
from detectors.stalls import describe_stalls
from schemas.frame import StepFrame


def waiting_group(frame: StepFrame, feats: StepFeatures, rank: int) -> tuple[str, str, int, float]:
    """Where peers waited most for `rank` this step: (group, op name, waiting ranks, seconds)."""
    idx = np.searchsorted(frame.rank, rank)
    if idx >= frame.n_ranks or frame.rank[idx] != rank:
        return "", "", 0, 0.0
    inst = feats.inst
    own = inst.copy_rank == idx
    if not own.any():
        return "", "", 0, 0.0
    mine = np.zeros(inst.transfer_s.size, dtype=bool)
    mine[inst.copy_inst[own]] = True
    others = mine[inst.copy_inst] & ~own
    if not others.any():
        return "", "", 0, 0.0
    g_of_copy = inst.group[inst.copy_inst[others]]
    waits = inst.copy_wait_s[others]
    sums = np.bincount(g_of_copy, weights=waits)
    g = int(np.argmax(sums))
    in_g = g_of_copy == g
    n_wait = int(np.unique(inst.copy_rank[others][in_g]).size)
    name_codes = inst.name[inst.copy_inst[others][in_g]]
    name = frame.names[int(np.bincount(name_codes).argmax())]
    per_rank = float(sums[g]) / max(n_wait, 1)
    return frame.groups[g], name, n_wait, per_rank


def rank_label(frame: StepFrame, rank: int) -> str:
    """`rank <n> (<node>, <coords>)`: where to find the rank."""
    idx = int(np.searchsorted(frame.rank, rank))
    if idx >= frame.n_ranks or frame.rank[idx] != rank:
        return f"rank {rank}"
    parts = [frame.nodes[frame.node[idx]]]
    coords = [
        f"{d} {frame.coord(d)[idx]}" for d in ("tp", "pp", "dp", "ep") if frame.coord(d)[idx] >= 0
    ]
    if coords:
        parts.append(" ".join(coords))
    return f"rank {rank} ({', '.join(parts)})"


# Without compute ops the idle gaps between collectives stand for the compute (a slow GPU and
# a starved host both lengthen them), so the kind of a device fault is a best guess.
COMM_ONLY_NOTE = (
    " (communication-only logs: a slow GPU and a starved host look alike; the kind is a guess)"
)


def summarize(
    kind: str,
    entity: str,
    detail: str,
    lost_s: float,
    slowdown: float,
    frame: StepFrame,
    feats: StepFeatures,
    ratio: np.ndarray,
    intermittent: bool = False,
) -> str:
    """The incident's summary line at the step that opened it; `lost_s` and `slowdown`: what
    the culprit costs the job per step, or (`intermittent`: a flapping fault, which costs
    nothing between its bursts) each step it hits."""
    cost = (f"each step it hits loses {lost_s:.2f} s (×{max(slowdown, 1.0):.2f})" if intermittent
            else f"the job loses {lost_s:.2f} s per step (×{max(slowdown, 1.0):.2f})")
    text = f"{_describe(kind, entity, detail, frame, feats, ratio)}: {cost}"
    if not feats.has_compute and kind in ("gpu", "node", "host"):
        text += COMM_ONLY_NOTE
    return text


def _host(entity: str, name: str, detail: str, frame: StepFrame, feats: StepFeatures) -> str:
    """A starved host, or one rank's own stall: what the time went to, by name when the
    hook named it (GC, data loading, checkpoints, marked phases)."""
    step_s = float(np.median(frame.t_end_ns - frame.t_start_ns)) / 1e9 if frame.n_ranks else 0.0
    if entity.startswith("rank:") and name.isdigit():
        rank = int(name)
        named = describe_stalls(frame, frame.rank == rank, step_s)
        text = (f"{rank_label(frame, rank)} stalls on its host: {detail} while its GPU "
                f"compute is normal")
        text += f"; in {named}" if named else " (a GC pause, data loading or a sleep?)"
        group, op, n_wait, wait_s = waiting_group(frame, feats, rank)
        if n_wait:
            waiters = "1 rank waits" if n_wait == 1 else f"{n_wait} ranks wait"
            text += f"; {waiters} on it in {group} {op} ({wait_s:.2f} s per step)"
        return text
    on_node = np.array(frame.nodes, dtype=object)[frame.node] == name
    named = describe_stalls(frame, on_node, step_s)
    return (f"host of node {name}: {detail} between ops while GPU compute is normal"
            + (f"; its ranks stall in {named}" if named
               else " (CPU contention or launch stalls)"))


def _describe(
    kind: str,
    entity: str,
    detail: str,
    frame: StepFrame,
    feats: StepFeatures,
    ratio: np.ndarray,
) -> str:
    _, _, name = entity.partition(":")
    if kind == "gpu" and entity.startswith("node:"):
        return f"a GPU of node {name} that is not traced: {detail}"
    if kind == "gpu":
        rank = int(name)
        idx = int(np.searchsorted(frame.rank, rank))
        slower = (ratio[idx] - 1) * 100 if idx < frame.n_ranks and np.isfinite(ratio[idx]) else 0.0
        group, op, n_wait, wait_s = waiting_group(frame, feats, rank)
        text = f"{rank_label(frame, rank)} computes {slower:.0f}% slower than its stage peers"
        if n_wait:
            waiters = "1 rank waits" if n_wait == 1 else f"{n_wait} ranks wait"
            text += f"; {waiters} on it in {group} {op} ({wait_s:.2f} s per step)"
        return text
    if kind == "node":
        return f"node {name}: its GPUs compute slower ({detail})"
    if kind == "host":
        return _host(entity, name, detail, frame, feats)
    if kind == "switch":
        return f"switch {name} is congested: {detail} of its nodes"
    if entity.startswith("link:") and len(frame.nodes) == 2:
        a, _, b = name.partition("~")
        return (f"the network between nodes {a} and {b} is slow (a NIC of either, or the path "
                f"between: a job of two nodes cannot tell which): {detail}")
    if entity.startswith("link:"):
        return f"link {name} between pipeline stages is slow: p2p {detail}"
    if kind == "link":
        return f"network of node {name} (NIC) is slow: {detail} through it"
    return f"{entity}: {detail}"
