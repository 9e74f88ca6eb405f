"""One rank's trace to its steps messages: steps, kernel durations, sizes, groups, seqs."""

from __future__ import annotations

import orjson
import pytest

from producers.kineto.trace import KinetoError, parse_trace
from schemas.decode import decode_steps
from tests.unit.producers.kineto.conftest import older_nccl_traces


def test_gpu_trace_becomes_steps_with_kernel_durations(nccl_trace):
    fast = parse_trace(nccl_trace(0), "kj", rank=None, node="host-a")
    slow = parse_trace(nccl_trace(1, slow=3.0), "kj", rank=None, node=None)
    assert (fast.rank, fast.world_size, fast.node, fast.local_rank) == (0, 2, "host-a", 0)
    assert (slow.rank, slow.node, slow.local_rank) == (1, "unknown-1", 1)
    steps = [decode_steps(orjson.dumps(m)) for m in fast.steps]
    assert [s.step for s in steps] == [10, 11]
    s0 = steps[0]
    assert s0.name == ["all_reduce", "gpu_compute"]
    assert s0.group == ["dp.3", ""]
    assert s0.bytes.tolist() == [2048, 0]
    assert s0.dur_ns.tolist() == [600_000, 400_000]
    assert s0.start_ns.tolist() == [1_400_000, 20_000]
    assert s0.t_start_ns == 1_700_000_000_000_000_000 + 1_000_000
    assert s0.t_end_ns == s0.t_start_ns + 2_000_000  # the kernel outlives the CPU span
    assert s0.seq[0] == (10 << 20) and steps[1].seq[0] == (11 << 20)
    s1 = decode_steps(orjson.dumps(slow.steps[0]))
    assert s1.dur_ns[1] == 3 * s0.dur_ns[1]  # the slow rank's compute


def test_messages_have_the_contract_key_order(nccl_trace):
    msg = parse_trace(nccl_trace(0), "kj", rank=None, node=None).steps[0]
    assert list(msg) == ["v", "job", "rank", "node", "local_rank", "step", "t_start_ns",
                         "t_end_ns", "ops"]


@pytest.mark.parametrize("doc, match", [
    ({"traceEvents": {}}, "no traceEvents list"),
    ({"traceEvents": []}, "ProfilerStep"),
])
def test_unusable_traces_say_why(doc, match):
    with pytest.raises(KinetoError, match=match):
        parse_trace(doc, "j", rank=0, node=None)


def test_the_rank_must_be_known(nccl_trace):
    doc = nccl_trace(0)
    del doc["distributedInfo"]
    with pytest.raises(KinetoError, match="rank is neither"):
        parse_trace(doc, "j", rank=None, node=None)


def test_a_gpus_kernels_are_one_op_per_stretch_between_transfers():
    """Kernels of 10 + 20 ms, an all-reduce, then 30 ms with a 5 ms launch gap inside: two
    `gpu_compute` ops where they ran, each its busy time. One op of 60 ms from the first
    kernel covered the all-reduce and hid the gap a host stall leaves."""
    ms = 1_000_000
    message = {"rank": 0, "node": "n0", "local_rank": 0, "step": 3, "t_start_ns": 0,
               "t_end_ns": 100 * ms,
               "ops": {"kind": ["compute", "compute", "coll", "compute", "compute"],
                       "name": ["fwd", "fwd", "all_reduce", "bwd", "bwd"],
                       "group": ["", "", "dp.0", "", ""],
                       "start_ns": [0, 10 * ms, 30 * ms, 40 * ms, 65 * ms],
                       "dur_ns": [10 * ms, 20 * ms, 10 * ms, 20 * ms, 10 * ms],
                       "bytes": [0, 0, 4096, 0, 0]}}
    [doc] = older_nccl_traces([message]).values()
    doc["distributedInfo"]["world_size"] = 2
    [step] = parse_trace(doc, "kj", rank=None, node=None).steps
    ops = step["ops"]
    compute = [(st, d) for n, st, d in zip(ops["name"], ops["start_ns"], ops["dur_ns"],
                                           strict=True) if n == "gpu_compute"]
    assert len(compute) == 2  # the traces' kernels end within µs of the message's
    for (start, busy), want in zip(compute, [(0, 30 * ms), (40 * ms, 30 * ms)], strict=True):
        assert (start, busy) == pytest.approx(want, abs=10_000)
