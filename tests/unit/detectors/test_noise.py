"""NoiseMemory: the σ each per-step value is measured against."""

from __future__ import annotations

import numpy as np

from detectors.noise import SMALL_GROUP, NoiseMemory
from detectors.segments import robust_sigma


def _feed(mem: NoiseMemory, rng: np.random.Generator, n: int, shift: float,
          steps: int = 10) -> np.ndarray:
    ids = np.arange(n)
    s = np.zeros(n)
    for _ in range(steps):
        v = rng.normal(0.0, 0.3, n)
        v[0] += shift
        s = mem.sigma_each("gpu", v, ids, 0.004)
    return s


def _pooled(mem: NoiseMemory) -> float:
    return robust_sigma(np.concatenate([v for v, _ in mem._hist["gpu"]]), 0.004)


def test_in_a_small_group_an_outlier_is_measured_against_its_peers_only():
    inflation = []
    for seed in range(10):
        mem = NoiseMemory()
        s = _feed(mem, np.random.default_rng(seed), 4, 2.0)
        inflation.append(_pooled(mem) / s[0])
        assert 2.0 / s[0] > 5, s  # its peers' spread: clearly significant
    # the outlier's quarter of the pool widens the pooled σ it would otherwise be judged by
    assert min(inflation) > 1.0 and float(np.median(inflation)) > 1.4, inflation


def test_in_a_clean_small_group_leaving_one_out_does_not_shrink_sigma():
    ratios = []
    for seed in range(50):
        mem = NoiseMemory()
        s = _feed(mem, np.random.default_rng(seed), 4, 0.0)
        ratios.extend(s / _pooled(mem))
    assert 0.9 < float(np.median(ratios)) < 1.15, np.median(ratios)


def test_a_large_group_uses_the_whole_pool():
    rng = np.random.default_rng(0)
    mem = NoiseMemory()
    s = _feed(mem, rng, SMALL_GROUP + 1, 2.0)
    assert np.all(s == _pooled(mem))


def test_a_value_without_enough_others_falls_back_to_the_pool():
    mem = NoiseMemory()
    s = mem.sigma_each("gpu", np.array([0.1, -0.1, 0.5]), np.array([0, 1, 2]), 0.004)
    assert np.all(s == robust_sigma(np.array([0.1, -0.1, 0.5]) - 0.1, 0.004))


def test_missing_values_are_left_out_and_get_a_sigma_anyway():
    mem = NoiseMemory()
    v = np.array([0.1, np.nan, -0.2, 0.05, 0.3])
    s = mem.sigma_each("gpu", v, np.arange(5), 0.004)
    assert s.shape == (5,) and np.all(np.isfinite(s)) and np.all(s >= 0.004)


def test_a_family_of_one_value_per_step_keeps_its_spread():
    # a lone rank (partial tracing) is the only member of its family each step: re-centring
    # one value on its own median would leave σ at the floor and make jitter look like a fault
    mem = NoiseMemory()
    rng = np.random.default_rng(3)
    for _ in range(10):
        s = mem.sigma("gpu_vs_stage", rng.normal(0.0, 0.03, 1), 0.004)
    assert s > 0.01


def test_a_slow_ranks_only_peer_is_its_mirror_and_left_out_of_its_spread():
    """Two stages of two ranks (one traced rank per node of a small job): measured against
    its stage's median of two, a slow rank sits at +d and its peer at -d. The peer's entries
    are the fault, not noise: with them the slow rank's σ is about twice the healthy one."""
    rng = np.random.default_rng(7)
    ids, partners = np.array([0, 2, 4, 6]), np.array([2, 0, 6, 4])
    alone, mirrored = NoiseMemory(), NoiseMemory()
    for _ in range(10):
        d = 0.5
        healthy = rng.normal(0.0, 0.08)
        v = np.array([-d, d, healthy, -healthy])
        s_alone = alone.sigma_each("gpu_vs_stage", v, ids, 0.004, partners)
        s_mirrored = mirrored.sigma_each("gpu_vs_stage", v, ids, 0.004)
    assert s_mirrored[1] > 1.8 * s_alone[1]  # the mirror about doubles the slow rank's σ


def test_a_lone_pair_is_judged_by_the_spread_its_pool_had_before_it_turned_slow():
    """One stage of two traced ranks and nothing else in the family: leaving out the rank
    and its mirror leaves nobody, and the whole pool is then theirs. Once one is slow its
    own residuals widen the σ it is judged by, step after step (a rank at a tenth of a core
    went from z 6 to 3 in three steps and was never confirmed). The pool's σ of `depth`
    steps ago holds none of them yet."""
    rng = np.random.default_rng(3)
    ids, partners = np.array([0, 2]), np.array([2, 0])
    memory = NoiseMemory(depth=10)
    for _ in range(20):  # healthy: the pair's own jitter
        e = rng.normal(0.0, 0.1)
        calm = memory.sigma_each("gpu_vs_stage", np.array([-e, e]), ids, 0.004, partners)
    z = []
    for _ in range(6):  # rank 2 at +0.55 from now on
        e = 0.55 + rng.normal(0.0, 0.05)
        s = memory.sigma_each("gpu_vs_stage", np.array([-e, e]), ids, 0.004, partners)
        z.append(e / s[1])
    assert s[1] <= 1.5 * calm[1] and min(z) > 4  # still significant after six steps
