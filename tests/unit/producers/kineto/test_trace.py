"""One rank's trace to its steps messages: steps, kernel durations, sizes, groups, seqs."""

from __future__ import annotations

import orjson
import pytest

from producers.kineto.trace import KinetoError, parse_trace
from schemas.decode import decode_steps


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
