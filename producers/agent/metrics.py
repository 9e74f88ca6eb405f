"""The node agent's own Prometheus metrics: each local rank as a node exporter would show it.

Flare's diagnosis happens centrally, but an SRE looking at one node (or a dashboard built on
node exporters) wants the ranks' vital signs where the node's other metrics are. The agent
sees every step message its ranks send, so it keeps, per rank:
- the last step's time, and the shares of it spent computing, communicating and idle;
- collective and p2p latency per group kind (tp, dp, pp, ...) as a summary (p50, p99) over
  the last `WINDOW` ops, and the bus bandwidth of the last step per group kind;
- seconds in GC (`host:gc` stalls), steps seen, and a hang flag: an op in flight for longer
  than the hang timeout.
Dropped messages are the agent's own (its outbox was full).

Names follow Prometheus conventions (`flare_` prefix, base units, `_total` counters, `_ratio`
for shares). Bus bandwidth uses NCCL's large-group factors (all_reduce 2, others 1): the
agent does not know a group's size, and for the sizes of real jobs the factor is within a few
percent of that.

>>> m = NodeMetrics("n0")
>>> m.observe_step(orjson.dumps({"v": 1, "job": "j", "rank": 3, "node": "n0", "step": 5,
...     "t_start_ns": 0, "t_end_ns": 1_000_000_000, "ops": {
...     "kind": ["compute", "compute", "coll"], "name": ["fwd", "host:gc", "all_reduce"],
...     "group": ["", "", "dp.0"], "seq": [0, 1, 9], "start_ns": [0, 600_000_000, 700_000_000],
...     "dur_ns": [500_000_000, 100_000_000, 200_000_000], "bytes": [0, 0, 100_000_000]}}))
>>> text = m.render(now_ns=2_000_000_000)
>>> 'flare_rank_step_seconds{job="j",node="n0",rank="3"} 1' in text
True
>>> 'flare_rank_step_time_ratio{job="j",node="n0",part="idle",rank="3"} 0.3' in text
True
>>> [line.split()[-1] for line in text.splitlines() if line.startswith("flare_rank_bus")]
['1000000000']
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import orjson

from schemas.prometheus import Exposition
from schemas.rankstep import HOST_STALL_PREFIX

WINDOW = 1000  # collective latencies kept per rank and group kind for the quantiles
HANG_TIMEOUT_S = 10.0  # the detectors' hang timeout floor: an op in flight longer is a hang
_BUS_FACTOR = {"all_reduce": 2.0}  # NCCL busbw factor 2(n-1)/n at large n; others n-1/n → 1


@dataclass(slots=True)
class RankMetrics:
    """What one local rank's step messages said."""

    job: str
    rank: int
    step_s: float = 0.0
    shares: dict[str, float] = field(default_factory=dict)  # compute, communication, idle
    busbw: dict[str, float] = field(default_factory=dict)  # group kind → bytes/s, last step
    latency: dict[str, deque[float]] = field(default_factory=dict)  # group kind → seconds
    latency_sum: dict[str, float] = field(default_factory=dict)
    latency_count: dict[str, int] = field(default_factory=dict)
    gc_s_total: float = 0.0
    steps_total: int = 0


def _covered_s(start: np.ndarray, end: np.ndarray) -> float:
    """Seconds covered by the union of intervals (ops may overlap: async collectives)."""
    if start.size == 0:
        return 0.0
    order = np.argsort(start)
    s, e = start[order], np.maximum.accumulate(end[order])
    gaps = np.maximum(s[1:] - e[:-1], 0)
    return float((e[-1] - s[0]) - gaps.sum()) / 1e9


