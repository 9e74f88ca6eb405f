"""Each kind of transfer's usual: the step's reference for a kind that slowed as a whole.

`network_suspects` compares an instance's transfer with the instances of its signature (kind,
op, bytes, copies) in the same step, so that whatever slows every one of them cancels. A
job-wide slowdown does that, and no entity is to blame for it; but so does a fault on an
entity that every instance the step shows of one kind goes through:
- every pipeline pair of a two-stage job crosses both leaf switches when each leaf holds a
  stage, so a congested leaf slows all of them alike; with half the ranks traced the
  data-parallel groups that could tell the leaf apart run other sizes (other signatures);
- with one node's agent down, the pipeline pairs the step shows of a stage may all run
  between the same two nodes.

A ×3 switch made all 28 traced pipeline transfers of a 64-GPU job ×3 their usual and ×1.0
each other's; as fully traced instances on time they cleared every node and switch, and the
fault read as a job-wide shift with no device to blame.

So each signature's same-step reference (`network_suspects.reference_and_peers`) has a past:
the median of its last `depth` references, its log-space MAD and its slowest. A step whose
reference for a signature is slow against that past (`network_suspects.slow_against_past`,
as one instance is judged against its own) drops it: the signature's instances are judged
by their past alone, their own where they have one (`transfer_history`), else the
signature's. A job-wide slowdown still names nobody: an entity must be slower than the
transfers that do not touch it (`network_suspects`), and there are none.

The past stays healthy as `transfer_history`'s does: a step is remembered `delay` steps late,
the steps still waiting are dropped while a network incident is open (`drop_recent`), and a
reference twice the past's slowest is never remembered.

Two pipeline pairs and two all-reduces across four nodes; from the seventh step every
pipeline transfer takes 30 ms instead of 10:

>>> import numpy as np
>>> from detectors.features import step_features
>>> from detectors.network_suspects import reference_and_peers
>>> from detectors.testing import frame_of, rank_step
>>> def frame(pp_ms):
...     ops = {r: [] for r in range(4)}
...     for i, (g, a, b) in enumerate([("pp.0", 0, 2), ("pp.1", 1, 3)]):
...         ops[a] += [("p2p", "send", g, s, 100.0 * s + i, pp_ms, 1 << 16) for s in range(3)]
...         ops[b] += [("p2p", "recv", g, s, 100.0 * s + i, pp_ms, 1 << 16) for s in range(3)]
...     for g, a, b in [("dp.0", 0, 1), ("dp.1", 2, 3)]:
...         for r in (a, b):
...             ops[r] += [("coll", "all_reduce", g, s, 400.0 + 20 * s, 10.0, 1 << 20)
...                        for s in range(3)]
...     return frame_of([rank_step(r, f"n{r}", 0, ops[r]) for r in range(4)])
>>> past = SignatureHistory(delay=0)
>>> for _ in range(6):
...     inst = step_features(f := frame(10.0)).inst
...     _ = past.observe(f, inst, reference_and_peers(inst)[0])
>>> inst = step_features(f := frame(30.0)).inst
>>> ref = reference_and_peers(inst)[0]
>>> p2p = inst.kind == 2
>>> def ms(r):  # the pipeline transfers' reference and the all-reduces' (NaN: none)
...     return [np.unique((r[m] * 1e3).round(1)).tolist() for m in (p2p, ~p2p)]
>>> ms(ref)  # every pipeline transfer slow: the step's own reference for them is 30 ms
[[30.0], [10.0]]
>>> check = past.observe(f, inst, ref, learn=False)
>>> ms(check.ref), ms(check.past.ref)  # judged by their usual, 10 ms, instead
([[nan], [10.0]], [[10.0], [nan]])
>>> bool(check.usual[p2p].any()), bool(check.usual[~p2p].all())  # the all-reduces ran their usual
(False, True)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from detectors.base import Stateful
from detectors.evidence import WINDOW
from detectors.features import Instances
from detectors.network_suspects import (
    OwnPast,
    new_against_past,
    signatures,
    slow_against_past,
    summarize_past,
)
from detectors.transfer_history import MIN_PAST
from schemas.frame import StepFrame

SignatureKey = tuple[int, str, int, int]  # kind, op, bytes, copies


@dataclass(slots=True)
class SignatureCheck:
    """One step's same-step references against their signatures' past, arrays (I,)."""

    ref: np.ndarray  # the step's reference, NaN where its signature's shifted as a whole
    past: OwnPast  # that signature's past for those instances (NaN for the rest)
    usual: np.ndarray  # bool: its signature's reference this step is its past's usual


class SignatureHistory(Stateful):
    """The last `depth` same-step references of every signature (module docstring)."""

    def __init__(self, depth: int = 30, delay: int = WINDOW) -> None:
        self.depth = depth
        self.delay = delay
        self._recent: deque[tuple[list[SignatureKey], np.ndarray]] = deque()
        self._past: dict[SignatureKey, deque[float]] = {}

    def observe(self, frame: StepFrame, inst: Instances, ref: np.ndarray,
                learn: bool = True) -> SignatureCheck:
        """The step's references checked against their signatures' past (`SignatureCheck`);
        when `learn`, they are remembered once `delay` more steps have come (but those
        twice the past's slowest)."""
        n = inst.transfer_s.size
        past = OwnPast(*(np.full(n, np.nan) for _ in range(3)))
        usual_here = np.zeros(n, dtype=bool)
        idx = np.flatnonzero(np.isfinite(ref) & (ref > 0))
        if idx.size == 0:
            return SignatureCheck(ref, past, usual_here)
        sig, n_sig = signatures(inst, idx)
        first = np.zeros(n_sig, dtype=np.int64)
        first[sig[::-1]] = np.arange(idx.size)[::-1]  # the last write wins: the first
        at = idx[first]  # an instance of each signature
        keys = [(k, frame.names[n], b, c) for k, n, b, c in zip(
            inst.kind[at].tolist(), inst.name[at].tolist(), inst.bytes[at].tolist(),
            inst.n_copies[at].tolist(), strict=True)]
        now = ref[at]
        usual, sigma, top = (np.full(n_sig, np.nan) for _ in range(3))
        known = [j for j, key in enumerate(keys) if len(self._past.get(key, ())) >= MIN_PAST]
        if known:
            ring = np.full((len(known), self.depth), np.nan)
            for row, j in enumerate(known):
                kept = self._past[keys[j]]
                ring[row, :len(kept)] = kept
            usual[known], sigma[known], top[known] = summarize_past(ring)
        shifted = slow_against_past(now, usual, sigma, top)
        usual_here[idx] = (np.isfinite(usual) & ~shifted)[sig]
        out = ref
        if shifted.any():
            out = ref.copy()
            moved = shifted[sig]
            ids, of = idx[moved], sig[moved]
            out[ids] = np.nan
            past.ref[ids], past.sigma[ids], past.top[ids] = usual[of], sigma[of], top[of]
        if learn:
            keep = np.flatnonzero(~new_against_past(now, top))
            self._recent.append(([keys[j] for j in keep.tolist()], now[keep]))
            while len(self._recent) > self.delay:
                old_keys, values = self._recent.popleft()
                for key, v in zip(old_keys, values.tolist(), strict=True):
                    self._past.setdefault(key, deque(maxlen=self.depth)).append(v)
        return SignatureCheck(out, past, usual_here)

    def drop_recent(self) -> None:
        """Forget the steps not yet remembered (a network incident is open: they may be its
        fault's)."""
        self._recent.clear()
