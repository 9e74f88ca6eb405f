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

An intermittent fault (a flapping NIC, a link that drops and recovers) is significant in one
step of several and never three of five. What sets it apart from noise is what it costs over
`LONG_WINDOW` steps: its significant steps together lose the job at least a whole usual step
(`step_s`), and they are several (`LONG_MIN_HITS`). Each counts when it costs a quarter of a
step (`MATERIAL_SHARE`; noise that reaches z_on costs a few percent), or a tenth at twice the
significance (a NIC at half speed is far beyond any jitter, and costs little per step). Two
steps that each at least doubled the step also confirm: a NIC that flaps for seconds stalls
the steps it touches many times over, but touches one in five or ten. So do several steps
at `EXTREME` × z_on that each cost a fortieth of a step (`TRACE_SHARE`): the suspect's own
excess over its peers, which in a large job is far more than the job loses (at 1,024 GPUs
a NIC at half speed one step in six adds 0.3 s to its transfers and 3% to that step; the
rule above would need seven such steps in 25), and in a job of two nodes all it loses (the
link between them at half speed costs 6% of the steps it bites). Noise reaches z_on; a
significance four times as high on the same entity, again and again, is no jitter (no
suspect of the simulator's clean runs reaches it once); a fortieth of a step is the floor
that keeps a trifle from paging. One costly step alone never does (a GC pause, a slow
batch), with one exception: a NIC far beyond noise whose one step cost the job `LONE_STALL`
usual steps (the step doubled: what each of two steps must cost anything else). A NIC is
one entity, its transfers stalled that long are no jitter, and a NIC flapping for seconds
may burst again only several steps later (the drills' 2 s on, 2 s off at 0.4-0.8 s steps:
each on-phase stalls one step, the next comes 4-5 steps later). A pipeline link's or a
switch's one burst cannot tell which NIC it was, and a GPU's or a host's may be a GC pause:
those wait for a second.

For a NIC, a link or a switch, twice z_on (`STRONG`) is that far already (`far_bar`). Their
significance is the mean over all their transfers in the step, and a burst stalls only those
in flight: over half a step it reads half what a whole step's does (a NIC at half speed,
z 14 where 23). Neither a clean run of the simulator nor a drill's recording before its
fault has an entity at twice z_on in more than one step of 25.

The tests hold the rule to 2,000 steps of ×1.4-per-σ jitter on four ranks; the simulator's
clean runs hold it to no false incident.

>>> t = EvidenceTracker()
>>> hit = lambda s, ex: t.update(s, ["node:a"], ["link"], [9.0], [ex], ["slow"], step_s=1.0)
>>> quiet = lambda s: t.update(s, [], [], [], [], [], step_s=1.0)
>>> [s for s in range(20) if (hit(s, 0.3) if s % 4 == 0 else quiet(s))]  # four of 0.3
[12, 16]
>>> t = EvidenceTracker()  # as significant, but each costs little: noise, never confirmed
>>> gpu = lambda s, ex: t.update(s, ["rank:3"], ["gpu"], [9.0], [ex], ["slow"], step_s=1.0)
>>> any(gpu(s, 0.05) if s % 4 == 0 else quiet(s) for s in range(40))
False
>>> t = EvidenceTracker()  # two steps in five, 6% of a step each, at z 9: never
>>> any(gpu(s, 0.06) if s % 5 < 2 else quiet(s) for s in range(30))
False
>>> t = EvidenceTracker()  # the same at z 20, far beyond any noise: the fourth confirms
>>> far = lambda s, ex: t.update(s, ["rank:3"], ["gpu"], [20.0], [ex], ["slow"], step_s=1.0)
>>> [s for s in range(30) if (far(s, 0.06) if s % 5 < 2 else quiet(s))][:1]
[6]
>>> t = EvidenceTracker()  # a NIC at z 9: far for a network entity, so the fourth confirms
>>> [s for s in range(30) if (hit(s, 0.06) if s % 5 < 2 else quiet(s))][:1]
[6]
>>> t = EvidenceTracker()  # a GPU stalling the job 1.5 steps, once in 8: the second confirms
>>> [s for s in range(20) if (far(s, 1.5) if s % 8 == 0 else quiet(s))]
[8, 16]
>>> t = EvidenceTracker()  # a NIC's one burst that doubled the step: the first
>>> [s for s in range(20) if (hit(s, 1.0) if s % 8 == 0 else quiet(s))]
[0, 8, 16]
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from detectors.base import Stateful
from detectors.reconcile import NETWORK_KINDS, is_nic

WINDOW = 5  # steps of memory per suspect
NEED = 3  # significant steps among them that confirm it
Z_ON = 4.0  # significance that counts (one-sided Gaussian tail ≈ 3e-5)
LONG_WINDOW = 25  # steps within which an intermittent fault's costly steps are counted
LONG_MIN_HITS = 4  # costly significant steps within LONG_WINDOW, together costing a step,
MATERIAL_SHARE = 0.25  # each at least this share of a step at z_on ...
MINOR_SHARE = 0.1  # ... or this share at STRONG × z_on; or two steps that doubled the step
STRONG = 2.0
EXTREME = 4.0  # LONG_MIN_HITS costly steps at this × z_on confirm whatever they cost together
LONE_STALL = 1.0  # usual steps one NIC's step far beyond noise must cost to confirm it
TRACE_SHARE = 0.025  # ... and cost at this × z_on counts from this share of a step


