"""StepFrame: one job step of all reporting ranks as flat columnar arrays (ranks × ops).

This is the unit every detector works on. The assembler builds it from decoded `RankStep`
messages; the simulator can build it directly (the same shape, much faster for `flare eval`).
Strings are interned per frame: `op_name` and `op_group` index `names` and `groups`, `node`
indexes `nodes`, so all comparisons are integer array operations.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from schemas.rankstep import COORD_DIMS


@dataclass(slots=True)
class StepFrame:
    """All ops of one step. Ranks are sorted; ops of rank i are rows off[i]:off[i+1]."""

    job: str
    step: int
    rank: np.ndarray  # (R,) int64, sorted ascending
    node: np.ndarray  # (R,) int32 index into nodes
    nodes: list[str]
    local_rank: np.ndarray  # (R,) int32
    coords: np.ndarray  # (R, len(COORD_DIMS)) int32, -1 where unknown
    t_start_ns: np.ndarray  # (R,) int64
    t_end_ns: np.ndarray  # (R,) int64
    off: np.ndarray  # (R+1,) int64 row offsets of each rank's ops
    op_kind: np.ndarray  # (N,) uint8
    op_name: np.ndarray  # (N,) int32 index into names
    op_group: np.ndarray  # (N,) int32 index into groups (groups[0] == "" for compute)
    op_seq: np.ndarray  # (N,) int64
    op_start_ns: np.ndarray  # (N,) int64 offset from the rank's t_start_ns
    op_dur_ns: np.ndarray  # (N,) int64
    op_bytes: np.ndarray  # (N,) int64
    names: list[str]
    groups: list[str]
    missing: np.ndarray  # (M,) int64 ranks expected but absent (grace period expired)
    # Named host stalls (`host:<what>` ops, schemas.rankstep.HOST_STALL_PREFIX), kept apart
    # from the ops: the thread waited in them, so they are idle time with a name, not compute.
    # (S,) each: index into the rank arrays, index into `names`, duration.
    stall_rank: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    stall_name: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    stall_ns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def n_ranks(self) -> int:
        return int(self.rank.shape[0])

    @property
    def n_ops(self) -> int:
        return int(self.op_kind.shape[0])

    def op_rank_index(self) -> np.ndarray:
        """(N,) index into the rank arrays of every op."""
        return np.repeat(np.arange(self.n_ranks, dtype=np.int64), np.diff(self.off))

    def rank_index_of(self, rows: np.ndarray) -> np.ndarray:
        """Index into the rank arrays of the ops `rows`: a search per row, for a few rows of
        a step whose `op_rank_index` would be millions long."""
        return np.searchsorted(self.off, rows, side="right") - 1

    def coord(self, dim: str) -> np.ndarray:
        """(R,) coordinate of each rank in `dim` (tp, pp, dp, ep, cp), -1 where unknown."""
        return self.coords[:, COORD_DIMS.index(dim)]
