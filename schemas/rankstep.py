"""The decoded form of one `flare.steps.v1` message: one rank's step with columnar numpy ops.

Detectors work on whole steps (ranks × ops), so ops stay columnar from the wire onward; the
per-op strings (name, group) stay Python lists because they are interned once per step by the
assembler rather than per message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from schemas.steps_message import steps_message

COMPUTE = 0
COLL = 1
P2P = 2
OP_KINDS: tuple[str, ...] = ("compute", "coll", "p2p")
KIND_CODE: dict[str, int] = {k: i for i, k in enumerate(OP_KINDS)}
COORD_DIMS: tuple[str, ...] = ("tp", "pp", "dp", "ep", "cp")
# A named host stall is sent as a compute op (group "") named `host:<what>`: `host:gc`,
# `host:data` (waiting on the DataLoader), `host:checkpoint`, or `host:<a user's phase>`.
# Within wire v1 (a name convention, no new field or kind): older consumers see one more
# compute phase. Flare's step assembly takes these out of the compute ops: the thread
# waited, it did not compute, so they count as the idle time they are, by name.
HOST_STALL_PREFIX = "host:"
GROUP_KINDS: frozenset[str] = frozenset({"tp", "dp", "pp", "ep", "cp", "world", "pg"})


@dataclass(slots=True)
class RankStep:
    """One rank's training step. Arrays all have the same length (the number of ops)."""

    job: str
    rank: int
    node: str
    step: int
    t_start_ns: int
    t_end_ns: int
    kind: np.ndarray  # uint8 codes, see OP_KINDS
    name: Sequence[str]  # a tuple shared by a rank's messages (worker), or a list; never mutated
    group: Sequence[str]
    seq: np.ndarray  # int64
    start_ns: np.ndarray  # int64 offsets from t_start_ns
    dur_ns: np.ndarray  # int64
    bytes: np.ndarray  # int64
    local_rank: int = 0
    coords: Mapping[str, int] = field(default_factory=dict)

    @property
    def n_ops(self) -> int:
        return int(self.kind.shape[0])

    def to_wire(self) -> dict:
        """The v1 JSON object of this step (what producers publish), from the one builder."""
        return steps_message(
            job=self.job, rank=self.rank, node=self.node, step=self.step,
            t_start_ns=self.t_start_ns, t_end_ns=self.t_end_ns,
            kind=[OP_KINDS[k] for k in self.kind.tolist()], name=list(self.name),
            group=list(self.group), seq=self.seq.tolist(), start_ns=self.start_ns.tolist(),
            dur_ns=self.dur_ns.tolist(), bytes=self.bytes.tolist(),
            local_rank=self.local_rank, coords=dict(self.coords) if self.coords else None,
        )
