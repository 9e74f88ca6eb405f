"""An incident's evidence steps as a Chrome trace (Trace Event Format, JSON object form).

The raw ops Flare keeps (`flare.ops`: irregular and sampled steps) are what an on-call wants to
look at when the per-step figures are not enough; ui.perfetto.dev and chrome://tracing open
this file without any Flare code. The layout, and why:

- **One process per node, one track per rank.** A node's ranks share its clock and its host,
  so they sit together; the track (tid = rank + 1, as some viewers treat tid 0 as idle) is
  named `rank N (node)` and sorted by rank. Every rank's step start is an instant event
  `step S`: instants nest under anything, so they can never break the layout below.
- **Ops are complete events** (ph X). ts and dur are µs (3 decimals: exact ns) from the
  trace's earliest op or step start, `otherData.origin_ns` (absolute ns on the nodes'
  clocks): µs since the epoch as a JSON float keep only 0.25 µs. The format wants X events
  on one thread to nest, and Perfetto drops the ones that do not; an async collective
  overlapping a compute phase does not nest. Such an op moves to an overflow track of its
  rank (`rank N (node) +1`), sorted right under it, so nothing is dropped and a rank whose
  ops nest has one track.
- **Collectives grouped by communicator**, in two ways, because they answer two questions:
  1. which collective was slow, and who arrived last: a `communicators` process (sorted
     first) has one track per group; one slice per instance `(group_name, seq)` spans from the
     first member's start to the last member's end, with the members, the first and last rank
     to arrive and the arrival spread;
  2. what this rank waited for: flow arrows (v1 flow events s/t/f, bound to the enclosing
     slice) link every copy of one instance across ranks in arrival order, so selecting one
     rank's all_reduce shows its peers' copies and the arrow ends at the last to arrive.
  Collective and p2p slices are named `<op> <group>` (a p2p transfer's two ends share group
  and seq, DESIGN §2), so a viewer colours them by communicator too. Clocks of different nodes
  disagree by up to tens of ms: a spread smaller than that across nodes is no evidence.

>>> rows = [dict(step=7, rank=r, node="n0", t_start_ns=1_000, kind="coll", name="all_reduce",
...             group_name="dp.0", seq=3, start_ns=500 * r, dur_ns=1_000 - 500 * r, bytes=8)
...        for r in (0, 1)]
>>> trace = chrome_trace(rows, {"incident": "j/gpu/rank:1/7"})
>>> [e["ph"] for e in trace["traceEvents"] if e["ph"] != "M"]
['i', 'i', 'X', 'X', 's', 'f', 'X']
>>> trace["traceEvents"][-1]["args"]["last_rank"], trace["otherData"]["ops"]
(1, 2)
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

Event = dict[str, Any]
COMM_KINDS = frozenset({"coll", "p2p"})  # the op kinds that have a communicator (group, seq)


@dataclass(frozen=True, slots=True)
class TracePlan:
    """Which stored steps go into one trace, and what was left out."""

    steps: list[int]
    ops: int  # the op rows to read: at most the budget
    more_steps: bool  # stored steps of the range beyond `steps`
    truncated: bool  # the first step alone exceeds the budget: only its first `ops` rows


def choose_steps(stored: Iterable[Mapping[str, int]], max_steps: int, max_ops: int) -> TracePlan:
    """The first stored steps (rows of step and op count, in step order) that fit both caps.

    A trace must stay small enough for a browser (Perfetto slows past a few million events),
    so steps are taken whole while they fit; the first one is always taken, cut to the budget
    when it alone is larger, so an incident on a huge job still gets a (partial) trace.

    >>> choose_steps([{"step": 3, "ops": 40}, {"step": 5, "ops": 40}], 5, 100)
    TracePlan(steps=[3, 5], ops=80, more_steps=False, truncated=False)
    >>> choose_steps([{"step": 3, "ops": 40}, {"step": 5, "ops": 40}], 1, 100).more_steps
    True
    >>> choose_steps([{"step": 3, "ops": 400}, {"step": 5, "ops": 40}], 5, 100)
    TracePlan(steps=[3], ops=100, more_steps=True, truncated=True)
    """
    rows = list(stored)
    steps: list[int] = []
    total = 0
    for row in rows[:max_steps]:
        n = int(row["ops"])
        if steps and total + n > max_ops:
            break
        steps.append(int(row["step"]))
        total += n
    return TracePlan(steps=steps, ops=min(total, max_ops), more_steps=len(rows) > len(steps),
                     truncated=total > max_ops)


def _us(ns: int) -> float:
    return round(ns / 1000, 3)


def _lanes(spans: Sequence[tuple[int, int]]) -> list[int]:
    """A lane per span (start, end) such that the spans of one lane nest, in the order given
    (sorted by start, longer first); greedy: the lowest lane that still nests."""
    stacks: list[list[int]] = []  # per lane, the ends of the open spans
    out = []
    for start, end in spans:
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or stack[-1] >= end:
                stack.append(end)
                out.append(lane)
                break
        else:
            stacks.append([end])
            out.append(len(stacks) - 1)
    return out


def _meta(pid: int, tid: int, what: str, args: Event) -> Event:
    return {"ph": "M", "pid": pid, "tid": tid, "name": what, "args": args}


def _op_event(op: Mapping[str, Any], start: int, pid: int, tid: int) -> Event:
    name = str(op["name"])
    if op["kind"] in COMM_KINDS:
        args: Event = {"step": int(op["step"]), "rank": int(op["rank"]),
                       "bytes": int(op["bytes"]), "group_name": op["group_name"],
                       "seq": int(op["seq"])}
        name = f"{name} {op['group_name']}"
    else:
        args = {"step": int(op["step"]), "rank": int(op["rank"]), "bytes": int(op["bytes"])}
    return {"ph": "X", "name": name, "cat": str(op["kind"]), "ts": _us(start),
            "dur": _us(max(int(op["dur_ns"]), 0)), "pid": pid, "tid": tid, "args": args}


def chrome_trace(ops: Iterable[Mapping[str, Any]], other: Mapping[str, Any]) -> Event:
    """The trace of ops rows (`storage.reader` `Reader.ops`: step, rank, node, t_start_ns,
    kind, name, group_name, seq, start_ns, dur_ns, bytes) with `other` as its otherData
    (the incident and which steps are included), plus origin_ns (None without ops), ranks
    and ops."""
    rows = list(ops)
    starts = [int(r["t_start_ns"]) + int(r["start_ns"]) for r in rows]
    origin = min([*starts, *(int(r["t_start_ns"]) for r in rows)], default=0)
    node_of: dict[int, str] = {}
    for r in rows:
        node_of.setdefault(int(r["rank"]), str(r["node"]))
    nodes = sorted(set(node_of.values()))
    pid_of = {node: i + 2 for i, node in enumerate(nodes)}  # pid 1: the communicators
    next_tid = max(node_of, default=0) + 2  # overflow and communicator tracks, after ranks

    meta: list[Event] = []
    for node in nodes:
        meta.append(_meta(pid_of[node], 0, "process_name", {"name": node}))
        meta.append(_meta(pid_of[node], 0, "process_sort_index", {"sort_index": pid_of[node]}))
    marks: list[Event] = []
    events: list[Event] = []
    by_rank: dict[int, list[int]] = defaultdict(list)
    step_start: dict[int, dict[int, int]] = defaultdict(dict)  # rank -> step -> t_start
    for i, r in enumerate(rows):
        by_rank[int(r["rank"])].append(i)
        step_start[int(r["rank"])].setdefault(int(r["step"]), int(r["t_start_ns"]))
    lane_tid: dict[tuple[int, int], int] = {}
    where: list[tuple[int, int]] = [(0, 0)] * len(rows)  # (pid, tid) of each op's slice
    for rank in sorted(by_rank):
        pid, label = pid_of[node_of[rank]], f"rank {rank} ({node_of[rank]})"
        for step, t0 in sorted(step_start[rank].items()):
            marks.append({"ph": "i", "s": "t", "name": f"step {step}", "cat": "step",
                          "ts": _us(t0 - origin), "pid": pid, "tid": rank + 1,
                          "args": {"step": step}})
        order = sorted(by_rank[rank], key=lambda i: (starts[i], -int(rows[i]["dur_ns"])))
        spans = [(starts[i], starts[i] + max(int(rows[i]["dur_ns"]), 0)) for i in order]
        for i, lane in zip(order, _lanes(spans), strict=True):
            if (rank, lane) not in lane_tid:
                tid = rank + 1 if lane == 0 else next_tid
                next_tid += lane > 0
                lane_tid[rank, lane] = tid
                name = label if lane == 0 else f"{label} +{lane}"
                meta.append(_meta(pid, tid, "thread_name", {"name": name}))
                meta.append(_meta(pid, tid, "thread_sort_index",
                                  {"sort_index": (rank + 1) * 1000 + lane}))
            where[i] = (pid, lane_tid[rank, lane])
            events.append(_op_event(rows[i], starts[i] - origin, *where[i]))

    comm, next_tid = _communicators(rows, starts, origin, where, next_tid)
    if comm:
        meta.append(_meta(1, 0, "process_name", {"name": "communicators"}))
        meta.append(_meta(1, 0, "process_sort_index", {"sort_index": 0}))
    return {
        "traceEvents": meta + marks + events + comm,
        "displayTimeUnit": "ms",
        "otherData": {**other, "origin_ns": origin if rows else None, "ranks": len(node_of),
                      "ops": len(rows)},
    }


def _communicators(
    rows: list[Mapping[str, Any]], starts: list[int], origin: int,
    where: list[tuple[int, int]], next_tid: int,
) -> tuple[list[Event], int]:
    """Flow arrows between the copies of each (group, seq) instance, and the communicators'
    tracks: one per group, one slice per instance (see the module docstring)."""
    instances: dict[tuple[str, int], list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        if r["kind"] in COMM_KINDS:
            instances[str(r["group_name"]), int(r["seq"])].append(i)
    flows: list[Event] = []
    by_group: dict[str, list[tuple[int, int, Event]]] = defaultdict(list)
    for flow_id, ((group, seq), members) in enumerate(sorted(instances.items()), start=1):
        members.sort(key=lambda i: (starts[i], int(rows[i]["rank"])))
        first, last = rows[members[0]], rows[members[-1]]
        name = f"{first['name']} {group}"
        if len(members) > 1:
            for n, i in enumerate(members):
                mid = starts[i] + max(int(rows[i]["dur_ns"]), 0) // 2
                ph = "s" if n == 0 else ("f" if n == len(members) - 1 else "t")
                pid, tid = where[i]
                flows.append({"ph": ph, "bp": "e", "name": name, "cat": "comm", "id": flow_id,
                              "ts": _us(mid - origin), "pid": pid, "tid": tid})
        lo = starts[members[0]]
        hi = max(starts[i] + max(int(rows[i]["dur_ns"]), 0) for i in members)
        by_group[group].append((lo, hi, {
            "ph": "X", "name": f"{first['name']} #{seq}", "cat": "communicator",
            "ts": _us(lo - origin), "dur": _us(hi - lo), "pid": 1,
            "args": {"group_name": group, "seq": seq, "step": int(first["step"]),
                     "members": len(members), "first_rank": int(first["rank"]),
                     "last_rank": int(last["rank"]),
                     "arrival_spread_us": _us(starts[members[-1]] - lo),
                     "bytes": max(int(rows[i]["bytes"]) for i in members)},
        }))
    tracks: list[Event] = []
    for index, group in enumerate(sorted(by_group)):
        slices = sorted(by_group[group], key=lambda s: (s[0], -s[1]))
        tids: dict[int, int] = {}
        for (_lo, _hi, event), lane in zip(slices, _lanes([(s[0], s[1]) for s in slices]),
                                           strict=True):
            if lane not in tids:
                tids[lane] = next_tid
                next_tid += 1
                label = group if lane == 0 else f"{group} +{lane}"
                tracks.append(_meta(1, tids[lane], "thread_name", {"name": label}))
                tracks.append(_meta(1, tids[lane], "thread_sort_index",
                                    {"sort_index": index * 1000 + lane}))
            tracks.append({**event, "tid": tids[lane]})
    return flows + tracks, next_tid
