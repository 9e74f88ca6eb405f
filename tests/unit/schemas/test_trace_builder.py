"""schemas.chrome_trace: every op becomes one slice on its rank's track, slices on one track
nest (Perfetto drops the ones that do not), and the copies of one collective are linked."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.chrome_trace import choose_steps, chrome_trace

T0 = 1_790_000_000 * 10**9


def op(rank: int, step: int, kind: str, name: str, start: int, dur: int, *, group: str = "",
       seq: int = 0, node: str | None = None, t_start: int = T0) -> dict[str, Any]:
    return {"step": step, "rank": rank, "node": node or f"node-{rank // 2}", "t_start_ns": t_start,
            "kind": kind, "name": name, "group_name": group, "seq": seq, "start_ns": start,
            "dur_ns": dur, "bytes": 64 if group else 0}


def well_formed(trace: dict[str, Any]) -> None:
    """What a viewer needs of the file (Trace Event Format, JSON object form): the keys of
    every phase, X events nesting on each track, flow chains s..t..f inside an op's slice."""
    assert set(trace) == {"traceEvents", "displayTimeUnit", "otherData"}
    assert trace["displayTimeUnit"] == "ms"
    slices: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)  # in ns
    flows: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int) and e["name"]
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name",
                                 "thread_sort_index") and e["args"]
            continue
        assert isinstance(e["ts"], float) and e["ts"] >= 0 and e["cat"]
        if e["ph"] == "X":
            assert isinstance(e["dur"], float) and e["dur"] >= 0
            start = round(e["ts"] * 1000)  # µs with 3 decimals: exact ns
            slices[e["pid"], e["tid"]].append((start, start + round(e["dur"] * 1000)))
        elif e["ph"] in "stf":
            assert e["bp"] == "e" and isinstance(e["id"], int)
            flows[e["id"]].append(e)
        else:
            assert e["ph"] == "i" and e["s"] == "t"
    for spans in slices.values():  # nesting: each slice inside the open one, or after it
        open_ends: list[int] = []
        for start, end in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], f"{(start, end)} overlaps"
            open_ends.append(end)
    for chain in flows.values():
        assert [e["ph"] for e in chain] == ["s", *["t"] * (len(chain) - 2), "f"]
        assert len({e["name"] for e in chain}) == 1
        for e in chain:
            ts = round(e["ts"] * 1000)
            assert any(lo <= ts <= hi for lo, hi in slices[e["pid"], e["tid"]])


def names(trace: dict[str, Any], what: str) -> dict[tuple[int, int], str]:
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == what}


def test_one_track_per_rank_under_its_node_with_times_from_the_origin() -> None:
    rows = [op(r, 7, "compute", "fwd", 100 * r, 1000, t_start=T0 + 5 * r) for r in range(4)]
    trace = chrome_trace(rows, {"incident": "i"})
    well_formed(trace)
    threads = names(trace, "thread_name")
    assert sorted(threads.values()) == [f"rank {r} (node-{r // 2})" for r in range(4)]
    processes = names(trace, "process_name")
    for (pid, _tid), name in threads.items():
        assert processes[pid, 0] == name.split("(")[1].rstrip(")")
    other = trace["otherData"]
    assert other == {"incident": "i", "origin_ns": T0, "ranks": 4, "ops": 4}
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [other["origin_ns"] + round(e["ts"] * 1000) for e in xs] == [
        T0 + 5 * r + 100 * r for r in range(4)]
    assert {e["dur"] for e in xs} == {1.0}
    marks = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert [m["args"]["step"] for m in marks] == [7] * 4


