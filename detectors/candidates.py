"""Candidates: the suspects one step produced, as parallel lists every view appends to.

The compute, host and network views each add (entity, kind, z, excess seconds, detail) for
what stands out in this step; `evidence.EvidenceTracker` then keeps only what persists.
`Z_REPORT` is the bar for being listed at all, `Z_CAP` bounds what one step can weigh.

>>> c = Candidates()
>>> c.add("rank:3", "gpu", 120.0, 0.25, "compute ×1.50 vs stage peers")
>>> c.entity, c.z
(['rank:3'], [50.0])
"""

from __future__ import annotations

from dataclasses import dataclass, field

# One-sided Gaussian tail at 2.5σ is ≈0.6%: frequent enough in noise that a single step never
# opens an incident (evidence.Z_ON and NEED do), rare enough to keep the candidate lists short.
Z_REPORT = 2.5
# A huge z is one step's word, not proof: capped so one extreme step (a GC on one rank, a
# clock jump) cannot outweigh several ordinary ones in a track's mean significance.
Z_CAP = 50.0


@dataclass(slots=True)
class Candidates:
    """Suspects of one step: parallel lists, one entry per (entity, kind)."""

    entity: list[str] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)
    z: list[float] = field(default_factory=list)
    excess_s: list[float] = field(default_factory=list)
    detail: list[str] = field(default_factory=list)

    def add(self, entity: str, kind: str, z: float, excess_s: float, detail: str = "") -> None:
        self.entity.append(entity)
        self.kind.append(kind)
        self.z.append(float(min(z, Z_CAP)))
        self.excess_s.append(float(excess_s))
        self.detail.append(detail)
