"""Wire contract v1 of Flare (DESIGN §3): message models, the decoder and the error type.

Everything that crosses a process boundary is defined here, so producers, the stream worker
and the API agree on one set of types.
"""

from schemas.errors import InvalidMessage
from schemas.rankstep import COLL, COMPUTE, OP_KINDS, P2P, RankStep

__all__ = ["COLL", "COMPUTE", "OP_KINDS", "P2P", "InvalidMessage", "RankStep"]
