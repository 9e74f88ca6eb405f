"""The pipeline benchmark's workload: one long simulated job, replayed from byte templates.

Generation is not what `bench_pipeline.py` measures, and simulating thousands of ranks for
every step would compete with the worker for the CPU. So `distinct` steps are simulated once
and encoded as byte templates with holes where the step number and every timestamp go; the
run cycles through them, filling the holes so the worker sees one long job whose steps
follow each other. With `encoding="v2"` the steps are `flare.steps.v2` messages, whose step
and times sit at fixed offsets of their head (`schemas.steps_v2.restamp`).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus
from schemas.steps_v2 import encode_steps_value, restamp
from schemas.topics import JOBS, STEPS, STEPS_V2

_MARK = 7_777_000_000_000_000_000  # > any ns timestamp we emit, < 2**63: a hole in a template
_HOLE = re.compile(rb"7777000000000000(\d{3})")


@dataclass(slots=True)
class Template:
    """One encoded message with holes: parts[0] hole0 parts[1] hole1 ... parts[n]."""

    topic: str
    parts: list[bytes]
    holes: list[tuple[bool, int]]  # (is_step, base value), in byte order
    step: int  # the message's step, counted from the first distinct step
    ts: int  # true time (ns) of the message in cycle 0
    n_ops: int

    def render(self, step_shift: int, time_shift: int) -> bytes:
        out = [self.parts[0]]
        for (is_step, base), part in zip(self.holes, self.parts[1:], strict=True):
            out.append(b"%d" % (base + (step_shift if is_step else time_shift)))
            out.append(part)
        return b"".join(out)


@dataclass(slots=True)
class BinaryTemplate:
    """One `flare.steps.v2` message, re-stamped with its step and times when rendered."""

    raw: bytes
    base: tuple[int, int, int]  # step (from the first distinct step), t_start_ns, t_end_ns
    step: int
    ts: int
    n_ops: int
    topic: str = STEPS_V2

    def render(self, step_shift: int, time_shift: int) -> bytes:
        step, t0, t1 = self.base
        return restamp(self.raw, step=step + step_shift, t_start_ns=t0 + time_shift,
                       t_end_ns=t1 + time_shift)


def _binary_template(value: dict[str, Any], ts: int, s0: int) -> BinaryTemplate:
    return BinaryTemplate(encode_steps_value(value), (value["step"] - s0, value["t_start_ns"],
                          value["t_end_ns"]), value["step"] - s0, ts, len(value["ops"]["kind"]))


def _template(topic: str, value: dict[str, Any], ts: int, s0: int) -> Template:
    """Encode `value` with its step and time fields replaced by markers, then split."""
    holes: list[tuple[bool, int]] = []

    def mark(is_step: bool, base: int) -> int:
        holes.append((is_step, base))
        return _MARK + len(holes) - 1

    v = dict(value)
    v["step"] = mark(True, value["step"] - s0)
    n_ops = 0
    if topic == STEPS:
        v["t_start_ns"] = mark(False, value["t_start_ns"])
        v["t_end_ns"] = mark(False, value["t_end_ns"])
        n_ops = len(value["ops"]["kind"])
    else:
        v["ts_ns"] = mark(False, value["ts_ns"])
        v["inflight"] = [{**op, "start_ns": mark(False, op["start_ns"])}
                         for op in value["inflight"]]
    pieces = _HOLE.split(orjson.dumps(v))
    order = [int(x) for x in pieces[1::2]]
    if sorted(order) != list(range(len(holes))):
        raise RuntimeError(f"template holes lost in a {topic} message: {order}")
    return Template(topic, pieces[0::2], [holes[i] for i in order], value["step"] - s0, ts,
                    n_ops)


@dataclass(slots=True)
class Workload:
    job: str
    world: int
    distinct: int
    period_ns: int  # true-time length of one cycle of `distinct` steps
    start: bytes  # the job's start event
    templates: list[Template | BinaryTemplate]
    first_step: int
    heartbeats: bool
    steps_topic: str = STEPS  # STEPS_V2 when the steps are v2

    def cycles(self, steps: int) -> int:
        return -(-steps // self.distinct)

    def events(self, steps: int) -> Iterator[tuple[str, bytes, bytes, int]]:
        """(topic, key, value, true ts) of the whole run: the job's start, then `steps` steps.

        No `end` event: the last step completes when its last rank reports (the start event
        gives the world size), and an end racing the last ranks' messages across topics
        would close that step early in the worker's event-time merge.
        """
        key = self.job.encode()
        yield JOBS, key, self.start, self.templates[0].ts - 1
        for c in range(self.cycles(steps)):
            n = min(self.distinct, steps - c * self.distinct)
            shift_s, shift_t = self.first_step + c * self.distinct, c * self.period_ns
            for t in self.templates:
                if t.step < n:
                    yield t.topic, key, t.render(shift_s, shift_t), t.ts + shift_t

    def topic_index(self, topic: str, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """Per offset of `topic` (one job: one partition): the message's true time, and the
        ops of the messages up to it (cumulative)."""
        if topic == JOBS:
            return np.array([self.templates[0].ts - 1], np.int64), np.zeros(1, np.int64)
        st = [t for t in self.templates if t.topic == topic]
        if not st:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        ts, ops, step = (np.array([getattr(t, a) for t in st], np.int64)
                         for a in ("ts", "n_ops", "step"))
        all_ts, all_ops = [], []
        for c in range(self.cycles(steps)):
            keep = step < min(self.distinct, steps - c * self.distinct)
            all_ts.append(ts[keep] + c * self.period_ns)
            all_ops.append(ops[keep])
        return np.concatenate(all_ts), np.cumsum(np.concatenate(all_ops))


def build_workload(gpus: int, distinct: int, step_time_s: float, microbatches: int,
                   chunks: int, heartbeats: bool, first_step: int,
                   fault: Fault | None = None, encoding: str = "v1") -> Workload:
    """Simulate `distinct` + 2 steps, keep steps 1..distinct (step 0 is the job's first);
    `fault` is in every one of them (an incident stays open once confirmed); steps as
    `encoding` ("v1" JSON or "v2" binary)."""
    s0 = 1
    sc = Scenario(job=f"bench-{gpus}-{uuid.uuid4().hex[:6]}", layout=layout_for_gpus(gpus),
                  steps=s0 + distinct + 1, seed=7, microbatches=microbatches, chunks=chunks,
                  step_time_s=step_time_s, heartbeats=heartbeats, fault=fault)
    sim = ClusterSimulator(sc)
    templates: list[Template | BinaryTemplate] = []
    first_start: dict[int, int] = {}
    start = b""
    for topic, _key, value, ts in sim.events():
        if topic == JOBS:
            if value["event"] == "start":
                start = orjson.dumps(value)
            continue
        s = value["step"]
        if topic == STEPS:
            first_start[s] = min(first_start.get(s, value["t_start_ns"]), value["t_start_ns"])
        if s0 <= s < s0 + distinct:
            templates.append(_binary_template(value, ts, s0) if topic == STEPS
                             and encoding == "v2" else _template(topic, value, ts, s0))
    period = first_start[s0 + distinct] - first_start[s0]
    return Workload(sc.job, sc.layout.world, distinct, period, start, templates, first_step,
                    heartbeats, STEPS_V2 if encoding == "v2" else STEPS)
