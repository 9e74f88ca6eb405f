"""`FLARE_STEPS_ENCODING=v2`: steps leave as `flare.steps.v2`, whatever the producer handed
over, everything else as it was; a step that cannot be encoded leaves as v1 for the worker
to refuse with its reason."""

from __future__ import annotations

import orjson
import pytest

from producers.publisher import BinaryStepsPublisher, ShardingPublisher, for_steps
from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus
from producers.testing import MemoryPublisher
from schemas.decode import decode_steps
from schemas.steps_v2 import decode_steps_v2
from schemas.topics import HEARTBEATS, JOBS, STEPS, STEPS_V2


def _events() -> list[tuple[str, str, dict, int]]:
    sc = Scenario(job="enc", layout=layout_for_gpus(16), steps=2, seed=1,
                  fault=Fault("nic", 3.0, 1))
    return list(ClusterSimulator(sc).events())


def test_steps_as_dicts_or_v1_bytes_leave_as_v2_and_the_rest_unchanged():
    inner = MemoryPublisher()
    pub = BinaryStepsPublisher(inner)
    events = _events()
    for i, (topic, key, value, _ts) in enumerate(events):
        pub.publish(topic, key, orjson.dumps(value) if i % 2 else value)
    assert [t for t, _k, _v in inner.messages] == [
        STEPS_V2 if t == STEPS else t for t, _k, _v, _ts in events]
    assert pub.fallbacks == 0
    for (topic, key, value, _ts), (_t, k, v) in zip(events, inner.messages, strict=True):
        assert k == key.encode()
        if topic == STEPS:
            a, b = decode_steps(orjson.dumps(value)), decode_steps_v2(v)
            assert (a.rank, a.step, list(a.name), a.start_ns.tolist(), a.coords) == (
                b.rank, b.step, list(b.name), b.start_ns.tolist(), b.coords)
        else:
            assert orjson.loads(v) == value
    assert {t for t, *_ in events} >= {JOBS, HEARTBEATS, STEPS}


@pytest.mark.parametrize("bad", [
    b'{"v":1,"job":"j","rank":"x"}',
    b"not json",
    {"v": 1, "job": "j", "rank": 0, "node": "n", "step": 0, "t_start_ns": 0, "t_end_ns": 1,
     "ops": {"kind": ["warp"], "name": ["x"], "group": [""], "seq": [0], "start_ns": [0],
             "dur_ns": [1], "bytes": [0]}},
])
def test_a_step_it_cannot_encode_leaves_as_v1_as_it_was_and_is_counted(bad):
    inner = MemoryPublisher()
    pub = BinaryStepsPublisher(inner)
    pub.publish(STEPS, "j", bad)
    [(topic, _key, value)] = inner.messages
    assert topic == STEPS and pub.fallbacks == 1
    assert value == (bad if isinstance(bad, bytes) else orjson.dumps(bad))


def test_the_settings_pick_the_wrapper_and_refuse_v2_for_a_split_job():
    inner = MemoryPublisher()
    assert for_steps(inner, shard_ranks=0, partitions=8, encoding="v1") is inner
    assert isinstance(for_steps(inner, shard_ranks=0, partitions=8, encoding="v2"),
                      BinaryStepsPublisher)
    assert isinstance(for_steps(inner, shard_ranks=8, partitions=8, encoding="v1"),
                      ShardingPublisher)
    with pytest.raises(ValueError, match="flare.shardsteps.v1 carries v1 steps"):
        for_steps(inner, shard_ranks=8, partitions=8, encoding="v2")
