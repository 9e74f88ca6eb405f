"""How much work the worker does in one turn of its event loop.

The worker serves its API, its probes and its alerts from the loop that diagnoses, and an
HTTP request needs about fifteen turns of that loop to be answered (accept, read, the app,
a thread for a blocking route, the reply). A turn that diagnoses for 0.6 s makes `/readyz`
take nine seconds, long past an orchestrator's probe timeout. So the worker hands its loop
back after about `turn_s` of work, and sizes each pipeline call to fit: records per call
are learned from the calls so far (seconds per record, a moving average), because no fixed
count fits both a thousand 8-GPU jobs (a step diagnosed every eighth record) and one
16,384-GPU job (16,384 cheap records per step, then one long diagnosis that cannot be cut).

>>> t = TurnBudget(turn_s=0.02, most=2000)
>>> t.records()
100
>>> t.took(100, 0.5)  # 5 ms a record: a call of 4 records fills a turn
>>> t.records()
4
>>> for _ in range(20):
...     t.took(500, 0.0005)  # 1 µs a record
>>> t.records()
2000
"""

from __future__ import annotations

from dataclasses import dataclass

_START_RECORDS = 100  # before any call was timed
_WEIGHT = 0.3  # of the newest call in the moving average


@dataclass(slots=True)
class TurnBudget:
    """Records per pipeline call so that a call lasts about `turn_s` (at least one record,
    at most `most`)."""

    turn_s: float
    most: int
    per_record_s: float = 0.0  # moving average; 0 until a call was timed

    def records(self) -> int:
        if self.per_record_s <= 0.0:
            return min(_START_RECORDS, self.most)
        return max(1, min(self.most, int(self.turn_s / self.per_record_s)))

    def took(self, records: int, seconds: float) -> None:
        """A call handled `records` (read and released) in `seconds`."""
        if records <= 0 or seconds < 0.0:
            return
        each = seconds / records
        self.per_record_s = each if self.per_record_s <= 0.0 else (
            _WEIGHT * each + (1.0 - _WEIGHT) * self.per_record_s)

    def spent(self, started_s: float, now_s: float) -> bool:
        """Whether work begun at `started_s` has used its turn."""
        return now_s - started_s >= self.turn_s
