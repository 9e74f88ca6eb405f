"""A hang's Python stacks, merged: for each distinct stack, which ranks are there and which not.

When a job stops, every rank's hook sends the stacks of its threads once its step has lasted
well past its usual time (`HeartbeatV1.stacks`), and the node agent says when a rank's
process cannot answer at all (`proc_state`: stopped or frozen). One dump per rank is
unreadable at 1,024 ranks; merged, it reads "ranks 0-516,518-1023 are in all_reduce at
train.py:88; rank 517 is in load_batch at data.py:40", and the odd one out is the place in
the code whoever owns the training script has to look at. Ranks that sent nothing since the
hang began are a group of their own, with the reason when the agent knows it.

>>> from schemas.wire import HeartbeatV1, ThreadStack
>>> def beat(rank, frames, ts=5, state=None):
...     stacks = [ThreadStack("MainThread", frames, training=True)] if frames else None
...     return HeartbeatV1(v=1, job="j", rank=rank, node="n", ts_ns=ts, step=3,
...                        stacks=stacks, stacks_ts_ns=ts if stacks else None,
...                        proc_state=state)
>>> book = StackBook()
>>> wait = ["train.py:9 in main", "train.py:40 in step", "distributed_c10d.py:2 in all_reduce"]
>>> [book.observe(beat(r, wait)) for r in (0, 2, 3)] + [book.observe(beat(1, [], state="stopped"))]
[True, True, True, True]
>>> [(g.ranks, g.not_ranks, g.frames[-1:], g.note[:15]) for g in book.merged(0, world=4)]
[('1', '0,2-3', [], 'process stopped'), ('0,2-3', '1', ['distributed_c10d.py:2 in all_reduce'], '')]
"""

from __future__ import annotations

from collections.abc import Iterable

from detectors.base import Stateful
from schemas.wire import HeartbeatV1, StackGroup

MAX_GROUPS = 24  # distinct stacks shown; the rest are the least telling (other threads)
MAX_INTERNED = 4096  # distinct frame lists kept before the table is rebuilt from live ones

# what a rank's node says of a process that cannot run (heartbeat `proc_state`)
PROC_STATE = {
    "stopped": "stopped (SIGSTOP or a debugger)",
    "frozen": "frozen by a cgroup freezer",
    "blocked": "in uninterruptible kernel sleep (a cgroup freezer, stuck I/O or a driver call)",
}
NOTE = {
    **{state: f"process {what}: it cannot answer" for state, what in PROC_STATE.items()},
    "": "no stack since the hang began: not traced, its agent is away, or it is stuck in "
        "native code that holds the interpreter",
}

# a stopped process's stacks, read from outside it by its node agent
OUTSIDE = {state: f"process {what}: its stack read from outside it"
           for state, what in PROC_STATE.items()}

