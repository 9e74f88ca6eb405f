"""Hang detection from heartbeats: an op in flight past the timeout, and who it waits for.

Mycroft's observation: a hang shows as ranks that sit inside a collective while some member
never arrives. The members NOT in flight on the stuck (group, seq) are the cause; if they in
turn sit in another stuck op, follow them (the waits-for graph) to the root. If every member
is in flight on the same instance, nobody is missing: the communication itself hangs.

Ranks 0 and 1 sit in an all-reduce of `tp.0` since second 1; rank 2, its third member, beats
but never joins:

>>> from schemas.wire import HeartbeatV1, InflightOp
>>> def beat(rank, t_s, busy):
...     ops = [InflightOp(group="tp.0", name="all_reduce", seq=4, start_ns=1 * NS_PER_S)]
...     return HeartbeatV1(v=1, job="j", rank=rank, node="n0", ts_ns=t_s * NS_PER_S, step=9,
...                        inflight=ops if busy else [])
>>> d = HangDetector(timeout_s=10.0)
>>> d.learn_members("tp.0", {0, 1, 2})
>>> for t in range(25):
...     for rank in (0, 1, 2):
...         d.observe(beat(rank, t, busy=rank != 2))
>>> d.check(5 * NS_PER_S) is None  # in flight for 4 s: not past the timeout
True
>>> f = d.check(25 * NS_PER_S)
>>> f.culprit, f.onset_step, f.suspects
('rank:2', 9, [('rank:2', 1.0)])
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from detectors.base import Stateful
from schemas.clock import NS_PER_S
from schemas.wire import HeartbeatV1


@dataclass(slots=True)
class HangFinding:
    """A hang: its culprit, the step it stopped in, and the sentence an SRE reads."""

    culprit: str  # rank:<n> or group:<g>
    onset_step: int
    suspects: list[tuple[str, float]]
    summary: str
    stuck_s: float


class HangDetector(Stateful):
    """Latest heartbeat per rank + group membership and finished steps learned from steps."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.last: dict[int, HeartbeatV1] = {}
        self.members: dict[str, set[int]] = {}
        self.done = np.full(0, -1, dtype=np.int64)  # per rank: newest step it finished
        self._last_check_ns = 0

    def steps_done(self, ranks: np.ndarray, step: int) -> None:
        """`ranks` finished `step`. A rank that stops idle is re-published only at its
        keepalive, so its newest heartbeat can name an earlier step than the one it is in;
        its finished steps say where it stopped as soon as they are read."""
        if ranks.size == 0:
            return
        top = int(ranks.max()) + 1
        if top > self.done.size:
            self.done = np.concatenate([self.done, np.full(top - self.done.size, -1, np.int64)])
        self.done[ranks] = np.maximum(self.done[ranks], step)  # a step's ranks are unique

    def _current_step(self, rank: int, fallback: int) -> int:
        hb = self.last.get(rank)
        after = int(self.done[rank]) + 1 if rank < self.done.size and self.done[rank] >= 0 else -1
        now = max(hb.step if hb else -1, after)
        return now if now >= 0 else fallback

    def observe(self, hb: HeartbeatV1) -> None:
        prev = self.last.get(hb.rank)
        if prev is None or hb.ts_ns >= prev.ts_ns:
            self.last[hb.rank] = hb
        for op in hb.inflight:
            self.members.setdefault(op.group, set()).add(hb.rank)

    def learn_members(self, group: str, ranks: set[int]) -> None:
        self.members.setdefault(group, set()).update(ranks)

    def check(self, now_ns: int, timeout_s: float | None = None) -> HangFinding | None:
        """Look for a hang at stream time `now_ns` (at most once per stream second)."""
        if now_ns - self._last_check_ns < NS_PER_S:
            return None
        self._last_check_ns = now_ns
        limit = (timeout_s or self.timeout_s) * NS_PER_S
        stuck: dict[tuple[str, int], set[int]] = {}
        info: dict[tuple[str, int], tuple[str, int, int]] = {}  # name, oldest start, step
        # a rank inside any op (and still beating) is waiting, not the root; a silent rank
        # (no heartbeat for a timeout) may have died inside its op: it can be the root
        busy = {r for r, hb in self.last.items() if hb.inflight and now_ns - hb.ts_ns <= limit}
        for rank, hb in self.last.items():
            if rank not in busy:
                continue
            for op in hb.inflight:
                if now_ns - op.start_ns > limit:
                    key = (op.group, op.seq)
                    stuck.setdefault(key, set()).add(rank)
                    name, start, step = info.get(key, (op.name, op.start_ns, hb.step))
                    info[key] = (op.name, min(start, op.start_ns), min(step, hb.step))
        if not stuck:
            return None
        waits_on: Counter[int] = Counter()
        for key, inside in stuck.items():
            missing = self.members.get(key[0], set()) - inside
            for m in missing:
                waits_on[m] += len(inside)
        roots = Counter({r: n for r, n in waits_on.items() if r not in busy})
        oldest = min(stuck, key=lambda k: info[k][1])
        name, start, step = info[oldest]
        stuck_s = (now_ns - start) / NS_PER_S
        if roots:
            ranked = sorted(roots.items(), key=lambda kv: (-kv[1], kv[0]))
            culprit_rank, waiting = ranked[0]
            total = sum(roots.values())
            last_hb = self.last.get(culprit_rank)
            where = f" ({last_hb.node})" if last_hb else ""
            c_step = self._current_step(culprit_rank, step)
            silent = last_hb is None or now_ns - last_hb.ts_ns > limit
            state = "silent" if silent else "alive, no op in flight"
            groups = sorted({k[0] for k in stuck if culprit_rank in self.members.get(k[0], set())})
            direct = waits_on[culprit_rank]
            return HangFinding(
                culprit=f"rank:{culprit_rank}",
                onset_step=c_step,
                suspects=[(f"rank:{r}", n / total) for r, n in ranked[:3]],
                summary=(
                    f"rank {culprit_rank}{where} stopped in step {c_step} ({state}); "
                    f"{len(busy)} ranks are blocked, {direct} of them directly on it in "
                    f"{', '.join(groups[:3]) or oldest[0]}, for {stuck_s:.0f} s"
                ),
                stuck_s=stuck_s,
            )
        full = [k for k in stuck if not (self.members.get(k[0], set()) - stuck[k])]
        key = min(full or [oldest], key=lambda k: info[k][1])
        name, start, step = info[key]
        if not full and now_ns - start < 2 * limit:
            # Nobody is missing and idle, and no group has every member inside: the op that
            # truly hangs has not crossed the timeout yet (a pipeline recv that started just
            # before a collective hung crosses it first, waiting on a peer that is itself
            # stuck). Wait for the full group; blame a partial one only if none appears.
            return None
        return HangFinding(
            culprit=f"group:{key[0]}",
            onset_step=step,
            suspects=[(f"group:{key[0]}", 1.0)],
            summary=(
                f"communication hang: all {len(stuck[key])} members of {key[0]} are inside "
                f"{name} seq {key[1]} for {(now_ns - start) / NS_PER_S:.0f} s"
            ),
            stuck_s=(now_ns - start) / NS_PER_S,
        )
