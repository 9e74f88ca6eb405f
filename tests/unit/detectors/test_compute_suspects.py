"""Compute suspects: a slow GPU or node stands out; a heavier data replica does not."""

from __future__ import annotations

from collections import Counter

import numpy as np

from detectors.candidates import Candidates
from detectors.compute_suspects import TwoStages, compute_ratio, compute_suspects
from detectors.evidence import EvidenceTracker
from detectors.features import step_features
from detectors.noise import NoiseMemory
from detectors.peers import stage_keys
from detectors.testing import frame_of, rank_step


def _job(steps: int, factor, seed: int = 0, slow_rank: int = -1, by: float = 3.0):
    """4 stages × 4 data replicas × tp 2: one node per (stage, replica), 2 ranks each.
    `factor(pp, dp)` multiplies that node's compute, and `by` that of `slow_rank`; 1%
    jitter."""
    rng = np.random.default_rng(seed)
    for s in range(steps):
        msgs = []
        for pp in range(4):
            for dp in range(4):
                for tp in range(2):
                    r = pp * 8 + dp * 2 + tp
                    c = 10.0 * factor(pp, dp) * (1 + 0.01 * rng.standard_normal())
                    c *= by if r == slow_rank else 1.0
                    msgs.append(rank_step(r, f"n{pp}-{dp}", s, [
                        ("compute", "fwd", "", 0, 0.0, c, 0),
                        ("coll", "all_reduce", f"tp.{pp}-{dp}", s, c, 1.0, 1 << 20)],
                        coords={"tp": tp, "pp": pp, "dp": dp}))
        yield frame_of(msgs)


