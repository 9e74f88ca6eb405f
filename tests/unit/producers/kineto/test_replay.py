"""Trace files to a job's events: files and folders, ranks from names, merge order, errors,
and the real public traces when they are present."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import orjson
import pytest

from producers.kineto.replay import KinetoError, kineto_to_events, trace_files
from schemas.decode import decode_job, decode_steps

REPO = Path(__file__).resolve().parents[4]
SHARED_TRACES = REPO.parent / "shared" / "traces"


def test_ranks_are_merged_in_end_time_order_after_the_job_start(tmp_path, nccl_trace):
    for r in range(2):
        raw = json.dumps(nccl_trace(r, slow=3.0 if r == 1 else 1.0)).encode()
        (tmp_path / f"job_rank{r}.pt.trace.json.gz").write_bytes(gzip.compress(raw))
    events = list(kineto_to_events([tmp_path], "kj"))
    topic, key, value, ts = events[0]
    assert (topic, key) == ("flare.jobs.v1", "kj")
    job = decode_job(orjson.dumps(value))
    assert job.event == "start" and job.world_size == 2
    steps = [decode_steps(orjson.dumps(v)) for t, _k, v, _ts in events[1:]]
    assert [(s.rank, s.step) for s in steps] == [(0, 10), (1, 10), (0, 11), (1, 11)]
    assert [e[3] for e in events[1:]] == sorted(e[3] for e in events[1:])
    assert [e[3] for e in events[1:]] == [s.t_end_ns for s in steps]  # due when the rank sent it
    assert ts == steps[0].t_start_ns  # the job starts with its first step
    assert steps[1].dur_ns[1] == 3 * steps[0].dur_ns[1]  # each file is its own rank's


def test_the_rank_comes_from_the_file_name_else_its_position(tmp_path, nccl_trace):
    for name in ("trace-rank-5.json", "zz.json"):
        doc = nccl_trace(0)
        del doc["distributedInfo"]
        (tmp_path / name).write_text(json.dumps(doc))
    events = list(kineto_to_events([tmp_path], "kj"))
    assert {v["rank"] for _t, _k, v, _ts in events[1:]} == {5, 1}
    assert decode_job(orjson.dumps(events[0][2])).world_size == 6


def test_bad_inputs_say_what_is_wrong(tmp_path, nccl_trace):
    with pytest.raises(KinetoError, match="no such file"):
        trace_files([tmp_path / "missing"])
    with pytest.raises(KinetoError, match="no trace files"):
        trace_files([tmp_path])
    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(KinetoError, match="not JSON"):
        list(kineto_to_events([tmp_path / "a.json"], "j"))
    (tmp_path / "b.json").write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(KinetoError, match="ProfilerStep"):
        list(kineto_to_events([tmp_path / "b.json"], "j"))
    doc = nccl_trace(0)
    (tmp_path / "c.json").write_text(json.dumps(doc))
    (tmp_path / "d.json").write_text(json.dumps(doc))
    with pytest.raises(KinetoError, match="rank"):
        list(kineto_to_events([tmp_path / "c.json", tmp_path / "d.json"], "j"))


@pytest.mark.parametrize("name, world, n_steps, names", [
    ("a100-nccl-rank0-of-2.json.gz", 2, 3, {"all_reduce", "broadcast", "gpu_compute"}),
    ("a100-rank3-of-8.json.gz", 8, 6, {"all_reduce", "all_to_all", "gpu_compute"}),
])
def test_real_public_traces_are_accepted(name, world, n_steps, names):
    path = SHARED_TRACES / "hta" / name
    if not path.exists():
        pytest.skip(f"{path} not present")
    events = list(kineto_to_events([path], "hta"))
    assert decode_job(orjson.dumps(events[0][2])).world_size == world
    steps = [decode_steps(orjson.dumps(v)) for _t, _k, v, _ts in events[1:]]
    assert len(steps) == n_steps
    for s in steps:
        assert set(s.name) == names
        coll = s.kind == 1
        assert coll.sum() >= 3 and (s.dur_ns[coll] > 0).all() and (s.bytes[coll] > 0).all()
        assert s.t_end_ns - s.t_start_ns > 50_000_000  # 75–225 ms steps


def _later_window(doc: dict, steps: int, us: float) -> dict:
    """The same rank's next window: step numbers `steps` on, `us` microseconds later."""
    out = json.loads(json.dumps(doc))
    for e in out["traceEvents"]:
        e["ts"] += us
        if e["name"].startswith("ProfilerStep#"):
            e["name"] = f"ProfilerStep#{int(e['name'].split('#')[1]) + steps}"
    return out


def test_a_rank_windows_are_joined_in_step_order(tmp_path, nccl_trace):
    """A repeating profiler schedule writes one file per window of steps; training that
    stops mid-window leaves a file with no step at all, which is skipped."""
    first = nccl_trace(0)
    (tmp_path / "w1.json").write_text(json.dumps(_later_window(first, 2, 4000.0)))
    (tmp_path / "w0.json").write_text(json.dumps(first))
    (tmp_path / "w2.json").write_text(json.dumps({**first, "traceEvents": []}))
    events = list(kineto_to_events([tmp_path], "kj"))
    steps = [decode_steps(orjson.dumps(v)) for _t, _k, v, _ts in events[1:]]
    assert [(s.rank, s.step) for s in steps] == [(0, 10), (0, 11), (0, 12), (0, 13)]
    (tmp_path / "w3.json").write_text(json.dumps(first))  # steps 10-11 of rank 0 again
    with pytest.raises(KinetoError, match="rank 0 at the same step"):
        list(kineto_to_events([tmp_path], "kj"))


def test_only_empty_windows_say_so(tmp_path, nccl_trace):
    (tmp_path / "w.json").write_text(json.dumps({**nccl_trace(0), "traceEvents": []}))
    with pytest.raises(KinetoError, match="no ProfilerStep"):
        list(kineto_to_events([tmp_path], "kj"))
