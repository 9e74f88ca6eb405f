"""Recordings of real training with a real fault (`flare drill`), diagnosed as the worker would.

Each is what a drill's broker received: eight gloo ranks of a small tensor-, pipeline- and
data-parallel transformer on four network namespaces, with one rank per node running the hook
(`--traced tp0`, as production tracers often record only tensor-parallel rank 0), and one
rank's CPU held to a tenth of a core by a cgroup quota from step 27. Simulated jobs never
showed either failure below: they are large enough for every group to have stage peers, and
their traced ranks' residuals are never each other's mirror.
"""

from __future__ import annotations

from pathlib import Path

from flare.offline import diagnose_messages, recording_messages

DRILLS = Path(__file__).resolve().parents[2] / "data" / "drills"
ONSET = 27  # the first step wholly under the fault


def _device_incidents(name: str) -> list[tuple[int, str, str]]:
    res = diagnose_messages(recording_messages(str(DRILLS / name)))
    return sorted((i.opened_step, i.kind, i.culprit) for i in res.incidents.values()
                  if i.kind != "job")


def test_a_slow_rank_that_is_not_traced_is_named_by_its_node():
    """Rank 3 is not traced; rank 2, on its node, waits for it at every tensor-parallel
    all-reduce. With two nodes per stage there are no stage peers to compare the wait with:
    it was a "job-wide shift, no device to blame"."""
    [(opened, kind, culprit)] = _device_incidents("tp0-slow-untraced-rank3.jsonl.gz")
    assert (kind, culprit) == ("gpu", "node:node-1")
    assert ONSET - 1 <= opened <= ONSET + 3


def test_a_throttled_rank_is_one_incident_while_it_shows_through_its_host():
    """Rank 2 is its stage's only traced rank beside rank 0, whose residual mirrors its own
    and widened the noise: its evidence as a slow GPU faded after six steps while its node's
    host kept showing idle gaps every few steps. That opened a second incident, a second
    page for the one fault."""
    [(opened, kind, culprit)] = _device_incidents("tp0-throttled-rank2.jsonl.gz")
    assert (kind, culprit) == ("gpu", "rank:2")
    assert ONSET - 1 <= opened <= ONSET + 3