def _nodes_flagged(factor, steps: int = 12) -> set[str]:
    """Nodes that are `node` suspects in most steps (a single step's suspects include noise:
    the evidence tracker, not one step, opens incidents)."""
    noise, hits = NoiseMemory(), Counter[str]()
    for frame in _job(steps, factor):
        feats = step_features(frame)
        out = Candidates()
        compute_suspects(frame, feats, compute_ratio(frame, feats, stage_keys(frame)),
                         noise, out)
        hits.update(e for e, k in zip(out.entity, out.kind, strict=True) if k == "node")
    return {e for e, n in hits.items() if n > steps // 2}


def test_a_slow_node_in_one_stage_is_a_node_suspect():
    assert _nodes_flagged(lambda pp, dp: 1.3 if (pp, dp) == (2, 1) else 1.0) == {"node:n2-1"}


def test_a_data_replica_heavier_in_every_stage_is_workload_not_a_node():
    # sequence lengths: replica 1 carries 30% more tokens through all four stages
    assert _nodes_flagged(lambda pp, dp: 1.3 if dp == 1 else 1.0) == set()


def test_one_slow_gpu_of_a_two_rank_node_is_that_gpu_not_its_node():
    """A node is slow when most of its ranks are: the median of a pair is its mean, and one
    GPU at 3× made its node look 2× slow (a throttled gloo rank opened a node incident)."""
    noise, gpu, node = NoiseMemory(), Counter[str](), Counter[str]()
    for frame in _job(12, lambda pp, dp: 1.0, slow_rank=18):  # rank 18 is on node n2-1
        feats = step_features(frame)
        out = Candidates()
        compute_suspects(frame, feats, compute_ratio(frame, feats, stage_keys(frame)),
                         noise, out)
        gpu.update(e for e, k in zip(out.entity, out.kind, strict=True) if k == "gpu")
        node.update(e for e, k in zip(out.entity, out.kind, strict=True) if k == "node")
    assert gpu["rank:18"] >= 10 and node["node:n2-1"] == 0


def test_the_partner_of_a_rank_that_got_fast_is_not_a_slow_gpu():
    """Rank 18 computes 5× faster (a drill's rank that got a core to itself) and waits for
    its TP partner: against the pair, rank 19 reads +80%, against its node and stage it is
    like every other rank. Neither is a slow GPU."""
    noise, gpu = NoiseMemory(), Counter[str]()
    for frame in _job(12, lambda pp, dp: 1.0, slow_rank=18, by=0.2):
        feats = step_features(frame)
        out = Candidates()
        compute_suspects(frame, feats, compute_ratio(frame, feats, stage_keys(frame)),
                         noise, out)
        gpu.update(e for e, k in zip(out.entity, out.kind, strict=True) if k == "gpu")
    # once in 12 steps is noise, as for healthy ranks (an incident needs 3 of 5); it was 12
    assert gpu["rank:19"] <= 1 and gpu["rank:18"] == 0


def _moe_frame(step: int, expert_ms: dict[int, float], dense_ms: dict[int, float]):
    """Eight ranks on four nodes, one stage: dense compute 10 ms, then an expert-parallel
    dispatch all-to-all, expert kernels (4 ms unless `expert_ms` says), and the combine."""
    msgs = []
    for r in range(8):
        dense, expert = dense_ms.get(r, 10.0), expert_ms.get(r, 4.0)
        msgs.append(rank_step(r, f"n{r // 2}", step, [
            ("compute", "fwd", "", 0, 0.0, dense, 0),
            ("coll", "all_to_all", "ep.0", 1, dense, 1.0, 1 << 20),
            ("compute", "expert", "", 1, dense + 1.0, expert, 0),
            ("coll", "all_to_all", "ep.0", 2, dense + 1.0 + expert, 1.0, 1 << 20)]))
    return frame_of(msgs)


def _gpu_suspects(frames) -> list[str]:
    noise = NoiseMemory()
    for frame in frames:
        feats = step_features(frame)
        out = Candidates()
        compute_suspects(frame, feats, compute_ratio(frame, feats, stage_keys(frame)), noise, out)
    return [e for e, k in zip(out.entity, out.kind, strict=True) if k == "gpu"]


def test_expert_kernels_loaded_by_routing_are_workload_not_a_slow_gpu():
    usual = [_moe_frame(s, {}, {}) for s in range(6)]
    # rank 5 got 3× the tokens: its expert kernels take 12 ms, its dense compute is usual
    assert _gpu_suspects(usual + [_moe_frame(6, {5: 12.0}, {})]) == []
    # a slow GPU slows its dense kernels too, and is named
    assert _gpu_suspects(usual + [_moe_frame(6, {5: 6.0}, {5: 15.0})]) == ["rank:5"]


def _two_stages(steps: int, slow_from: int | None, seed: int = 0):
    """2 stages × 4 data replicas × tp 4, two replicas' TP groups per node (8 GPUs), stage 1
    computing 1.3× by design; every step each replica draws its sequence lengths anew
    (σ = 0.2, the same through both stages), one replica carries 20% more throughout, 1%
    jitter per rank. From `slow_from` on, node n0-0 (stage 0, replicas 0 and 1) is ×1.3."""
    rng = np.random.default_rng(seed)
    for s in range(steps):
        data = np.exp(rng.normal(-0.02, 0.2, 4)) * np.array([1.0, 1.0, 1.2, 1.0])
        msgs = []
        for pp in range(2):
            for dp in range(4):
                for tp in range(4):
                    r = pp * 16 + dp * 4 + tp
                    c = 10.0 * (1.3 if pp else 1.0) * data[dp] * (1 + 0.01 * rng.standard_normal())
                    if slow_from is not None and s >= slow_from and pp == 0 and dp < 2:
                        c *= 1.3
                    msgs.append(rank_step(r, f"n{pp}-{dp // 2}", s, [
                        ("compute", "fwd", "", 0, 0.0, c, 0),
                        ("coll", "all_reduce", f"tp.{pp}-{dp}", s, c, 1.0, 1 << 20)],
                        coords={"tp": tp, "pp": pp, "dp": dp}))
        yield frame_of(msgs)


def _node_hits(frames, two_stages: TwoStages) -> list[set[str]]:
    noise, hits = NoiseMemory(), []
    for frame in frames:
        feats = step_features(frame)
        out = Candidates()
        compute_suspects(frame, feats, compute_ratio(frame, feats, stage_keys(frame)),
                         noise, out, stage_keys(frame), two_stages)
        hits.append({e for e, k in zip(out.entity, out.kind, strict=True) if k == "node"})
    return hits


def test_a_slow_node_of_a_two_stage_job_is_told_from_sequence_lengths():
    """Two stages: each node is half of its stage, so its stage's median is half slowed, and
    sequence lengths move the replicas ±20% step by step. Each rank is compared with its
    replica's ranks in the other stage (the same samples) less the stages' usual gap: the
    slow node stands out, and no node of the other stage takes half of it."""
    hits = _node_hits(_two_stages(31, slow_from=25), TwoStages())
    assert all("node:n0-0" in h for h in hits[25:])  # what the evidence tracker confirms
    assert all(h <= {"node:n0-0"} for h in hits)
    assert not any(hits[5:25])  # the replicas' sequence lengths alone: nothing


def test_without_their_usual_gap_a_two_stage_jobs_healthy_node_takes_half_the_blame():
    """The reason for the memory: judged by the step's own gap, which the slow node moved by
    half its slowness, the healthy node paired with it in the other stage reads as slow."""
    hits = _node_hits(_two_stages(11, slow_from=5), TwoStages(delay=10**6))
    assert sum("node:n1-1" in h for h in hits[5:]) >= 4


def _tp0_two_stages(steps: int, slow_gpu_from: int | None, seed: int = 0):
    """2 stages × 6 data replicas, one traced rank per tensor-parallel group (tp 0, two per
    node): each step every replica draws its data anew (σ = 3%, the same through both
    stages), and one replica computes 6% more for a stretch of steps (its longer sequences).
    From `slow_gpu_from` on, replica 4's traced GPU of stage 0 is ×1.15."""
    rng = np.random.default_rng(seed)
    for s in range(steps):
        data = np.exp(rng.normal(0.0, 0.03, 6))
        data[1] *= 1.06 if 10 <= s < 30 else 1.0
        msgs = []
        for pp in range(2):
            for dp in range(6):
                c = 10.0 * (1.3 if pp else 1.0) * data[dp] * (1 + 0.005 * rng.standard_normal())
                if slow_gpu_from is not None and s >= slow_gpu_from and pp == 0 and dp == 4:
                    c *= 1.15
                msgs.append(rank_step(pp * 24 + dp * 4, f"n{pp}-{dp // 2}", s, [
                    ("compute", "fwd", "", 0, 0.0, c, 0),
                    ("coll", "all_reduce", f"dp.{pp}", s, c, 1.0, 1 << 20)],
                    coords={"tp": 0, "pp": pp, "dp": dp}))
        yield frame_of(msgs)


def _confirmed_gpus(frames) -> set[str]:
    """The ranks the evidence tracker confirms as slow GPUs from the step's suspects."""
    noise, tracker, confirmed = NoiseMemory(), EvidenceTracker(), set()
    two_stages = TwoStages()
    for step, frame in enumerate(frames):
        feats = step_features(frame)
        out = Candidates()
        compute_suspects(frame, feats, compute_ratio(frame, feats, stage_keys(frame)),
                         noise, out, stage_keys(frame), two_stages)
        gpu = [i for i, k in enumerate(out.kind) if k == "gpu"]
        tracks = tracker.update(step, [out.entity[i] for i in gpu], ["gpu"] * len(gpu),
                                [out.z[i] for i in gpu], [0.0] * len(gpu), [""] * len(gpu))
        confirmed |= {t.entity for t in tracks}
    return confirmed


def test_a_replica_heavier_in_both_stages_is_its_data_not_its_traced_gpus():
    """One traced rank per tensor-parallel group in a two-stage job: a rank is judged against
    its stage, and a replica with longer sequences computes longer in both stages. What both
    stages of the replica show is its data; a slow GPU slows one stage only and is named."""
    for seed in range(4):
        assert not _confirmed_gpus(_tp0_two_stages(40, slow_gpu_from=None, seed=seed))
        assert _confirmed_gpus(_tp0_two_stages(40, slow_gpu_from=34, seed=seed)) == {"rank:16"}
