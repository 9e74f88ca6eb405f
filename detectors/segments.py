"""Segmented reductions over numpy arrays (per rank, per group, per instance) without Python
loops, and the robust spread every detector measures significance against.

Detectors reduce millions of ops per step to per-key statistics; a Python loop over keys
would cost more than the whole diagnosis, so every reduction here is one sort or one
`bincount` over all keys at once.

>>> keys = np.array([0, 1, 0, 1, 0])
>>> grouped_median(np.array([1.0, 10.0, 3.0, 30.0, 2.0]), keys, 3).tolist()
[2.0, 20.0, nan]
>>> round(robust_sigma(np.array([1.0, 1.1, 0.9, 1.0, 50.0]), floor=0.01), 4)  # 50 is ignored
0.1483
"""

from __future__ import annotations

import numpy as np

# σ of Gaussian data is MAD / Φ⁻¹(3/4) = 1.4826 · MAD: the constant that makes the median
# absolute deviation a consistent estimator of the standard deviation (Hampel 1974;
# Rousseeuw & Croux 1993, "Alternatives to the Median Absolute Deviation"), so robust z
# scores read like ordinary ones while one outlier cannot inflate the spread.
MAD_TO_SIGMA = 1.4826


def segment_starts(keys_sorted: np.ndarray) -> np.ndarray:
    """Start index of each run of equal keys in a sorted array.

    >>> segment_starts(np.array([3, 3, 5, 7, 7, 7])).tolist()
    [0, 2, 3]
    """
    if keys_sorted.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, keys_sorted[1:] != keys_sorted[:-1]])


def grouped_median(values: np.ndarray, keys: np.ndarray, n_keys: int) -> np.ndarray:
    """Median of `values` per integer key in [0, n_keys); NaN for empty keys."""
    return grouped_quantile(values, keys, n_keys, 0.5)


def grouped_quantile(values: np.ndarray, keys: np.ndarray, n_keys: int, q: float) -> np.ndarray:
    """Quantile q (linear interpolation, as `np.quantile`) of `values` per integer key; NaN
    for empty keys.

    >>> grouped_quantile(np.array([4.0, 1.0, 3.0, 2.0]), np.array([0, 0, 0, 0]), 1, 0.25)
    array([1.75])
    """
    out = np.full(n_keys, np.nan)
    if values.size == 0:
        return out
    order = np.lexsort((values, keys))
    k = keys[order]
    v = values[order]
    starts = segment_starts(k)
    ends = np.r_[starts[1:], k.size]
    pos = starts + q * (ends - starts - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.ceil(pos).astype(np.int64)
    frac = pos - lo
    out[k[starts]] = v[lo] * (1 - frac) + v[hi] * frac
    return out


def grouped_majority(values: np.ndarray, keys: np.ndarray, n_keys: int) -> np.ndarray:
    """Per integer key, the largest value that most of its values reach (NaN for empty keys).

    A node is slow when most of its ranks are: its median would let one rank of two (the
    median of a pair is its mean) or a loud minority speak for the node. With n values this
    is the ⌈n/2⌉-th smallest, so ⌊n/2⌋ + 1 of them are at least as large.

    >>> grouped_majority(np.array([1.0, 9.0, 2.0, 3.0, 9.0]), np.array([0, 0, 1, 1, 1]), 2)
    array([1., 3.])
    """
    out = np.full(n_keys, np.nan)
    if values.size == 0:
        return out
    order = np.lexsort((values, keys))
    k = keys[order]
    starts = segment_starts(k)
    ends = np.r_[starts[1:], k.size]
    out[k[starts]] = values[order][starts + (ends - starts + 1) // 2 - 1]
    return out


def robust_sigma(x: np.ndarray, floor: float) -> float:
    """`MAD_TO_SIGMA` × MAD of the finite values, at least `floor` (also the answer for fewer
    than three values, whose MAD says nothing)."""
    x = x[np.isfinite(x)]
    if x.size < 3:
        return floor
    med = np.median(x)
    return max(float(MAD_TO_SIGMA * np.median(np.abs(x - med))), floor)


def robust_sigma_rows(a: np.ndarray, floor: float) -> np.ndarray:
    """`robust_sigma` of each row of a 2-D array, NaN marking entries a row leaves out
    (every row needs at least one value).

    >>> robust_sigma_rows(np.array([[1.0, 2.0, 3.0], [1.0, np.nan, 3.0]]), 0.1).tolist()
    [1.4826, 1.4826]
    """
    med = np.nanmedian(a, axis=1, keepdims=True)
    return np.maximum(MAD_TO_SIGMA * np.nanmedian(np.abs(a - med), axis=1), floor)


def unique_ints(x: np.ndarray) -> np.ndarray:
    """Sorted unique values of an integer array (a plain sort: faster than hashing here).

    >>> unique_ints(np.array([5, 1, 5, 3, 1])).tolist()
    [1, 3, 5]
    """
    if x.size == 0:
        return x
    y = np.sort(x)
    return y[np.r_[True, y[1:] != y[:-1]]]


def int_codes(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique values of an integer array and the index of each element among them:
    what `np.unique(x, return_inverse=True)` gives, flat.

    A step's message sizes and instance kinds are a handful of distinct values over millions
    of instances: hashing them and one binary search per element is ~9× faster than the
    sort `np.unique` does. With many distinct values hashing is ~8× slower than the sort,
    so a sample of the array decides.

    >>> u, code = int_codes(np.array([5, 1, 5, 3, 1]))
    >>> u.tolist(), code.tolist()
    ([1, 3, 5], [2, 0, 2, 1, 0])
    """
    if x.size == 0:
        return x[:0].copy(), np.zeros(0, dtype=np.intp)
    sample = x[:: max(1, x.size // 1024)]
    if np.unique_values(sample).size * 32 > sample.size:
        u, inv = np.unique(x, return_inverse=True)
        return u, inv.reshape(-1)
    u = np.sort(np.unique_values(x))
    return u, np.searchsorted(u, x)