Thread = tuple[str, bool, tuple[str, ...]]  # name, is the training thread, frames


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as sorted ranges: the form an SRE reads and a scheduler accepts.

    >>> rank_ranges([5, 0, 1, 2, 3, 9, 8])
    '0-3,5,8-9'
    >>> rank_ranges([])
    ''
    """
    out: list[str] = []
    run: list[int] = []
    for r in sorted(set(ranks)):
        if run and r == run[-1] + 1:
            run[-1] = r
            continue
        if run:
            out.append(f"{run[0]}-{run[1]}" if run[1] > run[0] else str(run[0]))
        run = [r, r]
    if run:
        out.append(f"{run[0]}-{run[1]}" if run[1] > run[0] else str(run[0]))
    return ",".join(out)


def where_phrase(culprit: str, view: list[StackGroup]) -> str:
    """What the merged view says of a hang's culprit rank, for its summary: its innermost
    frame, or why its process cannot answer ('' when the view does not show it).

    >>> g = StackGroup("training", ["t.py:9 in main", "data.py:40 in load"], "3", 1, "0-2")
    >>> where_phrase("rank:3", [g]), where_phrase("rank:4", [g])
    ('; rank 3 is at data.py:40 in load', '')
    """
    rank = culprit.removeprefix("rank:")
    if not culprit.startswith("rank:"):
        return ""
    for g in view:
        if g.n_ranks == 1 and g.ranks == rank and (g.thread == "training" or not g.frames):
            if g.frames:
                return f"; rank {rank} is at {g.frames[-1]}"
            if g.note.startswith("process"):
                return f"; rank {rank}'s {g.note.partition(':')[0]}"
    return ""


class StackBook(Stateful):
    """Each rank's newest stacks and process state, and the merged view over them.

    Frame lists are interned: when 10,000 ranks wait in the same collective, their stacks
    are one tuple in memory, not 10,000.
    """

    def __init__(self) -> None:
        self.stacks: dict[int, tuple[int, tuple[Thread, ...]]] = {}  # rank -> (ts, threads)
        self.proc_state: dict[int, str] = {}  # rank -> "stopped" | "frozen" | "blocked"
        self.state_since: dict[int, int] = {}  # rank -> ts of the heartbeat that first said so
        self._interned: dict[tuple[str, ...], tuple[str, ...]] = {}

    def observe(self, hb: HeartbeatV1) -> bool:
        """Take what `hb` says of stacks and process state; True when that changed."""
        changed = False
        state = hb.proc_state or ""
        if state != self.proc_state.get(hb.rank, ""):
            changed = True
            if state:
                self.proc_state[hb.rank] = state
                self.state_since.setdefault(hb.rank, hb.ts_ns)
            else:
                del self.proc_state[hb.rank]
                self.state_since.pop(hb.rank, None)
        if hb.stacks:
            ts = hb.stacks_ts_ns if hb.stacks_ts_ns is not None else hb.ts_ns
            old = self.stacks.get(hb.rank)
            if old is None or ts > old[0]:
                self.stacks[hb.rank] = (ts, tuple(
                    (t.thread, t.training, self._intern(t.frames)) for t in hb.stacks))
                changed = True
        return changed

    def _intern(self, frames: list[str]) -> tuple[str, ...]:
        key = tuple(frames)
        if len(self._interned) >= MAX_INTERNED:
            live = {f for _, threads in self.stacks.values() for _, _, f in threads}
            self._interned = {f: f for f in live}
        return self._interned.setdefault(key, key)

    def forget(self, rank: int) -> None:
        """The rank is gone (it exited): what it said no longer describes a live process."""
        self.stacks.pop(rank, None)
        self.proc_state.pop(rank, None)
        self.state_since.pop(rank, None)

    def merged(self, since_ns: int, world: int, known: Iterable[int] = ()) -> list[StackGroup]:
        """The merged view of the stacks taken at or after `since_ns` (the hang's last
        progress): training-thread stacks first, the rarest first (the odd one out leads),
        then the ranks with no stack, then other threads' stacks. `world` ranks make up the
        job (0: only the ranks in `known` and those that sent anything). Empty when no rank
        sent a stack or a process state: then there is nothing to merge."""
        everyone = set(range(world)) if world > 0 else set(known) | set(self.stacks)
        everyone |= set(self.proc_state)
        where: dict[tuple[str, tuple[str, ...], str], list[int]] = {}
        answered: set[int] = set()
        for rank, (ts, threads) in self.stacks.items():
            state = self.proc_state.get(rank, "")
            if ts < since_ns or state and ts < self.state_since[rank]:
                # a process that cannot answer now sent that stack before it stopped: it
                # may have moved on since (a stack is dumped while a step is overdue, and
                # the freeze can land a collective later), so its state is what is known.
                # One read from outside it once it stopped (its node agent) is where it is.
                continue
            answered.add(rank)
            for name, training, frames in threads:
                key = ("training" if training else name, frames, state)
                where.setdefault(key, []).append(rank)
        if not answered and not self.proc_state:
            return []  # no hook of this job sends stacks (an older one, a recording)
        silent: dict[str, list[int]] = {}
        for rank in sorted(everyone - answered):
            silent.setdefault(self.proc_state.get(rank, ""), []).append(rank)

        def group(thread: str, frames: tuple[str, ...], ranks: list[int],
                  note: str = "") -> StackGroup:
            return StackGroup(thread=thread, frames=list(frames), ranks=rank_ranges(ranks),
                              n_ranks=len(ranks), not_ranks=rank_ranges(everyone - set(ranks)),
                              note=note)

        # where each rank's training loop is, and who could not say: rarest first
        lead = [(len(v), 0, min(v), group(k[0], k[1], v, OUTSIDE.get(k[2], "")))
                for k, v in where.items() if k[0] == "training"]
        lead += [(len(v), -1 if state else 1, min(v), group("", (), v, NOTE.get(state, "")))
                 for state, v in silent.items()]
        others = sorted(((k, v) for k, v in where.items() if k[0] != "training"),
                        key=lambda kv: (len(kv[1]), kv[0][0], min(kv[1])))
        out = [g for *_, g in sorted(lead, key=lambda t: t[:3])]
        out += [group(k[0], k[1], v, OUTSIDE.get(k[2], "")) for k, v in others]
        return out[:MAX_GROUPS]
