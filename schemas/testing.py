"""The one fake clock of the code base: it moves only when a test says so.

Every component that waits, paces or times out takes a clock (`schemas.clock`); tests hand
it this one. It answers in nanoseconds (`clock()` or `clock.ns()`, for `NanoClock` users) and
in seconds (`clock.seconds()`, for `SecondsClock` users), both from the same instant.

>>> clock = FakeClock(start_ns=0)
>>> clock.advance(1.5)
>>> clock(), clock.seconds()
(1500000000, 1.5)
>>> clock.sleep(0.25)   # a paced loop "sleeps": time moves, the sleep is recorded
>>> clock.sleeps, clock.seconds()
([0.25], 1.75)
"""

from __future__ import annotations

from schemas.clock import NS_PER_S


class FakeClock:
    """A settable clock: `advance()` moves it, `sleep()` moves it and records the sleep."""

    def __init__(self, start_ns: int = 1_700_000_000 * NS_PER_S) -> None:
        self.t_ns = int(start_ns)
        self.sleeps: list[float] = []

    def ns(self) -> int:
        return self.t_ns

    __call__ = ns

    def seconds(self) -> float:
        return self.t_ns / NS_PER_S

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        self.t_ns += round(seconds * NS_PER_S)

    def advance_ns(self, ns: int) -> None:
        if ns < 0:
            raise ValueError(f"a clock does not go back ({ns} ns)")
        self.t_ns += ns

    def set_ns(self, t_ns: int) -> None:
        """Jump to an absolute instant (forward only)."""
        self.advance_ns(t_ns - self.t_ns)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.advance(max(seconds, 0.0))
