"""Per-step features: where each rank's time went, and what each collective instance shows.

Durations, not absolute timestamps, carry the signal (DESIGN §1): clocks of different nodes
disagree, but within one rank the offsets are exact. For a collective instance the copies end
together when the last member arrives plus the transfer time, so the SHORTEST copy is the
last arriver's and approximates the transfer; every other member's excess over it is waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flare.detectors.frame import StepFrame
from flare.detectors.segments import segment_starts
from flare.schemas.rankstep import COMPUTE, P2P

_NS = 1e-9
_SEQ_BITS = 40


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
    bytes: np.ndarray  # largest per-member buffer
    cross_node: np.ndarray  # bool: members on more than one node
    # copy-level view (C copies, sorted by instance)
    copy_inst: np.ndarray  # (C,) instance index
    copy_rank: np.ndarray  # (C,) rank index
    copy_wait_s: np.ndarray  # (C,) own duration - transfer: time spent waiting for peers
    copy_late_s: np.ndarray  # (C,) mean duration - own duration: arrived later than average


@dataclass(slots=True)
class StepFeatures:
    """Per-rank time budget (arrays (R,), seconds) and the step's instances."""

    span_s: np.ndarray
    compute_s: np.ndarray
    comm_s: np.ndarray
    gap_s: np.ndarray
    wait_s: np.ndarray
    caused_wait_s: np.ndarray
    n_ops: np.ndarray
    has_compute: bool
    inst: Instances


def _busy_ns(frame: StepFrame, ri: np.ndarray) -> np.ndarray:
    """Time covered by at least one op per rank (ops may overlap: async p2p, streams)."""
    n = frame.n_ops
    if n == 0:
        return np.zeros(frame.n_ranks)
    start = frame.op_start_ns
    end = start + frame.op_dur_ns
    base = ri << 42  # offsets < 2^42 ns (~73 min); ranks < 2^21
    prev_end = np.maximum.accumulate(base + end) - base
    prev_end = np.r_[np.int64(0), prev_end[:-1]]
    first = np.r_[True, ri[1:] != ri[:-1]]
    prev_end[first] = 0
    covered = np.maximum(end - np.maximum(start, prev_end), 0)
    return np.bincount(ri, weights=covered, minlength=frame.n_ranks)


def _instances(frame: StepFrame, ri: np.ndarray) -> Instances:
    rows = np.flatnonzero(frame.op_kind != COMPUTE)
    key = (frame.op_group[rows].astype(np.int64) << _SEQ_BITS) | (
        frame.op_seq[rows] & ((1 << _SEQ_BITS) - 1)
    )
    order = np.argsort(key, kind="stable")
    rows = rows[order]
    key = key[order]
    starts = segment_starts(key)
    n_inst = starts.size
    copy_inst = np.repeat(np.arange(n_inst), np.diff(np.r_[starts, key.size]))
    dur = frame.op_dur_ns[rows] * _NS
    if n_inst:
        transfer = np.minimum.reduceat(dur, starts)
        mean = np.add.reduceat(dur, starts) / np.diff(np.r_[starts, key.size])
        nbytes = np.maximum.reduceat(frame.op_bytes[rows], starts)
        node = frame.node[ri[rows]]
        cross = np.minimum.reduceat(node, starts) != np.maximum.reduceat(node, starts)
    else:
        transfer = mean = np.zeros(0)
        nbytes = np.zeros(0, dtype=np.int64)
        cross = np.zeros(0, dtype=bool)
    n_copies = np.diff(np.r_[starts, key.size])
    return Instances(
        group=frame.op_group[rows[starts]] if n_inst else np.zeros(0, np.int32),
        seq=frame.op_seq[rows[starts]] if n_inst else np.zeros(0, np.int64),
        kind=frame.op_kind[rows[starts]] if n_inst else np.zeros(0, np.uint8),
        name=frame.op_name[rows[starts]] if n_inst else np.zeros(0, np.int32),
        n_copies=n_copies,
        transfer_s=transfer,
        mean_s=mean,
        bytes=nbytes,
        cross_node=cross,
        copy_inst=copy_inst,
        copy_rank=ri[rows],
        copy_wait_s=dur - transfer[copy_inst] if n_inst else np.zeros(0),
        copy_late_s=mean[copy_inst] - dur if n_inst else np.zeros(0),
    )


def step_features(frame: StepFrame) -> StepFeatures:
    """Compute the time budget of every rank and the instance table of one step."""
    R = frame.n_ranks
    ri = frame.op_rank_index()
    dur = frame.op_dur_ns * _NS
    is_compute = frame.op_kind == COMPUTE
    compute = np.bincount(ri, weights=np.where(is_compute, dur, 0.0), minlength=R)
    comm = np.bincount(ri, weights=np.where(is_compute, 0.0, dur), minlength=R)
    span = (frame.t_end_ns - frame.t_start_ns) * _NS
    gap = np.maximum(span - _busy_ns(frame, ri) * _NS, 0.0)
    inst = _instances(frame, ri)
    single = inst.n_copies[inst.copy_inst] < 2 if inst.copy_inst.size else np.zeros(0, bool)
    wait = np.where(single, 0.0, inst.copy_wait_s)
    late = np.where(single, 0.0, np.maximum(inst.copy_late_s, 0.0))
    # a p2p end's "wait" is real waiting too; both kinds count
    return StepFeatures(
        span_s=span,
        compute_s=compute,
        comm_s=comm,
        gap_s=gap,
        wait_s=np.bincount(inst.copy_rank, weights=wait, minlength=R),
        caused_wait_s=np.bincount(inst.copy_rank, weights=late, minlength=R),
        n_ops=np.diff(frame.off),
        has_compute=bool(is_compute.any()),
        inst=inst,
    )


def is_p2p(inst: Instances) -> np.ndarray:
    return inst.kind == P2P
