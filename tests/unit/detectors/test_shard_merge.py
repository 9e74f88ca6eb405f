"""Two stages give what one gives: shards assembled apart, sent as partial frames, merged.

Stage 1 is played here as one `StepAssembler` per shard fed that shard's ranks' messages;
each frame it emits crosses the wire encoding (`schemas.partial_frame`) and reaches the
job's `JobDiagnoser.on_partial`. The job's frames and incidents must be the ones the same
messages give through one assembler.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import orjson
import pytest

from detectors.assembly import StepAssembler
from detectors.diagnoser import JobDiagnoser
from detectors.shard_merge import ShardMerger
from detectors.testing import rank_step
from producers.simulator import ClusterSimulator, Fault, Noise, Scenario, layout_for_gpus
from schemas import InvalidMessage
from schemas.frame import StepFrame
from schemas.partial_frame import (
    GONE,
    PartialFrame,
    decode_partial,
    encode_partial,
    encode_watermark,
)
from schemas.rankstep import RankStep
from schemas.report import DiagnoserOutput
from schemas.steps_decoder import StepsDecoder
from streams.routing import decode_input, feed


def _messages(sc: Scenario) -> list:
    """The scenario's stream, decoded as the worker decodes it."""
    decoder = StepsDecoder()
    return [decode_input(topic, orjson.dumps(value), decoder)
            for topic, _, value, _ in ClusterSimulator(sc).events()]


def _recording(d: JobDiagnoser) -> list[StepFrame]:
    frames: list[StepFrame] = []
    on_frame = d.on_frame

    def keep(frame: StepFrame) -> DiagnoserOutput:
        frames.append(frame)
        return on_frame(frame)

    d.on_frame = keep  # type: ignore[method-assign]
    return frames


def _one_stage(job: str, msgs: list) -> tuple[list[StepFrame], list]:
    d = JobDiagnoser(job)
    frames = _recording(d)
    out = [feed(d, m) for m in msgs] + [d.flush()]
    return frames, [i for o in out for i in o.incidents]


def _two_stages(job: str, msgs: list, shard_ranks: int) -> tuple[list[StepFrame], list]:
    d = JobDiagnoser(job)
    frames = _recording(d)
    shards: dict[int, StepAssembler] = {}
    out = []
    stream_ns = 0

    def send(shard: int, done: list[StepFrame]) -> None:
        for f in done:
            raw = encode_partial(f, shard=shard, shard_ranks=shard_ranks)
            out.append(d.on_partial(decode_partial(raw)))

    for m in msgs:
        if isinstance(m, RankStep):
            stream_ns = max(stream_ns, m.t_end_ns)
            shard = m.rank // shard_ranks
            asm = shards.setdefault(shard, StepAssembler(job))
            send(shard, asm.add(m, stream_ns))
        else:
            out.append(feed(d, m))
    for shard in sorted(shards):
        send(shard, shards[shard].flush())
    out.append(d.flush())
    return frames, [i for o in out for i in o.incidents]


def _same_frame(a: StepFrame, b: StepFrame) -> None:
    for f in fields(StepFrame):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype, f.name
            np.testing.assert_array_equal(x, y, err_msg=f"{f.name} of step {a.step}")
        else:
            assert x == y, f.name


def _scenario(family: str, severity: float, gpus: int, **kw) -> Scenario:
    return Scenario(job=f"s-{family}", layout=layout_for_gpus(gpus), steps=kw.pop("steps", 30),
                    seed=kw.pop("seed", 3), fault=Fault(family, severity, 12), **kw)


@pytest.mark.parametrize(("sc", "shard_ranks"), [
    (_scenario("slow_gpu", 1.4, 64, heartbeats=False), 16),
    (_scenario("rank_stall", 1.5, 32, traced="half", heartbeats=False,
               noise=Noise(gc_every=7, rank_gc_prob=0.1), seed=4), 8),
    (_scenario("nic", 2.0, 64, traced="tp0", heartbeats=False), 24),
    (_scenario("hang_rank", 1.0, 16, steps=20), 4),
], ids=["slow_gpu", "rank_stall-half-gc", "nic-tp0-uneven", "hang_rank"])
def test_two_stages_give_the_frames_and_incidents_of_one(sc, shard_ranks):
    msgs = _messages(sc)
    one_frames, one_incidents = _one_stage(sc.job, msgs)
    two_frames, two_incidents = _two_stages(sc.job, msgs, shard_ranks)
    assert [f.step for f in two_frames] == [f.step for f in one_frames]
    for a, b in zip(one_frames, two_frames, strict=True):
        _same_frame(a, b)
    assert any(i.kind != "job" for i in one_incidents)
    assert two_incidents == one_incidents


