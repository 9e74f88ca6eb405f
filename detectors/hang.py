"""Hang detection from heartbeats: an op in flight past the timeout, and who it waits for.

Mycroft's observation: a hang shows as ranks that sit inside a collective while some member
never arrives. The members NOT in flight on the stuck (group, seq) are the cause; if they in
turn sit in another stuck op, follow them (the waits-for graph) to the root. If every member
is in flight on the same instance, nobody is missing: the communication itself hangs.

A long wait alone is not a hang (DESIGN §4.7): a pipeline warm-up `recv`, a rank waiting on a
slow-but-alive straggler and a long checkpoint all wait past any fixed timeout on long steps.
A hang is a wait on ranks that make **no progress**: every rank the stuck ops wait for has
shown the same state (step and ops in flight) and finished no step for the whole timeout. A
straggler keeps finishing steps and its group peers keep entering new collectives, so the
waits on it are not hangs; it is left to the compute detectors (one gpu incident, not a
series of hangs).

A rank inside a named host stall (`host:checkpoint`, `host:data`, …: the hook reports them in
flight) is working, not stopped: its peers wait at the next collective while it saves. It is
a hang only once the stall outlasts `STALL_ALLOWANCE` times the longest stall of that name
the job has shown (a checkpoint that took 40 s may take 80 s; one that takes ten minutes is
stuck), or `FIRST_STALL_TIMEOUTS` hang timeouts while none has finished yet.

An op that a peer has already finished is no wait on that peer. A rank frozen inside a
`recv` whose `send` its peer completed (or inside an all-reduce the others left) still shows
the op in its heartbeats, so it looks like one more waiter; read that way the hang is a
cycle with no root, and the pair is blamed as a group. The step messages of its peers say
the instance is over: the rank that still shows it is stopped, and it is the root.

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

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from detectors.base import Stateful
from detectors.stacks import PROC_STATE
from schemas.clock import NS_PER_S
from schemas.rankstep import HOST_STALL_PREFIX
from schemas.wire import HeartbeatV1, InflightOp

EXIT_GRACE = 0.2  # share of the hang timeout given to see who else vanished with a rank
STALL_ALLOWANCE = 2.0  # a named stall in flight is work up to this × its longest so far ...
FIRST_STALL_TIMEOUTS = 10.0  # ... or this many hang timeouts before one has finished
NO_OP = np.iinfo(np.int64).max  # `oldest_op` of a rank with nothing in flight
# a collective that failed because its peer went away (gloo, NCCL): the dying rank is a victim
_BY_PEER = re.compile(r"(reset|closed) by peer|remote process exited|peer .*(closed|exited)",
                      re.IGNORECASE)


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
        self.moved = np.full(0, -1, dtype=np.int64)  # per rank: stream ns of its last progress
        # per rank: the start of the oldest op its newest heartbeat shows in flight (NO_OP:
        # none), so a check can tell at once that nothing anywhere is in flight that long
        self.oldest_op = np.full(0, NO_OP, dtype=np.int64)
        self.group_size: dict[str, int] = {}  # members per group kind, from the job's layout
        self.untraced_home: str | None = None  # the one node all untraced ranks are on, if any
        self.exits: dict[int, HeartbeatV1] = {}  # last heartbeats of ranks that vanished
        # per rank: its newest finished step and that step's ops (group, seq)
        self.newest_ops: dict[int, tuple[int, Sequence[str], np.ndarray]] = {}
        self.settled_ns = -1  # waits that began before this belong to a hang that ended
        self.stall_longest_s: dict[str, float] = {}  # per stall name: the longest per step
        self._last_check_ns = 0

    def _grow(self, top: int) -> None:
        if top > self.done.size:
            pad = np.full(top - self.done.size, -1, np.int64)
            self.done = np.concatenate([self.done, pad])
            self.moved = np.concatenate([self.moved, pad])
            self.oldest_op = np.concatenate(
                [self.oldest_op, np.full(top - self.oldest_op.size, NO_OP, np.int64)])

    def _moved_ns(self, rank: int) -> int:
        return int(self.moved[rank]) if rank < self.moved.size else -1

    def steps_done(self, ranks: np.ndarray, step: int, ends_ns: np.ndarray) -> None:
        """`ranks` finished `step` at `ends_ns` (their node clocks). A rank that stops idle
        is re-published only at its keepalive, so its newest heartbeat can name an earlier
        step than the one it is in; its finished steps say where it stopped as soon as they
        are read. A finished step is also progress: a straggler is alive."""
        if ranks.size == 0:
            return
        self._grow(int(ranks.max()) + 1)
        self.done[ranks] = np.maximum(self.done[ranks], step)  # a step's ranks are unique
        self.moved[ranks] = np.maximum(self.moved[ranks], ends_ns)

    def ops_done(self, rank: int, step: int, groups: Sequence[str], seqs: np.ndarray) -> None:
        """`rank` finished `step` with these ops (its step message, read before the step is
        assembled: a step that waits for a stopped rank is never assembled). Only its newest
        step is kept: a peer blocked in a hang stopped right after it."""
        kept = self.newest_ops.get(rank)
        if kept is None or step >= kept[0]:
            self.newest_ops[rank] = (step, groups, seqs)

    def learn_stalls(self, names: Sequence[str], seconds: np.ndarray) -> None:
        """The step's longest time in each named host stall (`host:<name>` without the
        prefix, as `detectors.stalls.stall_seconds` gives them): what a stall of that name
        may take before one in flight is no longer work."""
        for name, sec in zip(names, seconds.tolist(), strict=True):
            key = f"{HOST_STALL_PREFIX}{name}"
            if sec > self.stall_longest_s.get(key, 0.0):
                self.stall_longest_s[key] = sec

    def _stall_allowance_ns(self, name: str, limit: float) -> float:
        longest = self.stall_longest_s.get(name)
        if longest is None:
            return FIRST_STALL_TIMEOUTS * limit
        return max(limit, STALL_ALLOWANCE * longest * NS_PER_S)

    def settle(self, now_ns: int) -> None:
        """A hang ended (its culprit progressed) at `now_ns`: the waits it caused are over,
        though each waiter's heartbeat shows them until its next one. For one timeout,
        those waits open nothing new; a hang that outlives that is a hang of its own."""
        self.settled_ns = now_ns

    def _over(self, rank: int, group: str, seq: int) -> bool:
        """Did a peer of `rank` in `group` finish the group's instance `seq`? Its newest
        finished step may hold it, or its heartbeat may show it past it: `seq` counts a
        group's instances in order, so a peer in flight only on later ones of the group
        (a send of the next microbatch) is done with this one."""
        for peer in self.members.get(group, ()):
            if peer == rank:
                continue
            kept = self.newest_ops.get(peer)
            if kept is not None:
                _, groups, seqs = kept
                mine = np.fromiter((g == group for g in groups), bool, len(groups))
                if mine.any() and int(seqs[mine].max()) >= seq:
                    return True
            hb = self.last.get(peer)
            if hb is not None and not self._finished(peer, hb.step):
                there = [op.seq for op in hb.inflight if op.group == group]
                if there and min(there) > seq:
                    return True
        return False

    def _newest_done(self, rank: int) -> int:
        """The newest step `rank` finished: assembled, or its message read (a step is
        assembled only a grace after its last rank, and one waiting on a dead rank never is;
        a killed rank's last step message can be read seconds before that)."""
        assembled = int(self.done[rank]) if rank < self.done.size else -1
        kept = self.newest_ops.get(rank)
        return max(assembled, kept[0] if kept is not None else -1)

    def _finished(self, rank: int, step: int) -> bool:
        """Has `rank` finished `step` (its step message was read)?"""
        return self._newest_done(rank) >= step

    def _current_step(self, rank: int, fallback: int) -> int:
        hb = self.last.get(rank)
        done = self._newest_done(rank)
        now = max(hb.step if hb else -1, done + 1 if done >= 0 else -1)
        return now if now >= 0 else fallback

    def observe(self, hb: HeartbeatV1) -> None:
        prev = self.last.get(hb.rank)
        if prev is None or hb.ts_ns >= prev.ts_ns:
            self.last[hb.rank] = hb
            self._grow(hb.rank + 1)
            self.oldest_op[hb.rank] = min((op.start_ns for op in hb.inflight), default=NO_OP)
            state = _state(hb)
            old = _state(prev) if prev is not None else None
            if state != old:
                # a new step or another op in flight: the rank progressed (a keepalive that
                # repeats the same state says only that its agent is alive). It moved when
                # it entered its newest op, which the agent publishes only once the op is
                # long: dating the move by the op's start keeps hang latency off that lag.
                new = [
                    op.start_ns
                    for op in hb.inflight
                    if old is None or (op.group, op.seq) not in old[1]
                ]
                at = max(new) if new and state[0] == (old[0] if old else state[0]) else hb.ts_ns
                self._grow(hb.rank + 1)
                self.moved[hb.rank] = max(int(self.moved[hb.rank]), at)
        for op in hb.inflight:
            if not op.name.startswith(HOST_STALL_PREFIX):  # a stall is no group's op
                self.members.setdefault(op.group, set()).add(hb.rank)
        if hb.exited is not None:
            self.exits.setdefault(hb.rank, hb)
        elif hb.rank in self.exits and hb.ts_ns > self.exits[hb.rank].ts_ns:
            del self.exits[hb.rank]  # restarted (an elastic job): it is back

    def exit_finding(self, now_ns: int, grace_s: float, final: bool = False
                     ) -> HangFinding | None:
        """The first rank whose process vanished (killed, crashed hard), once `grace_s` of
        stream time has shown who else went with it (`final`: no more input will come, so
        nothing is waited for; ranks within `grace_s` of the first still went with it).

        When one rank dies its peers fail after it, in their collectives or by a launcher
        killing them; the first to go is the cause. When most of the job vanishes at once,
        silently, it was torn down (cancelled, preempted): nobody is to blame. Peers that
        exit on an exception (a collective failing on the dead peer) are not a teardown.
        """
        if not self.exits:
            return None
        first = min(self.exits.values(), key=lambda h: (h.ts_ns, h.rank))
        grace_ns = grace_s * NS_PER_S
        if not final and now_ns - first.ts_ns < grace_ns:
            return None
        # a teardown (cancelled, preempted) kills silently; ranks that raise after the first
        # died are failing because of it, and a first death that says why is a cause
        together = sum(1 for h in self.exits.values()
                       if h.exit_reason is None and h.ts_ns - first.ts_ns <= grace_ns)
        known = max(len(self.last), int((self.done >= 0).sum()))
        if first.exit_reason is None and 2 * together > known:
            return None
        where = " in " + ", ".join(sorted({f"{o.name} of {o.group}" for o in first.inflight}
                                          )[:2]) if first.inflight else ""
        later = len(self.exits) - 1
        step = self._current_step(first.rank, first.step)  # its finished steps are newer
        unseen = self._untraced_peer_node(first)
        if unseen is not None:
            return HangFinding(
                culprit=f"node:{unseen}",
                onset_step=step,
                suspects=[(f"node:{unseen}", 0.8), (f"rank:{first.rank}", 0.2)],
                summary=(
                    f"a rank of node {unseen} that is not traced died in step {step}: its "
                    f"peer rank {first.rank} ({first.node}) lost the connection to it"
                    f"{where} ({first.exit_reason}); the job cannot progress without it"
                ),
                stuck_s=(now_ns - first.ts_ns) / NS_PER_S,
            )
        return HangFinding(
            culprit=f"rank:{first.rank}",
            onset_step=step,
            suspects=[(f"rank:{first.rank}", 1.0)],
            summary=(
                f"rank {first.rank} ({first.node}) died in step {step}{where}: "
                + (f"{first.exit_reason}"
                   + (f" at {first.exit_stack[-1]}" if first.exit_stack else "")
                   if first.exit_reason else
                   "its process ended without a goodbye (killed, crashed hard or out of "
                   "memory)")
                + "; the job cannot progress without it"
                + (f", {later} more rank(s) vanished after it" if later else "")
            ),
            stuck_s=(now_ns - first.ts_ns) / NS_PER_S,
        )

    def _untraced_peer_node(self, first: HeartbeatV1) -> str | None:
        """The node of the untraced peer the first rank to die lost, or None.

        A rank that dies because its peer's connection closed (gloo's "Connection reset by
        peer", NCCL's "remote process exited") did not die first: the peer did, and said
        nothing, because it is not traced. When every untraced member of the rank's groups
        is in its tensor-parallel group, that peer is on the rank's node (a drill killing an
        untraced rank blamed the traced one beside it)."""
        if first.exit_reason is None or _BY_PEER.search(first.exit_reason) is None:
            return None
        places = {
            self._node_of_group(g, members)
            for g, members in self.members.items()
            if first.rank in members and self._untraced(g) > 0
        }
        return places.pop() if len(places) == 1 else None

    def _progressing(self, rank: int, now_ns: int, limit: float) -> bool:
        """Did `rank`, or a peer in any of its groups, progress within `limit`?

        A straggler's own state may not change for a long time (it computes), but the peers
        it shares a group with keep entering new collectives with it; a stopped rank's peers
        are stuck in the op it never joined. Only the culprit's neighbourhood is asked, so a
        rank elsewhere that finishes its step just before it blocks does not delay the page.
        """
        near = {rank}
        for members in self.members.values():
            if rank in members:
                near |= members
        return any(now_ns - self._moved_ns(r) <= limit for r in near)

    def learn_layout(self, sizes: dict[str, int]) -> None:
        """Members per group kind (`tp` → 8, …) from the job's layout: with partial tracing
        a group's traced members are fewer, and the rest are untraced, not absent."""
        self.group_size = {k: v for k, v in sizes.items() if v and v > 0}

    def _untraced(self, group: str) -> int:
        """How many members of `group` the layout has that never reported."""
        kind = group.partition(".")[0]
        size = 2 if kind == "pp" else self.group_size.get(kind, 0)
        return max(size - len(self.members.get(group, ())), 0)

    def _node_of_group(self, group: str, inside: set[int]) -> str | None:
        """The node a tensor-parallel group lives on (all its traced members' node), or None
        for any other group: only a tensor-parallel group is known to stay inside a node."""
        nodes = {self.last[r].node for r in inside if r in self.last}
        return nodes.pop() if len(nodes) == 1 and group.startswith("tp.") else None

    def learn_members(self, group: str, ranks: set[int]) -> None:
        self.members.setdefault(group, set()).update(ranks)

    def due(self, now_ns: int) -> bool:
        """Whether `check` would look at stream time `now_ns`: it looks once per stream
        second, and a 10,000-rank job of 30 s steps sends thousands of heartbeats a second,
        so a caller skips its own preparation (the job's timeout) when it is not due."""
        return now_ns - self._last_check_ns >= NS_PER_S

    def check(self, now_ns: int, timeout_s: float | None = None) -> HangFinding | None:
        """Look for a hang at stream time `now_ns` (at most once per stream second)."""
        if not self.due(now_ns):
            return None
        self._last_check_ns = now_ns
        limit = (timeout_s or self.timeout_s) * NS_PER_S
        died = self.exit_finding(now_ns, limit / NS_PER_S * EXIT_GRACE)
        if died is not None or self.exits:
            return died  # a dead rank explains every wait on it; until named, wait for it
        if not self.oldest_op.size or now_ns - int(self.oldest_op.min()) <= limit:
            # no rank shows an op in flight for a timeout: nothing can be stuck. One look at
            # an array instead of a pass over every rank's heartbeat, every stream second:
            # at 8,192 ranks that pass took 30 ms, a second of every 30 s step
            return None
        stuck: dict[tuple[str, int], set[int]] = {}
        info: dict[tuple[str, int], tuple[str, int, int]] = {}  # name, oldest start, step
        # a rank inside any op (and still beating) is waiting, not the root; a silent rank
        # (no heartbeat for a timeout) may have died inside its op: it can be the root. A
        # table from a step the rank has since finished is stale (the rank stopped before
        # its hook sent a newer one): its ops ended, and where it is now is unknown
        # a rank in a named host stall works on its host: it waits on nobody
        in_stall: dict[int, InflightOp] = {}
        for r, hb in self.last.items():
            stalls = [op for op in hb.inflight if op.name.startswith(HOST_STALL_PREFIX)]
            if stalls and now_ns - hb.ts_ns <= limit and not self._finished(r, hb.step):
                in_stall[r] = min(stalls, key=lambda op: op.start_ns)
        busy = {
            r for r, hb in self.last.items()
            if hb.inflight and now_ns - hb.ts_ns <= limit and not self._finished(r, hb.step)
            and r not in in_stall
        }
        settling = now_ns - self.settled_ns <= limit
        stopped_in: dict[int, str] = {}  # rank → the op it sits in that a peer finished
        for rank, hb in self.last.items():
            if rank not in busy:
                continue
            if hb.proc_state is not None:
                # its node says its process cannot run (stopped, frozen, in kernel sleep):
                # whatever op it shows, it waits on nobody, its peers wait on it (a rank
                # frozen inside an all-reduce with an untraced peer read as that peer's hang)
                busy.discard(rank)
                first_op = min(hb.inflight, key=lambda op: op.start_ns)
                stopped_in[rank] = (f"{first_op.name} of {first_op.group}, its process "
                                    f"{PROC_STATE[hb.proc_state]}")
                continue
            long_ops = [op for op in hb.inflight if now_ns - op.start_ns > limit]
            if settling:
                long_ops = [op for op in long_ops if op.start_ns >= self.settled_ns]
            over = [op for op in long_ops if self._over(rank, op.group, op.seq)]
            if over and len(over) == len(long_ops):
                # every long op it shows is one its peers finished: it waits on nobody
                busy.discard(rank)
                stopped_in[rank] = f"{over[0].name} of {over[0].group}"
                continue
            for op in long_ops:
                if not self._over(rank, op.group, op.seq):
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
        if not roots:
            # no traced rank waits on one that could be the root, yet a traced rank's node
            # says its process cannot run: the waits reach it through untraced peers (a
            # frozen rank whose every peer was untraced read as a hang of a far group)
            roots = Counter({r: 1 for r, hb in self.last.items()
                             if hb.proc_state and r not in busy and now_ns - hb.ts_ns <= limit})
        oldest = min(stuck, key=lambda k: info[k][1])
        name, start, step = info[oldest]
        stuck_s = (now_ns - start) / NS_PER_S
        if roots:
            ranked = sorted(roots.items(), key=lambda kv: (-kv[1], kv[0]))
            culprit_rank, waiting = ranked[0]
            if self._progressing(culprit_rank, now_ns, limit):
                return None  # the waits are on a rank that is slow, not stopped
            total = sum(roots.values())
            last_hb = self.last.get(culprit_rank)
            where = f" ({last_hb.node})" if last_hb else ""
            c_step = self._current_step(culprit_rank, step)
            silent = last_hb is None or now_ns - last_hb.ts_ns > limit
            stall = in_stall.get(culprit_rank)
            if stall is not None:
                allowed = self._stall_allowance_ns(stall.name, limit)
                if now_ns - stall.start_ns < allowed:
                    return None  # it saves a checkpoint (loads data, …): work, not a hang
                state = (f"alive, inside {stall.name} for "
                         f"{(now_ns - stall.start_ns) / NS_PER_S:.0f} s, past the "
                         f"{allowed / NS_PER_S:.0f} s such a stall was given")
            elif last_hb is not None and last_hb.proc_state:
                state = (f"inside {stopped_in[culprit_rank]}" if culprit_rank in stopped_in
                         else f"no op in flight, its process {PROC_STATE[last_hb.proc_state]}")
            else:
                state = ("silent" if silent else
                         f"alive, inside {stopped_in[culprit_rank]} that its peers finished"
                         if culprit_rank in stopped_in else "alive, no op in flight")
            groups = sorted({k[0] for k in stuck if culprit_rank in self.members.get(k[0], set())})
            direct = waits_on[culprit_rank]
            how = (f"{direct} of them directly on it in {', '.join(groups[:3]) or oldest[0]}"
                   if direct else f"on it through peers that are not traced, in {oldest[0]}")
            return HangFinding(
                culprit=f"rank:{culprit_rank}",
                onset_step=c_step,
                suspects=[(f"rank:{r}", n / total) for r, n in ranked[:3]],
                summary=(
                    f"rank {culprit_rank}{where} stopped in step {c_step} ({state}); "
                    f"{len(busy)} ranks are blocked, {how}, for {stuck_s:.0f} s"
                ),
                stuck_s=stuck_s,
            )
        full = [k for k in stuck if not (self.members.get(k[0], set()) - stuck[k])]
        key = min(full or [oldest], key=lambda k: info[k][1])
        name, start, step = info[key]
        stuck_s = (now_ns - start) / NS_PER_S
        if full and self._untraced(key[0]):
            if (self.moved >= now_ns - limit).any():
                # the member it waits for is not traced, so its progress cannot be seen; a
                # hang stops the whole job within a step or two, so while any rank still
                # moves (a pipeline warm-up, membership not learnt yet) it is only a wait
                return None
            # A pipeline recv is posted before its data is due, so it is often the oldest wait
            # without being the first one to stop: the oldest stuck collective says more
            colls = [k for k in full if self._untraced(k[0]) and not k[0].startswith("pp.")]
            local = [k for k in colls if self._node_of_group(k[0], stuck[k]) is not None]
            if local and len(colls) - len(local) >= 2:
                # Several groups across nodes wait on untraced members while a tensor-parallel
                # group waits on one on its node: one stopped GPU blocks its whole replica, and
                # every group across nodes with a member in that replica waits; one hung
                # collective would block its group alone (its members' peers follow a step
                # later). The tensor-parallel group is where the replica stopped.
                colls = local
            if colls:
                key = min(colls, key=lambda k: info[k][1])
                name, start, step = info[key]
                stuck_s = (now_ns - start) / NS_PER_S
            return self._untraced_finding(key, stuck[key], name, step, stuck_s)
        if not full:
            if now_ns - start < 2 * limit:
                # Nobody is missing and idle, and no group has every member inside: the op
                # that truly hangs has not crossed the timeout yet (a pipeline recv that
                # started just before a collective hung crosses it first, waiting on a peer
                # that is itself stuck). Wait for the full group; blame a partial one only
                # if none appears.
                return None
            absent = self.members.get(key[0], set()) - stuck[key]
            if any(self._progressing(r, now_ns, limit) for r in absent):
                return None  # its absent members are busy elsewhere and still progress
        return HangFinding(
            culprit=f"group:{key[0]}",
            onset_step=step,
            suspects=[(f"group:{key[0]}", 1.0)],
            summary=(
                f"communication hang: all {len(stuck[key])} members of {key[0]} are inside "
                f"{name} seq {key[1]} for {stuck_s:.0f} s"
            ),
            stuck_s=stuck_s,
        )

    def _untraced_finding(
        self, key: tuple[str, int], inside: set[int], name: str, step: int, stuck_s: float
    ) -> HangFinding:
        """Every traced member of the group waits; the one it waits for is not traced.

        The narrowest entity the data supports: for a tensor-parallel group (it lives inside
        a node) the node of its traced members; for a group across nodes (a pipeline pair, a
        data-parallel ring) the node every untraced rank is on when there is one (a node whose
        agent is down), else the group itself, since the untraced member may be on any node.
        """
        group = key[0]
        node = self._node_of_group(group, inside)
        if node is not None:
            culprit = f"node:{node}"
        elif self.untraced_home is not None:
            culprit = f"node:{self.untraced_home}"
        else:
            culprit = f"group:{group}"
        traced = ", ".join(str(r) for r in sorted(inside)[:4])
        return HangFinding(
            culprit=culprit,
            onset_step=step,
            suspects=[(culprit, 0.8), (f"group:{group}", 0.2)],
            summary=(
                f"hang in {group}: its traced member(s) {traced} sit in {name} seq {key[1]} "
                f"for {stuck_s:.0f} s, waiting on {self._untraced(group)} member(s) that are "
                f"not traced{' on ' + culprit[5:] if culprit.startswith('node:') else ''}"
            ),
            stuck_s=stuck_s,
        )


def _state(hb: HeartbeatV1) -> tuple[int, frozenset[tuple[str, int]]]:
    """What a rank is doing: the step it executes and the ops it has in flight."""
    return hb.step, frozenset((op.group, op.seq) for op in hb.inflight)
