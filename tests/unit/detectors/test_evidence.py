"""Evidence tracking: confirm on strong evidence, stay live on any evidence (hysteresis)."""

from __future__ import annotations

from detectors.candidates import Z_REPORT
from detectors.evidence import NEED, Z_ON, EvidenceTracker


def _step(tr: EvidenceTracker, step: int, z: float | None,
          keep: frozenset[tuple[str, str]] = frozenset()) -> list[str]:
    """One step in which rank:2 is reported with significance z (None: not reported)."""
    ents = [] if z is None else ["rank:2"]
    zs = [] if z is None else [z]
    confirmed = tr.update(step, ents, ["gpu"] * len(ents), zs, [0.1] * len(ents),
                          ["compute ×4"] * len(ents), set(keep))
    return [t.entity for t in confirmed]


def test_a_suspect_is_confirmed_after_need_strong_steps_only():
    tr = EvidenceTracker()
    got = [_step(tr, s, Z_ON + 1) for s in range(NEED)]
    assert got[:-1] == [[]] * (NEED - 1) and got[-1] == ["rank:2"]
    weak = EvidenceTracker()
    assert not any(_step(weak, s, Z_ON - 0.5) for s in range(10)), \
        "evidence below z_on never confirms"


def test_weak_but_reported_steps_keep_the_track_live_and_absence_counts():
    tr = EvidenceTracker()
    for s in range(NEED):
        _step(tr, s, Z_ON + 1)
    track = tr.tracks[("rank:2", "gpu")]
    keep = frozenset({("rank:2", "gpu")})  # (entity, kind): an open incident's track
    for s in range(NEED, NEED + 8):
        _step(tr, s, (Z_ON + Z_REPORT) / 2, keep)
        assert track.absent == 0 and track.quiet == s - NEED + 1
    for k in range(1, 4):
        _step(tr, NEED + 8 + k, None, keep)
        assert track.absent == k
    _step(tr, 20, Z_REPORT)
    assert track.absent == 0 and track.excess_s == 0.1


def test_a_track_without_an_open_incident_is_dropped_once_quiet():
    tr = EvidenceTracker()
    for s in range(NEED):
        _step(tr, s, Z_ON + 1)
    for s in range(NEED, NEED + tr.window):
        _step(tr, s, None)
    assert ("rank:2", "gpu") not in tr.tracks
