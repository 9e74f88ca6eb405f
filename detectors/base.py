"""The contract of every stateful detector: fed in order, deterministic, copyable.

A detector that learns from what it is fed (the step assembler, the δ baseline, the noise
memory, the evidence tracker, the incident book, the hang detector, and the `JobDiagnoser`
that holds them all) promises four things, and `tests/unit/detectors/test_conformance.py`
checks each of them on every such class (river's habit: one contract per family, one suite
every member passes):

- the same inputs in the same order give the same outputs (no wall clock, no global state,
  no unseeded randomness: time is an input);
- inputs are read, never mutated (the worker hands the same frame to storage afterwards);
- `clone()` is an independent copy of the learned state: fed the rest of a sequence, the
  clone answers exactly as the original would;
- the state pickles, with the same guarantee (a worker can checkpoint or hand a job over).

>>> class Counter(Stateful):
...     def __init__(self) -> None:
...         self.n = 0
...     def update(self) -> int:
...         self.n += 1
...         return self.n
>>> a = Counter(); a.update()
1
>>> b = a.clone(); b.update(), a.update(), a.n
(2, 2, 2)
"""

from __future__ import annotations

import copy
from typing import Self


class Stateful:
    """Base of the stateful detectors: `clone()` copies the learned state, not just the
    parameters (unlike river's `clone`, which starts afresh), so a copy continues a job."""

    __slots__ = ()

    def clone(self) -> Self:
        """An independent deep copy: nothing it learns afterwards reaches the original."""
        return copy.deepcopy(self)
