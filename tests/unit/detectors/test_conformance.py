"""The contract every stateful detector keeps (`detectors.base.Stateful`), checked on each.

One parametrized suite, river's habit: for every stateful detector, a sequence of inputs that
drives it through its interesting states, and four checks:
- the same inputs give the same outputs (two fresh instances agree);
- no input is mutated, neither while it is fed nor later (detectors keep references);
- a `clone()` taken mid-sequence continues exactly as the original, independently of it;
- so does a pickled and unpickled copy (a worker can checkpoint or hand a job over).
A detector that is added to `detectors/` with state gets a case here.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import msgspec
import numpy as np
import orjson
import pytest

from detectors.assembly import StepAssembler
from detectors.base import Stateful
from detectors.diagnoser import JobDiagnoser
from detectors.evidence import EvidenceTracker
from detectors.hang import HangDetector
from detectors.incidents import IncidentBook
from detectors.irregularity import StepTimeBaseline
from detectors.noise import NoiseMemory
from detectors.testing import rank_step
from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus
from schemas.clock import NS_PER_S
from schemas.decode import decode_heartbeat, decode_job, decode_steps
from schemas.frame import StepFrame
from schemas.rankstep import RankStep
from schemas.wire import HeartbeatV1, InflightOp, JobV1, Suspect


def digest(x: Any) -> Any:
    """A value that compares equal exactly when `x` holds the same data (arrays by bytes,
    floats by bits, NaN equal to NaN), to compare outputs and to fingerprint inputs."""
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, np.generic):
        return digest(x.item())
    if isinstance(x, float):
        return ("float", x.hex())
    if x is None or isinstance(x, str | int | bool | bytes):
        return x
    if isinstance(x, msgspec.Struct):
        return (type(x).__name__, digest(msgspec.structs.asdict(x)))
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = dataclasses.fields(x)
        return (type(x).__name__, tuple((f.name, digest(getattr(x, f.name))) for f in fields))
    if isinstance(x, dict):
        return ("dict", tuple((digest(k), digest(v)) for k, v in x.items()))
    if isinstance(x, set | frozenset):
        return ("set", tuple(sorted((digest(v) for v in x), key=repr)))
    if isinstance(x, list | tuple | deque):
        return tuple(digest(v) for v in x)
    raise TypeError(f"no digest for {type(x).__name__}")


@dataclass(frozen=True)
class Case:
    make: Callable[[], Stateful]
    inputs: Callable[[], list[Any]]  # the same list on every call (built once)
    feed: Callable[[Any, Any], Any]  # (detector, one input) -> its output
    exercised: Callable[[list[Any]], bool]  # the outputs show the interesting path was taken


# ---- StepAssembler: rank-step messages out of order, one rank missing a step -------------------
@cache
def _rank_messages() -> list[tuple[RankStep, int]]:
    rng = np.random.default_rng(3)
    t0 = 10**18
    out = []
    for step in range(10):
        msgs = []
        for r in range(8):
            if (step, r) == (4, 6):
                continue  # rank 6 never reports step 4: the grace period lets it go
            c = 10.0 + rng.uniform(0, 1) + (15.0 if r == 5 and step >= 3 else 0.0)
            ops = [
                ("compute", "fwd", "", step, 0.0, c, 0),
                ("coll", "all_reduce", f"tp.{r // 4}", step, c, 30.0 - c, 1 << 20),
                ("coll", "all_reduce", f"dp.{r % 4}", step, 31.0, 4.0, 1 << 22),
            ]
            t = t0 + step * 6 * NS_PER_S
            msgs.append(rank_step(r, f"n{r // 4}", step, ops, t0_ns=t))
        order = rng.permutation(len(msgs))
        out += [(msgs[i], msgs[i].t_end_ns + int(k) * 1000) for k, i in enumerate(order)]
    return out


def _assembled(outputs: list[Any]) -> bool:
    frames = [f for fs in outputs for f in fs]
    return len(frames) >= 8 and any(f["missing"] == (6,) for f in frames)


def _frame_view(f: StepFrame) -> dict[str, Any]:
    view = {k: digest(getattr(f, k)) for k in StepFrame.__slots__}
    view["missing"] = tuple(f.missing.tolist())
    return view


# ---- StepTimeBaseline: jitter, a spike, a lasting level shift -----------------------------------
@cache
def _step_times() -> list[float]:
    rng = np.random.default_rng(4)
    t = 2.0 * np.exp(rng.normal(0.0, 0.01, 70))
    t[15] *= 1.8  # a checkpoint
    t[40:] *= 1.3  # the job changed
    return t.tolist()


# ---- NoiseMemory: small groups (leave one out) and large ones, with NaNs -----------------------
@cache
def _noise_inputs() -> list[tuple[Any, ...]]:
    rng = np.random.default_rng(5)
    out: list[tuple[Any, ...]] = []
    for _ in range(14):
        small = rng.normal(0.0, 0.05, 4)
        small[1] += 0.4
        large = rng.normal(0.0, 0.05, 40)
        large[[3, 17]] = np.nan
        out.append(("each", "gpu", small, np.arange(4), 0.004))
        out.append(("each", "gpu40", large, np.arange(40), 0.004))
        out.append(("pool", "node", rng.normal(0.0, 0.02, 6), 0.006))
    return out


def _feed_noise(mem: NoiseMemory, x: tuple[Any, ...]) -> Any:
    if x[0] == "each":
        return mem.sigma_each(*x[1:])
    return mem.sigma(*x[1:])


# ---- EvidenceTracker: one persistent suspect among sporadic ones ---------------------------------
@cache
def _evidence_steps() -> list[tuple[Any, ...]]:
    rng = np.random.default_rng(6)
    out = []
    for step in range(40):
        ents, kinds, zs = [], [], []
        if 10 <= step < 25:
            ents.append("rank:5")
            kinds.append("gpu")
            zs.append(float(rng.uniform(3.0, 9.0)))
        for e in rng.choice(["rank:1", "node:n2", "link:n0~n1"], size=2, replace=False):
            if rng.uniform() < 0.4:
                ents.append(str(e))
                kinds.append("link" if e.startswith("link") else "gpu")
                zs.append(float(rng.uniform(2.5, 5.0)))
        keep = {("rank:5", "gpu")} if step >= 25 else set()
        out.append((step, ents, kinds, zs, [0.1] * len(ents), ["d"] * len(ents), keep))
    return out


def _feed_evidence(t: EvidenceTracker, x: tuple[Any, ...]) -> Any:
    confirmed = t.update(*x)
    return [(c.entity, c.kind, c.first_hit_step(t.z_on), c.mean_z()) for c in confirmed], [
        (r.entity, r.kind) for r in t.ranked()
    ]


# ---- IncidentBook: open, evidence, quiet steps, resolution --------------------------------------
@cache
def _book_ops() -> list[tuple[Any, ...]]:
    ops: list[tuple[Any, ...]] = [
        ("open", "gpu", "rank:5", [Suspect(entity="rank:5", confidence=0.9)], 8, 10, 7, "slow"),
        ("open", "link", "node:n1", [Suspect(entity="node:n1", confidence=1.0)], 12, 12, 9, "nic"),
    ]
    for step in range(10, 30):
        if step < 18:
            ops.append(("evidence", ("gpu", "rank:5"), step, 1.3, 2.0, 64))
        ops.append(("quiet", {("gpu", "rank:5")} if step < 18 else set(), step))
    ops.append(("resolve", "link", "node:n1", 30))
    return ops


def _feed_book(book: IncidentBook, x: tuple[Any, ...]) -> Any:
    if x[0] == "open":
        return [book.open_incident(*x[1:]).to_v1(book.job)]
    if x[0] == "evidence":
        inc = book.get(*x[1])
        if inc is None:
            return []
        inc.add_evidence(*x[2:])
        return [inc.to_v1(book.job)]
    if x[0] == "quiet":
        return [i.to_v1(book.job) for i in book.quiet_step(*x[1:])]
    inc = book.resolve(*x[1:])
    return [] if inc is None else [inc.to_v1(book.job)]


# ---- HangDetector: members learned, finished steps, rank 2 stops outside a collective ----------
@cache
def _hang_inputs() -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [
        ("members", "tp.0", {0, 1, 2, 3}),
        ("members", "dp.0", {0, 4}),
    ]
    for t in range(40):
        if t < 10:
            out.append(("done", np.arange(5), t, np.full(5, t * NS_PER_S)))
        for rank in range(5):
            stuck = t >= 10 and rank != 2
            group, seq = ("dp.0", 9) if rank == 4 else ("tp.0", 40)
            inflight = [InflightOp(group=group, name="all_reduce", seq=seq, start_ns=10 * NS_PER_S)]
            hb = HeartbeatV1(
                v=1,
                job="j",
                rank=rank,
                node=f"n{rank // 2}",
                ts_ns=t * NS_PER_S + rank,
                step=min(t, 10),
                inflight=inflight if stuck else [],
            )
            out.append(("beat", hb))
        out.append(("check", t * NS_PER_S + 10))
    return out


def _feed_hang(d: HangDetector, x: tuple[Any, ...]) -> Any:
    if x[0] == "members":
        return d.learn_members(x[1], x[2])
    if x[0] == "done":
        return d.steps_done(x[1], x[2], x[3])
    if x[0] == "beat":
        return d.observe(x[1])
    return d.check(x[1])


# ---- JobDiagnoser: simulated frames (fast path) and decoded messages (the worker's path) --------
@cache
def _sim_frames() -> list[StepFrame]:
    sc = Scenario(
        job="c",
        layout=layout_for_gpus(64),
        steps=30,
        seed=5,
        fault=Fault("slow_gpu", 1.5, 10),
        heartbeats=False,
    )
    return [f for f in ClusterSimulator(sc).run() if isinstance(f, StepFrame)]


@cache
def _sim_messages() -> list[RankStep | HeartbeatV1 | JobV1]:
    sc = Scenario(
        job="h", layout=layout_for_gpus(16), steps=20, seed=2, fault=Fault("hang_rank", 1.0, 8)
    )
    decoders = {"steps": decode_steps, "heartbeats": decode_heartbeat, "jobs": decode_job}
    out = []
    for topic, _, value, _ in ClusterSimulator(sc).events():
        kind = next(k for k in decoders if f".{k}." in topic)
        out.append(decoders[kind](orjson.dumps(value)))
    return out


def _feed_diagnoser(d: JobDiagnoser, x: Any) -> Any:
    if isinstance(x, StepFrame):
        return d.on_frame(x)
    if isinstance(x, RankStep):
        return d.on_steps(x)
    if isinstance(x, HeartbeatV1):
        return d.on_heartbeat(x)
    return d.on_job(x)


def _incident_kinds(outputs: list[Any]) -> set[str]:
    return {i.kind for o in outputs for i in o.incidents}


CASES: dict[str, Case] = {
    "StepAssembler": Case(
        make=lambda: StepAssembler("j", grace_s=5.0),
        inputs=_rank_messages,
        feed=lambda a, x: [_frame_view(f) for f in a.add(*x)],
        exercised=_assembled,
    ),
    "StepTimeBaseline": Case(
        make=lambda: StepTimeBaseline(window=20),
        inputs=_step_times,
        feed=lambda b, t: b.update(t),
        exercised=lambda out: {"spike", "persistent"} <= {o.irregular for o in out}
        and any(o.level_shift for o in out),
    ),
    "NoiseMemory": Case(
        make=lambda: NoiseMemory(depth=5),
        inputs=_noise_inputs,
        feed=_feed_noise,
        exercised=lambda out: len({digest(o) for o in out}) > 10,
    ),
    "EvidenceTracker": Case(
        make=EvidenceTracker,
        inputs=_evidence_steps,
        feed=_feed_evidence,
        exercised=lambda out: any(("rank:5", "gpu") == c[:2] for o in out for c in o[0]),
    ),
    "IncidentBook": Case(
        make=lambda: IncidentBook("j", resolve_after=5),
        inputs=_book_ops,
        feed=_feed_book,
        exercised=lambda out: {i.status for o in out for i in o} == {"open", "resolved"},
    ),
    "HangDetector": Case(
        make=lambda: HangDetector(timeout_s=10.0),
        inputs=_hang_inputs,
        feed=_feed_hang,
        exercised=lambda out: any(o is not None and o.culprit == "rank:2" for o in out),
    ),
    "JobDiagnoser/frames": Case(
        make=lambda: JobDiagnoser("c"),
        inputs=_sim_frames,
        feed=_feed_diagnoser,
        exercised=lambda out: "gpu" in _incident_kinds(out),
    ),
    "JobDiagnoser/messages": Case(
        make=lambda: JobDiagnoser("h"),
        inputs=_sim_messages,
        feed=_feed_diagnoser,
        exercised=lambda out: "hang" in _incident_kinds(out),
    ),
}


@pytest.fixture(params=list(CASES), name="case")
def _case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]


def _run(case: Case, det: Stateful, inputs: list[Any]) -> list[Any]:
    return [digest(case.feed(det, x)) for x in inputs]


def test_is_a_stateful_detector(case: Case) -> None:
    assert isinstance(case.make(), Stateful)


def test_same_input_same_output(case: Case) -> None:
    inputs = case.inputs()
    a = [case.feed(d, x) for d in [case.make()] for x in inputs]
    assert case.exercised(a), "the case no longer reaches the detector's interesting path"
    assert [digest(o) for o in a] == _run(case, case.make(), inputs)


def test_inputs_are_not_mutated(case: Case) -> None:
    inputs = case.inputs()
    before = [digest(x) for x in inputs]
    det = case.make()
    for i, x in enumerate(inputs):
        case.feed(det, x)
        assert digest(x) == before[i], f"input {i} changed while it was fed"
    assert [digest(x) for x in inputs] == before, "an input kept by the detector changed later"


@pytest.mark.parametrize("copy", ["clone", "pickle"])
def test_a_copy_taken_mid_sequence_continues_identically(case: Case, copy: str) -> None:
    inputs = case.inputs()
    half = len(inputs) // 2
    expected = _run(case, case.make(), inputs)[half:]
    original = case.make()
    _run(case, original, inputs[:half])
    twin = original.clone() if copy == "clone" else pickle.loads(pickle.dumps(original))
    assert type(twin) is type(original) and twin is not original
    # the copy first, to the end: what it learns must not reach the original
    state = pickle.dumps(original)
    assert _run(case, twin, inputs[half:]) == expected
    assert pickle.dumps(original) == state, "the copy shares state with the original"
    assert _run(case, original, inputs[half:]) == expected
