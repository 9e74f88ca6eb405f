"""When a rank's heartbeat is published: the one policy of the node agent and the simulator.

Why heartbeats are thinned. Every Kafka message costs the worker tens of µs of consumer-
framework overhead, and one heartbeat per rank per second made ~90% of an 8,192-GPU job's
messages; step messages already prove a rank alive while it progresses, and heartbeats matter
only when an op sits in flight for long (hang detection). So a rank is still SAMPLED every
`interval_s`, but a sample is PUBLISHED only if
  (a) it is the rank's first sample (since it connected; in the simulator, of the job), or
  (b) its set of *long* in-flight ops -- in flight for >= `long_op_s` at the sample time,
      identified by (group, seq) -- differs from that set at its previous sample (an op that
      becomes long is reported within one interval, and so is its end), or
  (c) the keepalive is due.
A published heartbeat carries the rank's FULL in-flight list (wire v1 unchanged). Healthy
training costs ~1/keepalive_s heartbeats per rank plus a few per long op.

Why these numbers. `long_op_s` is 3 s: pipeline bubbles keep ops in flight for 1-3 s every
step, and at 1 s they added 70% to the keepalives (3.7 instead of 2.2 heartbeats per
rank-step of 10.5 s, TP8·PP8). `keepalive_s + long_op_s` must stay below the smallest hang
timeout (10 s): a waiting rank then never looks silent, and a short op seen in a stale
heartbeat never looks stuck.

Two forms of the same rule, because their inputs differ:
- `Cadence.sample` decides for one rank at one sample (the agent, on its own clock). The
  keepalive (c) is due `keepalive_s` after the rank's last published heartbeat, half an
  interval early so timer jitter does not push it one whole sample late.
- `GridCadence.select` decides for a whole step's samples of many ranks at once (the
  simulator, vectorized). Its keepalive is every K-th sample of the rank's grid, K =
  floor(keepalive_s / interval_s), offset by the rank so that keepalives of different ranks
  spread over the cycle instead of bunching into one second: at least as often as (c), and
  it vectorizes. Simulated recordings are made with it; changing it changes them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from schemas.clock import NS_PER_S
from schemas.wire import InflightOp

INTERVAL_S = 1.0  # sampling period of each rank
KEEPALIVE_S = 5.0  # a rank's heartbeat is published at least this often
LONG_OP_S = 3.0  # an op in flight this long is "long": its start and end are published
# The smallest hang timeout in use (the detectors' default `hang_timeout_s`); repeated here
# because producers do not depend on the detectors.
MIN_HANG_TIMEOUT_S = 10.0

LongOps = frozenset[tuple[str, int]]  # (group, seq) of the long ops in flight


@dataclass(slots=True)
class RankBeat:
    """What the policy remembers of one rank between its samples."""

    long_ops: LongOps | None = None  # at the previous sample; None: no sample yet
    published_ns: int = 0  # time of the last published heartbeat


@dataclass(frozen=True, slots=True)
class Cadence:
    """The agent's cadence, checked once so a bad flag fails at start with a sentence."""

    interval_s: float = INTERVAL_S
    keepalive_s: float = KEEPALIVE_S
    long_op_s: float = LONG_OP_S
    long_ns: int = field(init=False, repr=False, compare=False)
    keepalive_ns: int = field(init=False, repr=False, compare=False)  # due half an interval early

    def __post_init__(self) -> None:
        for name in ("interval_s", "keepalive_s", "long_op_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {self.interval_s!r}")
        if self.keepalive_s < self.interval_s:
            raise ValueError(
                f"keepalive_s ({self.keepalive_s:g}) must be >= interval_s ({self.interval_s:g}):"
                " heartbeats are only sampled every interval"
            )
        if self.keepalive_s + self.long_op_s >= MIN_HANG_TIMEOUT_S:
            raise ValueError(
                f"keepalive_s + long_op_s ({self.keepalive_s + self.long_op_s:g} s) must stay "
                f"below the {MIN_HANG_TIMEOUT_S:g} s hang timeout, or a rank waiting in a "
                "collective may look silent, and a short op in a stale heartbeat stuck"
            )
        object.__setattr__(self, "long_ns", int(self.long_op_s * NS_PER_S))
        keepalive_ns = int((self.keepalive_s - self.interval_s / 2) * NS_PER_S)
        object.__setattr__(self, "keepalive_ns", keepalive_ns)

    def sample(self, beat: RankBeat, inflight: Iterable[InflightOp], now_ns: int) -> bool:
        """Whether the rank's sample at `now_ns` is published (rules a-c); updates `beat`."""
        long_ops = frozenset(
            (op.group, op.seq) for op in inflight if now_ns - op.start_ns >= self.long_ns
        )
        due = (
            beat.long_ops is None
            or long_ops != beat.long_ops
            or now_ns - beat.published_ns >= self.keepalive_ns
        )
        beat.long_ops = long_ops
        if due:
            beat.published_ns = now_ns
        return due


@dataclass
class GridCadence:
    """The policy over many ranks' sample grids at once, with the state carried across steps.

    Sampling stays on each rank's grid phase_r + n·period. A simulated rank has at most one
    op in flight, so its long-op key is (group, seq) of that op when it has been in flight
    >= `long_ns` at the sample time, else none (-1, -1).
    """

    every: int  # keepalive, in samples (1: every sample is published)
    long_ns: float  # an op in flight this long at a sample is long
    group: np.ndarray  # (W,) int64 long-op group at the rank's previous sample; -1 none
    seq: np.ndarray  # (W,) int64 its seq (-1 none); -2 in both: no sample yet

    @classmethod
    def fresh(cls, world: int, period: float, keepalive: float, long_op: float) -> GridCadence:
        """State before the first step (times in the same unit as `period`)."""
        every = max(1, int(keepalive / period + 1e-9))
        none = np.full(world, -2, dtype=np.int64)
        return cls(every=every, long_ns=float(long_op), group=none, seq=none.copy())

    def select(
        self, rank: np.ndarray, n: np.ndarray, cnt: np.ndarray, long_g: np.ndarray,
        long_s: np.ndarray,
    ) -> np.ndarray:
        """Mask of the published samples among one stage's samples of one step; updates state.

        Samples are grouped by rank (runs of `cnt[i]` samples, in time order, for the stage's
        i-th rank), `n` is each sample's index on its rank's grid, `long_g`/`long_s` its long
        key (-1: none).
        """
        has = cnt > 0
        ends = np.cumsum(cnt)[has]
        starts = ends - cnt[has]
        owners = rank[starts]
        prev_g = np.empty_like(long_g)
        prev_s = np.empty_like(long_s)
        prev_g[1:] = long_g[:-1]
        prev_s[1:] = long_s[:-1]
        prev_g[starts] = self.group[owners]
        prev_s[starts] = self.seq[owners]
        self.group[owners] = long_g[ends - 1]
        self.seq[owners] = long_s[ends - 1]
        changed = (long_g != prev_g) | (long_s != prev_s)
        return changed | (np.mod(n + rank, self.every) == 0)
