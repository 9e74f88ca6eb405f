"""Kineto replay: PyTorch profiler traces (one JSON file per rank) → wire-v1 events.

`flare replay --kineto DIR` calls `kineto_to_events` and publishes (or records) what it
yields: first the job's `start` event, then every rank's steps messages in time order. Files
may be gzipped; a folder stands for the trace files in it. The rank comes from the trace's
`distributedInfo`, else from the file name (`rank3`, `rank-3`), else from the file's position.
The node is the trace's `host_name`, else the host in tensorboard_trace_handler's file name
(`<host>_<pid>.<ts>.pt.trace.json`).
"""

from __future__ import annotations

import gzip
import heapq
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from producers.kineto.groups import ProcessGroup, assign_threads
from producers.kineto.names import UNKNOWN_GROUP, group_name
from producers.kineto.peers import p2p_candidates, pick_peers
from producers.kineto.streams import assign_streams
from producers.kineto.trace import (
    KinetoError,
    NoSteps,
    RankTrace,
    p2p_posted,
    parse_trace,
    relabel,
    stream_ops,
    thread_ops,
)
from schemas import topics

_RANK_IN_NAME = re.compile(r"rank[_\-]?(\d+)", re.IGNORECASE)
_TB_NAME = re.compile(r"^(?P<host>.+)_(?P<pid>\d+)\.\d+\.pt\.trace\.json(?:\.gz)?$")
_SUFFIXES = (".json", ".json.gz")

Event = tuple[str, str, dict[str, Any], int]  # topic, key (the job id), value, ts_ns

__all__ = ["Event", "KinetoError", "kineto_to_events", "load_trace", "trace_files"]


