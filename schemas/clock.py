"""Time as an input: the clock types every component takes, and the one nanosecond unit.

Components never read the wall clock themselves; they are handed a clock (bytewax's habit),
so timeouts and pacing are tested with `schemas.testing.FakeClock` instead of sleeps.
Wire timestamps are integer nanoseconds (DESIGN §3); `NS_PER_S` converts them.

>>> NS_PER_S
1000000000
>>> int(2.5 * NS_PER_S)
2500000000
"""

from __future__ import annotations

from collections.abc import Callable

NS_PER_S = 1_000_000_000  # nanoseconds per second: wire timestamps are integer ns

NanoClock = Callable[[], int]  # e.g. time.time_ns: node clock stamps on the wire
SecondsClock = Callable[[], float]  # e.g. time.monotonic: local deadlines and pacing