class NodeMetrics:
    """Per-rank metrics of one node's agent, rendered in Prometheus text format."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.ranks: dict[tuple[str, int], RankMetrics] = {}
        self.bad_steps = 0

    def observe_step(self, payload: bytes) -> None:
        """One wire-v1 step message as a rank sent it; a message it cannot read is counted,
        never raised: the metrics are a side view, the message still goes to Kafka."""
        try:
            msg = orjson.loads(payload)
            ops = msg["ops"]
            key = (str(msg["job"]), int(msg["rank"]))
            span_ns = int(msg["t_end_ns"]) - int(msg["t_start_ns"])
            kind = np.asarray(ops["kind"], dtype=object)
            name = np.asarray(ops["name"], dtype=object)
            group = np.asarray(ops["group"], dtype=object)
            start = np.asarray(ops["start_ns"], dtype=np.int64)
            dur = np.asarray(ops["dur_ns"], dtype=np.int64)
            nbytes = np.asarray(ops["bytes"], dtype=np.int64)
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            self.bad_steps += 1
            return
        r = self.ranks.get(key)
        if r is None:
            r = self.ranks[key] = RankMetrics(*key)
        r.steps_total += 1
        r.step_s = span_ns / 1e9
        stall = np.fromiter((str(n).startswith(HOST_STALL_PREFIX) for n in name), bool,
                            name.size) & (kind == "compute")  # fmt: skip
        gc = stall & (name == f"{HOST_STALL_PREFIX}gc")
        r.gc_s_total += float(dur[gc].sum()) / 1e9
        comp = (kind == "compute") & ~stall
        comm = (kind == "coll") | (kind == "p2p")
        compute_s = _covered_s(start[comp], start[comp] + dur[comp])
        comm_s = _covered_s(start[comm], start[comm] + dur[comm])
        span_s = max(span_ns / 1e9, 1e-9)
        r.shares = {"compute": min(compute_s / span_s, 1.0),
                    "communication": min(comm_s / span_s, 1.0)}  # fmt: skip
        r.shares["idle"] = max(1.0 - r.shares["compute"] - r.shares["communication"], 0.0)
        gkind = np.array([str(g).partition(".")[0] for g in group], dtype=object)
        r.busbw = {}
        for gk in sorted(set(gkind[comm].tolist())):
            mine = comm & (gkind == gk)
            secs = dur[mine] / 1e9
            lat = r.latency.setdefault(gk, deque(maxlen=WINDOW))
            lat.extend(secs.tolist())
            r.latency_sum[gk] = r.latency_sum.get(gk, 0.0) + float(secs.sum())
            r.latency_count[gk] = r.latency_count.get(gk, 0) + int(secs.size)
            factor = np.array([_BUS_FACTOR.get(str(n), 1.0) for n in name[mine]])
            moved = float((nbytes[mine] * factor).sum())
            if secs.sum() > 0 and moved > 0:
                r.busbw[gk] = moved / float(secs.sum())

    def forget(self, job: str) -> None:
        """The job ended on this node: its ranks' series go."""
        for key in [k for k in self.ranks if k[0] == job]:
            del self.ranks[key]

    def render(self, now_ns: int, inflight_since: Callable[[str, int], Iterable[int]] = (
            lambda _j, _r: ()), dropped: int = 0, version: str = "") -> str:
        """The exposition text; `inflight_since(job, rank)`: start times (ns, node clock)
        of the rank's ops in flight, for the hang flag."""
        out = Exposition()
        out.family("flare_agent_build_info", "gauge", "the agent's version")
        out.sample("flare_agent_build_info", {"node": self.node, "version": version}, 1)
        out.family("flare_agent_dropped_messages_total", "counter",
                   "messages dropped because the agent's outbox was full")
        out.sample("flare_agent_dropped_messages_total", {"node": self.node}, dropped)
        out.family("flare_agent_unreadable_steps_total", "counter",
                   "step messages the metrics could not read (still forwarded)")
        out.sample("flare_agent_unreadable_steps_total", {"node": self.node}, self.bad_steps)
        ranks = sorted(self.ranks.values(), key=lambda r: (r.job, r.rank))

        def who(r: RankMetrics) -> dict[str, str]:
            return {"job": r.job, "node": self.node, "rank": str(r.rank)}

        def per_rank(name: str, kind: str, help_text: str,
                     value: Callable[[RankMetrics], float]) -> None:
            out.family(name, kind, help_text)
            for r in ranks:
                out.sample(name, who(r), value(r))

        def hang(r: RankMetrics) -> int:
            oldest = min(inflight_since(r.job, r.rank), default=now_ns)
            return int(now_ns - oldest > HANG_TIMEOUT_S * 1e9)

        per_rank("flare_rank_step_seconds", "gauge", "the rank's last step time",
                 lambda r: r.step_s)
        out.family("flare_rank_step_time_ratio", "gauge",
                   "share of the last step spent computing, communicating or idle")
        for r in ranks:
            for part, v in sorted(r.shares.items()):
                out.sample("flare_rank_step_time_ratio", {**who(r), "part": part}, v)
        out.family("flare_rank_collective_latency_seconds", "summary",
                   "collective and p2p op durations per group kind (last 1000 ops)")
        for r in ranks:
            for gk in sorted(r.latency):
                labels = {**who(r), "group_kind": gk}
                window = np.asarray(r.latency[gk])
                for q in (0.5, 0.99):
                    out.sample("flare_rank_collective_latency_seconds",
                               {**labels, "quantile": str(q)}, float(np.quantile(window, q)))
                out.sample("flare_rank_collective_latency_seconds_sum", labels,
                           r.latency_sum[gk])
                out.sample("flare_rank_collective_latency_seconds_count", labels,
                           r.latency_count[gk])
        out.family("flare_rank_bus_bandwidth_bytes_per_second", "gauge",
                   "bus bandwidth of the last step's collectives per group kind")
        for r in ranks:
            for gk, v in sorted(r.busbw.items()):
                out.sample("flare_rank_bus_bandwidth_bytes_per_second",
                           {**who(r), "group_kind": gk}, v)
        per_rank("flare_rank_gc_seconds_total", "counter", "seconds the rank spent in GC",
                 lambda r: r.gc_s_total)
        per_rank("flare_rank_steps_total", "counter", "steps the rank reported",
                 lambda r: r.steps_total)
        per_rank("flare_rank_hang", "gauge",
                 "1 when an op of the rank has been in flight past the hang timeout", hang)
        return out.text()