def far_bar(kind: str) -> float:
    """The multiple of z_on that is far beyond any noise for a suspect of this kind: STRONG
    for a network entity, whose z a burst over part of a step dilutes (module doc)."""
    return STRONG if kind in NETWORK_KINDS else EXTREME


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
    intermittent: bool = False  # confirmed by its costly steps, not by NEED of WINDOW

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
        # per (entity, kind): (step, share of a step it cost, z) of its costly significant
        # steps, kept LONG_WINDOW steps (a track is dropped after `window` quiet steps; these
        # are not)
        self.costly: dict[tuple[str, str], deque[tuple[int, float, float]]] = {}

    def update(
        self,
        step: int,
        entity: list[str],
        kind: list[str],
        z: list[float],
        excess_s: list[float],
        detail: list[str],
        keep: set[tuple[str, str]] = frozenset(),  # type: ignore[assignment]
        step_s: float = float("inf"),
    ) -> list[Track]:
        """Add one step of suspects; return the tracks confirmed at this step.

        `step_s`: the job's usual step time, against which the cost of a significant step is
        weighed for an intermittent fault (see the module doc); inf: no intermittent path.
        """
        seen: set[tuple[str, str]] = set()
        intermittent: list[Track] = []
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
                far = far_bar(kd)
                floor = (MATERIAL_SHARE if zz < STRONG * self.z_on else
                         MINOR_SHARE if zz < far * self.z_on else TRACE_SHARE)
                if ex >= floor * step_s:
                    costly = self.costly.setdefault(key, deque(maxlen=LONG_WINDOW))
                    costly.append((step, ex / step_s, zz))
                    recent = [(c, v / self.z_on) for s, c, v in costly if step - s < LONG_WINDOW]
                    if _intermittent(recent, far, lone=is_nic(ent, kd)):
                        intermittent.append(tr)
            else:
                tr.quiet += 1
        for key in [k for k, c in self.costly.items() if step - c[-1][0] >= LONG_WINDOW]:
            del self.costly[key]
        for key, tr in list(self.tracks.items()):
            if key in seen:
                continue
            tr.z.append(0.0)
            tr.steps.append(step)
            tr.quiet += 1
            tr.absent += 1
            if tr.quiet >= self.window and key not in keep:
                del self.tracks[key]
        confirmed = [
            tr for tr in self.tracks.values() if tr.quiet == 0 and tr.hits(self.z_on) >= self.need
        ]
        for tr in intermittent:
            tr.intermittent = tr not in confirmed
        return confirmed + [tr for tr in intermittent if tr not in confirmed]

    def peaks(self) -> dict[tuple[str, str], float]:
        """(entity, kind) → the highest z of each live track in its window, or of its costly
        significant steps within `LONG_WINDOW` (an intermittent fault's, which come several
        steps apart)."""
        out = {key: max(tr.z, default=0.0) for key, tr in self.tracks.items()}
        for key, hits in self.costly.items():
            out[key] = max(out.get(key, 0.0), max(z for _, _, z in hits))
        return out

    def absorb(self, into: tuple[str, str], other: tuple[str, str]) -> None:
        """Credit `other`'s costly significant steps to `into` ((entity, kind) keys): the same
        fault, first seen from another entity (a flapping NIC's bursts named by its link or
        its switch until a burst named the NIC). Of two in one step, the costlier counts."""
        moved = self.costly.pop(other, None)
        if not moved:
            return
        by_step: dict[int, tuple[int, float, float]] = {}
        for hit in [*moved, *self.costly.get(into, ())]:
            if hit[0] not in by_step or hit[1] > by_step[hit[0]][1]:
                by_step[hit[0]] = hit
        self.costly[into] = deque(sorted(by_step.values()), maxlen=LONG_WINDOW)

    def burst_share(self, entity: str, kind: str) -> float:
        """The mean share of a usual step that the suspect's costly significant steps cost
        (0 without any): what each burst of an intermittent fault costs the job."""
        hits = self.costly.get((entity, kind))
        return sum(c for _, c, _ in hits) / len(hits) if hits else 0.0

    def ranked(self) -> list[Track]:
        """Tracks with any recent significance, strongest first."""
        live = [t for t in self.tracks.values() if t.hits(self.z_on) > 0]
        return sorted(live, key=lambda t: t.mean_z(), reverse=True)


def _intermittent(hits: list[tuple[float, float]], far: float, lone: bool = False) -> bool:
    """Do these costly significant steps of one suspect (each the share of a usual step it
    cost, and its z over z_on) confirm an intermittent fault? Several that together cost a
    whole step, several far beyond any noise, two that each doubled the step, or (`lone`: a
    NIC) one far beyond noise that cost `LONE_STALL` steps."""
    costs = [c for c, _ in hits]
    if len(costs) >= LONG_MIN_HITS and sum(min(c, 1.0) for c in costs) >= 1.0:
        return True
    if sum(z >= far for _, z in hits) >= LONG_MIN_HITS:
        return True
    if lone and any(c >= LONE_STALL and z >= far for c, z in hits):
        return True
    return sum(c >= 1.0 for c in costs) >= 2
