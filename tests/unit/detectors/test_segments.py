"""Integer codes: the same answer as `np.unique(..., return_inverse=True)` on either path."""

from __future__ import annotations

import numpy as np
import pytest

from detectors.segments import int_codes


@pytest.mark.parametrize("distinct", [1, 7, 5_000, 10**12])
def test_codes_equal_numpys_unique_whichever_path_the_sample_picks(distinct: int) -> None:
    x = np.random.default_rng(distinct % 97).integers(-distinct, distinct + 1, 20_000)
    u, code = int_codes(x)
    ref_u, ref_code = np.unique(x, return_inverse=True)
    assert np.array_equal(u, ref_u) and np.array_equal(code, ref_code.reshape(-1))
    assert np.array_equal(u[code], x)


def test_an_empty_array_has_no_codes() -> None:
    u, code = int_codes(np.zeros(0, dtype=np.int64))
    assert u.size == 0 and code.size == 0