def test_stalls_and_ops_out_of_order_merge_as_one_assembler_gives_them():
    t0 = 10**18
    fwd, bwd = ("compute", "fwd", "", 0, 0.0, 10.0, 0), ("compute", "bwd", "", 2, 14.0, 20.0, 0)
    gc = ("compute", "host:gc", "", 1, 10.0, 4.0, 0)
    ar = ("coll", "all_reduce", "dp.0", 3, 34.0, 2.0, 64)
    by_rank = {0: [fwd, bwd, ar], 1: [bwd, fwd, gc, ar], 2: [ar, fwd], 3: [fwd, gc, bwd, ar],
               4: [fwd, ("coll", "all_gather", "tp.1", 4, 10.0, 1.0, 8)], 5: [gc]}
    msgs = [rank_step(r, f"n{r // 3}", 0, ops, t0_ns=t0) for r, ops in by_rank.items()]
    one = StepAssembler("j")
    for m in msgs:
        one.add(m, t0)
    [want] = one.flush()
    assert want.stall_rank.size == 3 and want.names.index("host:gc") == 3
    merger = ShardMerger("j")
    for shard in (1, 0):  # shards arrive in any order
        asm = StepAssembler("j")
        for m in msgs[shard * 3:shard * 3 + 3][::-1]:
            asm.add(m, t0)
        raw = encode_partial(asm.flush()[0], shard=shard, shard_ranks=3)
        merger.add_partial(decode_partial(raw), t0)
    [got] = merger.flush()
    _same_frame(want, got)


def test_a_shard_that_never_reports_leaves_its_ranks_missing():
    t0 = 10**18
    ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0), ("coll", "all_reduce", "dp.0", 1, 10.0, 2.0, 8)]

    def part(shard: int, step: int) -> PartialFrame:
        asm = StepAssembler("j")
        for r in (2 * shard, 2 * shard + 1):
            asm.add(rank_step(r, "n0", step, ops, t0_ns=t0 + step * 10**9), t0)
        return PartialFrame(shard, 2, asm.flush()[0])

    merger = ShardMerger("j", grace_s=1.0)
    merger.world_size = 6
    assert merger.add_partial(part(0, 0), t0) == merger.add_partial(part(1, 0), t0) == []
    [step0] = merger.add_partial(part(2, 0), t0)  # every shard of the world's 6 ranks
    assert step0.missing.tolist() == []
    assert merger.add_partial(part(0, 1), t0) == []
    assert merger.add_partial(part(2, 1), t0) == []  # shard 1 is late: the step waits
    [step1] = merger.advance(t0 + 2 * 10**9)  # its grace is over
    assert step1.rank.tolist() == [0, 1, 4, 5] and step1.missing.tolist() == [2, 3]


def test_a_job_takes_ranks_messages_or_shards_frames_not_both():
    t0 = 10**18

    def frame(job: str) -> StepFrame:
        asm = StepAssembler(job)
        asm.add(rank_step(1, "n0", 0, [("compute", "fwd", "", 0, 0.0, 5.0, 0)], t0_ns=t0), t0)
        return asm.flush()[0]

    by_ranks = JobDiagnoser("j")
    by_ranks.on_steps(rank_step(0, "n0", 0, [("compute", "fwd", "", 0, 0.0, 5.0, 0)], t0_ns=t0))
    with pytest.raises(InvalidMessage, match="assembled from its ranks"):
        by_ranks.on_partial(PartialFrame(0, 2, frame("j")))
    by_shards = JobDiagnoser("k")
    by_shards.on_partial(PartialFrame(0, 2, frame("k")))
    with pytest.raises(InvalidMessage, match="merged from its shards"):
        by_shards.on_steps(rank_step(0, "n0", 1, [], t0_ns=t0))


def _part(shard: int, step: int, mark_ns: int, ranks_per_shard: int = 2) -> PartialFrame:
    t0 = 10**18
    ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0)]
    asm = StepAssembler("j")
    for r in range(shard * ranks_per_shard, (shard + 1) * ranks_per_shard):
        asm.add(rank_step(r, "n0", step, ops, t0_ns=t0 + step * 10**9), t0)
    return PartialFrame(shard, ranks_per_shard, asm.flush()[0], mark_ns)


