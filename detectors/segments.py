"""Segmented reductions over sorted numpy arrays (per rank, per instance) without Python loops."""

from __future__ import annotations

import numpy as np


def segment_starts(keys_sorted: np.ndarray) -> np.ndarray:
    """Start index of each run of equal keys in a sorted array."""
    if keys_sorted.size == 0:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.r_[True, keys_sorted[1:] != keys_sorted[:-1]])


def grouped_median(values: np.ndarray, keys: np.ndarray, n_keys: int) -> np.ndarray:
    """Median of `values` per integer key in [0, n_keys); NaN for empty keys."""
    return grouped_quantile(values, keys, n_keys, 0.5)


def grouped_quantile(values: np.ndarray, keys: np.ndarray, n_keys: int, q: float) -> np.ndarray:
    """Quantile q (linear interpolation) of `values` per integer key; NaN for empty keys."""
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


def robust_sigma(x: np.ndarray, floor: float) -> float:
    """1.4826 × MAD, the Gaussian-consistent spread that one outlier cannot inflate."""
    x = x[np.isfinite(x)]
    if x.size < 3:
        return floor
    med = np.median(x)
    return max(float(1.4826 * np.median(np.abs(x - med))), floor)


def robust_sigma_rows(a: np.ndarray, floor: float) -> np.ndarray:
    """`robust_sigma` of each row of a 2-D array, NaN marking entries a row leaves out
    (every row needs at least one value)."""
    med = np.nanmedian(a, axis=1, keepdims=True)
    return np.maximum(1.4826 * np.nanmedian(np.abs(a - med), axis=1), floor)


def unique_ints(x: np.ndarray) -> np.ndarray:
    """Sorted unique values of an integer array (a plain sort: faster than hashing here)."""
    if x.size == 0:
        return x
    y = np.sort(x)
    return y[np.r_[True, y[1:] != y[:-1]]]