def test_copies_of_one_collective_are_linked_in_arrival_order_and_summed_per_group() -> None:
    rows = [op(r, 3, "coll", "all_reduce", 2000 if r == 2 else 0, 500 if r == 2 else 2500,
               group="dp.0", seq=11) for r in range(4)]
    rows += [op(0, 3, "p2p", "send", 3000, 100, group="pp.0", seq=5),
             op(1, 3, "p2p", "recv", 2900, 250, group="pp.0", seq=5),
             op(3, 3, "coll", "all_gather", 3000, 100, group="tp.1", seq=1)]  # alone
    trace = chrome_trace(rows, {})
    well_formed(trace)
    events = trace["traceEvents"]
    chains: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] in "stf":
            chains[e["id"]].append(e)
    tid_rank = {(e["pid"], e["tid"]): e["args"]["rank"] for e in events if e["ph"] == "X"
                and e["cat"] != "communicator"}
    ordered = sorted(([tid_rank[e["pid"], e["tid"]] for e in c] for c in chains.values()),
                     key=len)
    assert ordered == [[1, 0], [0, 1, 3, 2]]  # recv came first; rank 2 arrived last
    groups = {e["args"]["name"] for e in events if e["ph"] == "M" and e["pid"] == 1
              and e["name"] == "thread_name"}
    assert groups == {"dp.0", "pp.0", "tp.1"}
    comm = {e["args"]["group_name"]: e for e in events if e.get("cat") == "communicator"}
    assert comm["dp.0"]["args"] == {
        "group_name": "dp.0", "seq": 11, "step": 3, "members": 4, "first_rank": 0,
        "last_rank": 2, "arrival_spread_us": 2.0, "bytes": 64}
    assert comm["dp.0"]["ts"] == 0.0 and comm["dp.0"]["dur"] == 2.5
    assert comm["tp.1"]["args"]["members"] == 1
    coll = [e for e in events if e["ph"] == "X" and e["cat"] == "coll"]
    assert {e["name"] for e in coll} == {"all_reduce dp.0", "all_gather tp.1"}
    assert all(e["args"]["group_name"] and "seq" in e["args"] for e in coll)


def test_an_op_that_does_not_nest_goes_to_an_overflow_track_of_its_rank() -> None:
    rows = [op(0, 1, "compute", "bwd", 0, 1000),
            op(0, 1, "coll", "all_reduce", 800, 600, group="dp.0", seq=1),  # past bwd's end
            op(0, 1, "compute", "optimizer", 1000, 100)]
    trace = chrome_trace(rows, {})
    well_formed(trace)
    threads = names(trace, "thread_name")
    assert sorted(n for n in threads.values() if n.startswith("rank")) == [
        "rank 0 (node-0)", "rank 0 (node-0) +1"]
    by_track = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["cat"] != "communicator":
            by_track[threads[e["pid"], e["tid"]]].append(e["name"])
    assert by_track == {"rank 0 (node-0)": ["bwd", "optimizer"],
                        "rank 0 (node-0) +1": ["all_reduce dp.0"]}


def test_no_ops_is_an_empty_trace() -> None:
    trace = chrome_trace([], {"steps": []})
    assert trace == {"traceEvents": [], "displayTimeUnit": "ms",
                     "otherData": {"steps": [], "origin_ns": None, "ranks": 0, "ops": 0}}
    assert choose_steps([], 5, 100).steps == []


def test_steps_are_taken_whole_within_the_budget() -> None:
    stored = [{"step": s, "ops": 30} for s in (4, 6, 9, 12)]
    assert choose_steps(stored, 10, 100).steps == [4, 6, 9]
    plan = choose_steps(stored[:3], 10, 90)
    assert (plan.steps, plan.ops, plan.more_steps, plan.truncated) == ([4, 6, 9], 90, False,
                                                                       False)


kinds = st.sampled_from([("compute", "fwd", ""), ("coll", "all_reduce", "dp.0"),
                         ("coll", "all_gather", "tp.0"), ("p2p", "send", "pp.0")])


@st.composite
def op_rows(draw: st.DrawFn) -> list[dict[str, Any]]:
    rows = []
    for rank in range(draw(st.integers(1, 4))):
        for _ in range(draw(st.integers(0, 8))):
            kind, name, group = draw(kinds)
            rows.append(op(rank, draw(st.integers(0, 2)), kind, name, draw(st.integers(0, 50)),
                           draw(st.integers(0, 30)), group=group, seq=draw(st.integers(0, 3)),
                           t_start=T0 + draw(st.integers(-20, 20))))
    return rows


@settings(max_examples=200, deadline=None)
@given(op_rows())
def test_any_ops_give_a_well_formed_trace_with_each_op_once_on_its_rank(rows) -> None:
    trace = chrome_trace(rows, {})
    well_formed(trace)
    threads = names(trace, "thread_name")
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "communicator"]
    assert Counter(e["args"]["rank"] for e in ops) == Counter(r["rank"] for r in rows)
    for e in ops:
        assert threads[e["pid"], e["tid"]].startswith(f"rank {e['args']['rank']} (")
    main = sorted(n for n in threads.values() if n.startswith("rank") and " +" not in n)
    assert main == sorted({f"rank {r['rank']} ({r['node']})" for r in rows})  # one each
    comm = Counter((e["args"]["group_name"], e["args"]["seq"]) for e in trace["traceEvents"]
                   if e["ph"] == "X" and e["cat"] == "communicator")
    instances = Counter((r["group_name"], r["seq"]) for r in rows if r["kind"] != "compute")
    assert set(comm) == set(instances) and set(comm.values()) <= {1}