def _mark(shard: int, mark_ns: int) -> PartialFrame:
    return decode_partial(encode_watermark("j", shard=shard, shard_ranks=2, watermark_ns=mark_ns))


def test_a_shard_whose_stage_one_lags_is_waited_for_until_its_watermark_passes():
    t0 = 10**18
    merger = ShardMerger("j", grace_s=1.0)
    merger.world_size = 4
    assert merger.add_partial(_part(0, 0, t0), t0) == []
    assert merger.add_partial(_mark(1, t0), t0) == []  # shard 1 read up to t0, step 0 on its way
    # shard 0 runs far ahead: by its clock step 0's grace is long over, but shard 1's mark is not
    for step in range(1, 6):
        assert merger.add_partial(_part(0, step, t0 + step * 10**9), t0 + step * 10**9) == []
    assert merger.advance(t0 + 10 * 10**9) == []
    [step0] = merger.add_partial(_part(1, 0, t0 + 10**8), t0 + 6 * 10**9)
    assert step0.rank.tolist() == [0, 1, 2, 3] and step0.missing.size == 0


def test_a_silent_shard_is_missing_once_its_watermark_passes_the_grace():
    t0 = 10**18
    merger = ShardMerger("j", grace_s=1.0)
    merger.world_size = 4
    merger.add_partial(_part(1, 0, t0), t0)
    merger.add_partial(_part(0, 0, t0), t0)
    merger.add_partial(_part(0, 1, t0 + 10**9), t0 + 10**9)  # shard 1's ranks fall silent
    assert merger.add_partial(_mark(1, t0 + int(1.5e9)), t0 + 10**9) == []  # within the grace
    assert merger.add_partial(_mark(0, t0 + 3 * 10**9), t0 + 3 * 10**9) == []  # 1 holds it
    [step1] = merger.add_partial(_mark(1, t0 + 3 * 10**9), t0 + 3 * 10**9)
    assert step1.rank.tolist() == [0, 1] and step1.missing.tolist() == [2, 3]


def test_a_shard_never_heard_from_is_given_up_after_the_pending_bound_and_gone_ends_a_wait():
    t0 = 10**18
    merger = ShardMerger("j", grace_s=1.0, max_pending=3)
    merger.world_size = 4  # shard 1 is in the world but none of its ranks is traced
    out = []
    for step in range(3):
        out += merger.add_partial(_part(0, step, t0 + step * 10**9), t0 + step * 10**9)
    assert out == [] and merger.absent == set()  # it may be a shard whose stage 1 lags
    for step in range(3, 5):
        out += merger.add_partial(_part(0, step, t0 + step * 10**9), t0 + step * 10**9)
    assert merger.absent == {1}  # held past the bound: nothing of it is traced
    assert [f.step for f in out] == [0, 1, 2, 3, 4]
    assert all(f.rank.tolist() == [0, 1] for f in out)

    other = ShardMerger("j", grace_s=1.0)
    other.world_size = 4
    other.add_partial(_part(0, 0, t0 + 10**10), t0)
    other.add_partial(_mark(1, t0), t0)
    assert other.advance(t0 + 10**10) == []  # shard 1's stage 1 still holds its step
    [step0] = other.add_partial(_mark(1, GONE), t0 + 10**10)  # ... until it lets the shard go
    assert step0.rank.tolist() == [0, 1]


def test_a_shard_step_sent_again_in_part_keeps_the_fuller_frame():
    t0 = 10**18
    ops = [("compute", "fwd", "", 0, 0.0, 10.0, 0)]
    merger = ShardMerger("j")
    merger.world_size = 6
    merger.add_partial(_part(1, 0, t0, ranks_per_shard=3), t0)
    again = StepAssembler("j")  # a restarted stage 1 re-read only rank 3 of the step
    again.add(rank_step(3, "n0", 0, ops, t0_ns=t0), t0)
    assert merger.add_partial(PartialFrame(1, 3, again.flush()[0], t0), t0) == []
    [step0] = merger.add_partial(_part(0, 0, t0, ranks_per_shard=3), t0)
    assert step0.rank.tolist() == [0, 1, 2, 3, 4, 5]
