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


def _burst(t: EvidenceTracker, step: int, excess_s: float, entity: str = "node:a",
           kind: str = "link") -> list:
    return t.update(step, [entity], [kind], [9.0], [excess_s], ["slow"], step_s=1.0)


def _quiet(t: EvidenceTracker, step: int) -> list:
    return t.update(step, [], [], [], [], [], step_s=1.0)


def _confirmed(bursts: dict[int, float], steps: int, entity: str = "node:a",
               kind: str = "link") -> list[int]:
    t = EvidenceTracker()
    return [s for s in range(steps)
            if (_burst(t, s, bursts[s], entity, kind) if s in bursts else _quiet(t, s))]


def test_bursts_that_each_stall_the_job_a_whole_step_confirm_on_the_second():
    # a pipeline link flapping for seconds: one step in seven is twice as long or more
    assert _confirmed({s: 1.5 for s in range(0, 40, 7)}, 40, "link:a~b")[0] == 7
    t = EvidenceTracker()
    _burst(t, 0, 1.5, "link:a~b")
    (tr,) = _burst(t, 7, 1.5, "link:a~b")
    assert tr.intermittent


def test_one_burst_of_a_nic_that_doubles_the_step_confirms_at_once():
    """A NIC far beyond noise whose one step cost the job a usual step (the step doubled) is
    paged at that step: a drill's flapping NIC, 2 s on and 2 s off with steps of 0.4-0.8 s,
    stalls one step per on-phase and bursts again only 4-5 steps later. A GPU's or a host's
    such step may be a GC pause or a slow batch, and a pipeline link's or a switch's one burst
    cannot tell which NIC it was: those wait for a second."""
    from detectors.evidence import LONE_STALL, STRONG

    assert _confirmed({5: LONE_STALL}, 40) == [5]
    assert _confirmed({5: LONE_STALL * 0.9}, 40) == []
    assert _confirmed({5: 5.0}, 40, "rank:3", "gpu") == []
    assert _confirmed({5: 5.0}, 40, "rank:3", "host") == []
    assert _confirmed({5: 5.0}, 40, "link:a~b", "link") == []
    assert _confirmed({5: 5.0}, 40, "switch:s0", "switch") == []
    t = EvidenceTracker()  # significant, but not far beyond noise: one step is not enough
    assert t.update(5, ["node:a"], ["link"], [STRONG * Z_ON - 0.5], [5.0], ["slow"],
                    step_s=1.0) == []


def test_small_frequent_bursts_confirm_once_they_cost_a_whole_step_together():
    # a GPU that stalls two steps in eight: 0.2 of a step each, at z 9
    bursts = {s: 0.2 for s in range(40) if s % 8 in (0, 1)}
    assert _confirmed(bursts, 40, "rank:3", "gpu")[0] == 16  # 0, 1, 8, 9, 16: a whole step
    # the same bursts spread further apart never cost a step within the window
    assert _confirmed({s: 0.2 for s in range(0, 200, 9)}, 200, "rank:3", "gpu") == []
    # a NIC's, at z 9, is far beyond any noise for a network entity: the fourth confirms
    assert _confirmed(bursts, 40)[0] == 9


def test_extreme_bursts_confirm_though_together_they_cost_less_than_a_step():
    """A NIC at half speed one step in six in a 1,024-GPU job: its transfers take 0.05 of a
    step more, far beyond any jitter, but five such steps within LONG_WINDOW cost under a
    step. Four of them confirm it: at z 20, and at z 9 too, which a burst over part of a
    step dilutes a NIC's z to (`far_bar`). A GPU's z 9, as often, never does; its z 20
    does."""
    from detectors.evidence import EXTREME, LONG_MIN_HITS, STRONG

    def confirmed(z: float, entity: str = "node:a", kind: str = "link") -> list[int]:
        t = EvidenceTracker()
        return [s for s in range(60) if (
            t.update(s, [entity], [kind], [z], [0.05], ["slow"], step_s=1.0) if s % 6 == 0
            else _quiet(t, s))]

    fourth = 6 * (LONG_MIN_HITS - 1)
    assert confirmed(EXTREME * Z_ON + 4.0)[0] == fourth
    assert confirmed(STRONG * Z_ON + 1.0)[0] == fourth
    assert confirmed(STRONG * Z_ON - 1.0) == []
    assert confirmed(STRONG * Z_ON + 1.0, "rank:3", "gpu") == []
    assert confirmed(EXTREME * Z_ON + 4.0, "rank:3", "gpu")[0] == fourth


