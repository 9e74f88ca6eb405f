"""Evidence accumulated per suspect across steps: only what persists becomes an incident.

Noise moves (MoE imbalance, data-dependent jitter, a GC pause on one rank); faults stay. A
suspect is confirmed when it was significant in `need` of the last `window` steps including
the latest, which bounds detection latency to a few steps while a clean entity would need
several independent > z_on events in a row (each p ≲ 3e-5 for Gaussian noise at z_on = 4).

Confirming and clearing use different bars (hysteresis): a track is confirmed on z ≥ z_on,
but it stays live for an open incident as long as the entity is reported at all (every
reported suspect is already above the noise, `candidates.Z_REPORT`). Under heavy noise a
persistent fault's z wanders around z_on; one bar for both would resolve the incident and
open it again a few steps later, two pages for one fault.

A rank significant in three of the last five steps is confirmed on the third:

>>> t = EvidenceTracker()
>>> [len(t.update(s, ["rank:2"], ["gpu"], [6.0], [0.1], ["slow"])) for s in range(3)]
[0, 0, 1]
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from detectors.base import Stateful

WINDOW = 5  # steps of memory per suspect
NEED = 3  # significant steps among them that confirm it
Z_ON = 4.0  # significance that counts (one-sided Gaussian tail ≈ 3e-5)


@dataclass(slots=True)
class Track:
    """Recent evidence of one (entity, kind)."""

    entity: str
    kind: str
    z: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    steps: deque[int] = field(default_factory=lambda: deque(maxlen=WINDOW))
    excess_s: float = 0.0
    detail: str = ""
    quiet: int = 0  # steps since the last significant one (z ≥ z_on)
    absent: int = 0  # steps since the entity was last reported at all

    def hits(self, z_on: float) -> int:
        return sum(1 for v in self.z if v >= z_on)

    def first_hit_step(self, z_on: float) -> int:
        return next(s for v, s in zip(self.z, self.steps, strict=True) if v >= z_on)

    def mean_z(self) -> float:
        return sum(self.z) / max(len(self.z), 1)


class EvidenceTracker(Stateful):
    """Per-entity windows of significance; bounded: idle tracks are dropped."""

    def __init__(self, window: int = WINDOW, need: int = NEED, z_on: float = Z_ON) -> None:
        self.window = window
        self.need = need
        self.z_on = z_on
        self.tracks: dict[tuple[str, str], Track] = {}

    def update(
        self,
        step: int,
        entity: list[str],
        kind: list[str],
        z: list[float],
        excess_s: list[float],
        detail: list[str],
        keep: set[tuple[str, str]] = frozenset(),  # type: ignore[assignment]
    ) -> list[Track]:
        """Add one step of suspects; return the tracks confirmed at this step."""
        seen: set[tuple[str, str]] = set()
        for ent, kd, zz, ex, de in zip(entity, kind, z, excess_s, detail, strict=True):
            key = (ent, kd)
            if key in seen:
                continue
            seen.add(key)
            tr = self.tracks.get(key)
            if tr is None:
                tr = self.tracks[key] = Track(
                    ent, kd, deque(maxlen=self.window), deque(maxlen=self.window)
                )
            tr.z.append(zz)
            tr.steps.append(step)
            tr.absent = 0
            tr.excess_s = ex
            tr.detail = de
            if zz >= self.z_on:
                tr.quiet = 0
            else:
                tr.quiet += 1
        for key, tr in list(self.tracks.items()):
            if key in seen:
                continue
            tr.z.append(0.0)
            tr.steps.append(step)
            tr.quiet += 1
            tr.absent += 1
            if tr.quiet >= self.window and key not in keep:
                del self.tracks[key]
        return [
            tr for tr in self.tracks.values() if tr.quiet == 0 and tr.hits(self.z_on) >= self.need
        ]

    def ranked(self) -> list[Track]:
        """Tracks with any recent significance, strongest first."""
        live = [t for t in self.tracks.values() if t.hits(self.z_on) > 0]
        return sorted(live, key=lambda t: t.mean_z(), reverse=True)