def trace_files(paths: Iterable[str | Path]) -> list[Path]:
    """The trace files named by `paths` (folders expand to their *.json / *.json.gz)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.iterdir() if f.is_file() and f.name.endswith(_SUFFIXES))
        elif p.is_file():
            out.append(p)
        else:
            raise KinetoError(f"{p}: no such file or folder")
    if not out:
        raise KinetoError("no trace files (*.json, *.json.gz) found")
    return out


def _read(path: Path) -> Any:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else \
            path.read_bytes()
        return orjson.loads(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise KinetoError(f"{path}: cannot read ({exc})") from None
    except orjson.JSONDecodeError as exc:
        raise KinetoError(f"{path}: not JSON ({exc})") from None


def load_trace(path: Path, job: str, position: int) -> RankTrace:
    """Parse one file; KinetoError names the file and the reason when it is unusable."""
    doc = _read(path)
    if not isinstance(doc, dict):
        raise KinetoError(f"{path}: a Kineto trace is a JSON object with traceEvents")
    m = _RANK_IN_NAME.search(path.name)
    tb = _TB_NAME.match(path.name)
    return parse_trace(doc, job, rank=int(m.group(1)) if m else position,
                       node=tb.group("host") if tb else None, source=str(path))


def _windows_joined(traces: list[RankTrace]) -> list[RankTrace]:
    """One trace per rank: a profiler with a repeating schedule writes a file per window of
    steps (`tensorboard_trace_handler`), and production jobs keep several; a rank's windows
    are joined in step order. Two files with the same step of a rank are an error (two
    runs, or two ranks that claim one number)."""
    by_rank: dict[int, list[RankTrace]] = {}
    for t in traces:
        by_rank.setdefault(t.rank, []).append(t)
    out = []
    for rank, parts in sorted(by_rank.items()):
        steps = sorted((m for t in parts for m in t.steps), key=lambda m: m["step"])
        numbers = [m["step"] for m in steps]
        if len(set(numbers)) < len(numbers):
            raise KinetoError(f"several trace files claim rank {rank} at the same step(s); "
                              "one rank's files must be windows of one run")
        first = parts[0]
        groups = tuple(dict.fromkeys(g for t in parts for g in t.process_groups))
        out.append(RankTrace(rank, max(t.world_size for t in parts), first.node,
                             first.local_rank, steps, groups))
    return out


def _groups_inferred(traces: list[RankTrace]) -> None:
    """Ops with no group in the trace get one, inferred across all ranks: a gloo collective
    the group its worker thread serves (`groups.assign_threads`), a gloo send or receive its
    pair's direction in the smallest group of the two (`peers`), an older NCCL trace's
    kernel its stream's group, and its pair's direction for a send or receive (`streams`)."""
    known = {t.rank: t.process_groups for t in traces}
    threads = {(t.rank, tid): ops for t in traces for tid, ops in thread_ops(t).items()}
    found = assign_threads(threads, known)
    lanes = assign_streams({(t.rank, s): ops for t in traces
                            for s, ops in stream_ops(t).items()}, known,
                           {t.rank: t.node for t in traces})
    posted = {t.rank: p2p_posted(t) for t in traces}
    # each rank's streams and threads, grouped once, not scanned once per rank
    by_rank: dict[int, dict[str, tuple[str, int]]] = {}
    for (rank, s), g in lanes.items():
        by_rank.setdefault(rank, {})[s] = (_wire(g), _peer(g, rank))
    threads_of: dict[int, dict[str, ProcessGroup]] = {}
    for (rank, tid), g in found.items():
        threads_of.setdefault(rank, {})[tid] = g
    for t in traces:
        streams = by_rank.get(t.rank, {})
        mine = threads_of.get(t.rank, {})
        is_send, start, end = posted[t.rank]
        candidates = p2p_candidates(t.process_groups, {g.name for g in mine.values()})
        ways = list(zip(is_send.tolist(), pick_peers(t.rank, is_send, start, end,
                                                     candidates, posted).tolist(), strict=True))
        names = {way: _transfer(t, *way) for way in set(ways)}  # a few pairs, many ops
        relabel(t, {tid: _wire(g) for tid, g in mine.items()}, [names[w] for w in ways],
                streams)


def _peer(g: ProcessGroup, rank: int) -> int:
    """The other member of a pair's group (where a send goes, a receive comes from); -1 for
    a larger group."""
    others = [r for r in g.ranks if r != rank]
    return others[0] if len(others) == 1 else -1


def _wire(g: ProcessGroup) -> str:
    return group_name({"Process Group Name": g.name, "Process Group Description": g.desc})


def _transfer(t: RankTrace, is_send: bool, peer: int) -> str:
    """`<group>.<src>-<dst>` as the hook names a pair's direction; a transfer whose peer is
    not known is the rank's own, matched with nobody's."""
    shared = [g for g in t.process_groups if peer in g.ranks and t.rank in g.ranks]
    if peer < 0 or not shared:
        return f"{UNKNOWN_GROUP}-r{t.rank}"
    src, dst = (t.rank, peer) if is_send else (peer, t.rank)
    return f"{_wire(min(shared, key=lambda g: len(g.ranks)))}.{src}-{dst}"


def kineto_to_events(paths: Iterable[str | Path], job: str) -> Iterator[Event]:
    """The jobs start event, then all ranks' steps messages ordered by their end time.

    Each file is parsed and dropped before the next one is read, so memory holds only the
    (small) steps messages, not the traces.
    """
    files = trace_files(paths)
    loaded: list[RankTrace] = []
    empty: list[NoSteps] = []
    for i, f in enumerate(files):
        try:
            loaded.append(load_trace(f, job, i))
        except NoSteps as exc:
            empty.append(exc)
    if not loaded:
        raise empty[0]
    traces = _windows_joined(loaded)
    _groups_inferred(traces)
    ranks = [t.rank for t in traces]
    world = max([t.world_size for t in traces] + [max(ranks) + 1])
    t_first = min(m["t_start_ns"] for t in traces for m in t.steps)
    yield (topics.JOBS, job, {"v": 1, "job": job, "event": "start", "ts_ns": t_first,
                             "world_size": world}, t_first)
    streams = [[(m["t_end_ns"], t.rank, m["step"], m) for m in t.steps] for t in traces]
    for ts, _rank, _step, msg in heapq.merge(*streams, key=lambda x: x[:3]):
        yield (topics.STEPS, job, msg, ts)