def test_one_costly_step_or_cheap_ones_never_confirm():
    assert _confirmed({5: 5.0}, 40, "rank:3", "gpu") == []  # one long pause: a GC, a batch
    assert _confirmed({5: 0.95, 30: 0.95, 55: 0.95}, 80) == []  # each far from the next
    assert _confirmed({s: 0.09 for s in range(0, 40, 3)}, 40, "rank:3", "gpu") == []  # cheap
    assert _confirmed({s: 0.02 for s in range(0, 40, 3)}, 40) == []  # under TRACE_SHARE
    assert _confirmed({3: 0.6, 9: 0.6}, 40) == []  # two, neither doubled the step
    # a persistent fault is confirmed the usual way, and is no intermittent one
    t = EvidenceTracker()
    (tr,) = [tr for s in range(3) for tr in _burst(t, s, 0.5)]
    assert not tr.intermittent


def test_an_intermittent_incident_outlasts_the_quiet_between_its_bursts():
    from detectors.evidence import LONG_WINDOW
    from detectors.incidents import IncidentBook

    book = IncidentBook("j", resolve_after=10)
    steady = book.open_incident("gpu", "rank:1", [], 0, 0, 0, "slow")
    flapping = book.open_incident("link", "node:a", [], 0, 0, 0, "flaps")
    flapping.resolve_after = LONG_WINDOW
    resolved = {s: [i.culprit for i in book.quiet_step(set(), s)] for s in range(1, 30)}
    assert resolved[10] == ["rank:1"] and resolved[LONG_WINDOW] == ["node:a"]
    assert steady.resolved_step == 10 and flapping.resolved_step == LONG_WINDOW


def test_a_burst_is_remembered_as_a_recent_suspect_until_the_long_window_is_over():
    """A NIC's burst at step 0 (z 9, a whole step lost) and quiet after: its track is dropped
    after the window, but a burst on its pipeline link 10 steps later must still find it a
    recent suspect (`reconcile.nic_of`), and 25 steps later no more."""
    t = EvidenceTracker()
    _burst(t, 0, 1.0)
    for s in range(1, 11):
        _quiet(t, s)
    assert ("node:a", "link") not in t.tracks
    assert t.peaks()[("node:a", "link")] == 9.0
    for s in range(11, 26):
        _quiet(t, s)
    assert ("node:a", "link") not in t.peaks()


def test_a_nic_takes_the_costly_steps_its_link_was_charged_with_before_it_was_found():
    """Two bursts read as a pipeline link, then one as the NIC at its end: the link's costly
    steps become the NIC's (`absorb`), and with a fourth burst the NIC is confirmed, where
    apart neither entity ever gathered the four an intermittent fault needs."""
    t = EvidenceTracker()
    far = 20.0
    for s, ent in ((0, "link:a~b"), (6, "link:a~b"), (12, "node:a")):
        t.update(s, [ent], ["link"], [far], [0.3], ["slow"], step_s=1.0)
    t.absorb(("node:a", "link"), ("link:a~b", "link"))
    assert [s for s, _, _ in t.costly[("node:a", "link")]] == [0, 6, 12]
    assert ("link:a~b", "link") not in t.costly
    confirmed = t.update(18, ["node:a"], ["link"], [far], [0.3], ["slow"], step_s=1.0)
    assert [c.entity for c in confirmed] == ["node:a"]


def test_absorbing_keeps_one_hit_per_step_the_costlier():
    t = EvidenceTracker()
    t.update(3, ["link:a~b", "node:a"], ["link", "link"], [20.0, 20.0], [0.5, 0.2], ["", ""],
             step_s=1.0)
    t.absorb(("node:a", "link"), ("link:a~b", "link"))
    assert list(t.costly[("node:a", "link")]) == [(3, 0.5, 20.0)]
