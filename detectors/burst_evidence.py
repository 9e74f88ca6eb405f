"""What a burst weighs as evidence: the step's lost seconds charged to the network entity that
carried them, in the step itself and in the step after it.

A flapping NIC's burst stalls the step it hits many times over, while the transfers a step
sees slow may be a small part of it: a buffered send returns at once and its transfer shows
only in the receiver's wait. The strongest significant network suspect of a step that at
least doubled (`network_suspects.burst_of`) is charged what the step lost (`evidence`: two
such steps confirm an intermittent fault). Only the network's: a checkpoint or an eval step
doubles a step too, and is some rank's time, never a transfer's. And only when no GPU, node
or host significant in the step shows half of what it lost as its own excess: a throttled
rank doubles the steps it slows, and a pipeline link that waited on it, barely significant
(z 5.7 behind the rank's 15.7), took those steps as bursts and opened beside it in a drill.

A burst outlasts its step. On real training the stall of a pipeline's transfers falls
across a step's end, and the step after it doubles too while the pipeline drains, with no
transfer of its own slow (a drill's NIC stalled 1.1 s in step 41, and step 42 took 1.25 s
against 0.34 s with no suspect at all). Such a step is the same burst's tail: it is charged
to the entity that carried the step before, at that entity's significance. It takes a step
that doubled right after a step whose stall a network entity carried, and nothing of its
own to blame (no network suspect, and no device suspect that shows half of it); a GC
pause or a checkpoint doubles one step, not the one after a network stall.

>>> cands = Candidates()
>>> cands.add("node:n0", "link", 12.0, 0.3, "transfers ×90")
>>> charged, carrier = charged_excess(cands, ["node:n0"], ["link"], Burst(10.0, 1.1), 4.0)
>>> charged, carrier.entity
([1.1], 'node:n0')
>>> tail = burst_tail(Candidates(), Burst(10.0, 0.9), carrier, 4.0)
>>> tail.entity, tail.z, tail.excess_s
('node:n0', 12.0, 0.9)
>>> burst_tail(Candidates(), None, carrier, 4.0) is None  # the step did not double
True
>>> cands.add("rank:5", "gpu", 15.0, 0.7, "compute ×6")  # a throttled rank shows most of it
>>> charged_excess(cands, ["node:n0", "rank:5"], ["link", "gpu"], Burst(10.0, 1.1), 4.0)[1]
"""

from __future__ import annotations

from dataclasses import dataclass

from detectors.candidates import Candidates
from detectors.network_suspects import Burst
from detectors.reconcile import NETWORK_KINDS


@dataclass(frozen=True, slots=True)
class Carried:
    """A network entity charged with a burst: as the evidence tracker keys it (a link read as
    the NIC it points at), its significance, the seconds charged, and what was seen of it."""

    entity: str
    kind: str
    z: float
    excess_s: float
    detail: str


def charged_excess(
    cands: Candidates, entity: list[str], kind: list[str], burst: Burst | None, z_on: float
) -> tuple[list[float], Carried | None]:
    """Each suspect's excess as its evidence weighs it (`entity`, `kind`: the suspects as the
    tracker keys them), and what this step's burst charged to the network entity that
    carried it (None without a burst or without a significant network suspect)."""
    out = list(cands.excess_s)
    net = _significant_network(cands, z_on)
    if burst is None or not net or _a_device_explains(cands, burst, z_on):
        return out, None
    top = max(net, key=lambda i: cands.z[i])
    out[top] = max(out[top], burst.lost_s)
    return out, Carried(entity[top], kind[top], cands.z[top], out[top], cands.detail[top])


def burst_tail(
    cands: Candidates, burst: Burst | None, carrier: Carried | None, z_on: float
) -> Carried | None:
    """This step's lost seconds charged to the step before's burst carrier, when this step
    doubled too with nothing of its own to blame; else None."""
    if (burst is None or carrier is None or _significant_network(cands, z_on)
            or _a_device_explains(cands, burst, z_on)):
        return None
    return Carried(carrier.entity, carrier.kind, carrier.z, burst.lost_s, carrier.detail)


def _a_device_explains(cands: Candidates, burst: Burst, z_on: float) -> bool:
    """A significant GPU, node or host suspect shows half the step's lost seconds or more as
    its own excess: the step doubled on its account."""
    return any(k not in NETWORK_KINDS and z >= z_on and x >= burst.lost_s / 2
               for k, z, x in zip(cands.kind, cands.z, cands.excess_s, strict=True))


def _significant_network(cands: Candidates, z_on: float) -> list[int]:
    return [i for i, (k, z) in enumerate(zip(cands.kind, cands.z, strict=True))
            if k in NETWORK_KINDS and z >= z_on]
