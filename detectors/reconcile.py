"""One fault, one incident: which open incident already explains a newly confirmed candidate.

A slow GPU also makes its node look slow, its node's links look slow and, if it stops making
progress, its peers hang; a starved host looks like slow GPUs on that node. Every one of those
candidates is the same evidence seen from another entity. Paging once per entity would page an
SRE four times for one fault (issue #11), so a candidate whose entity is inside, or contains,
the entity of an open incident is evidence of that incident instead of a new one. Separate
incidents remain for separate places: another node, another switch.

>>> where = Placement(node_of_rank={3: "n0", 9: "n1"}, switch_of_node={"n0": "s0", "n1": "s0"})
>>> open_ = [("host", "node:n0")]
>>> covering(("gpu", "rank:3"), open_, where)    # a GPU on the starved host: same fault
('host', 'node:n0')
>>> covering(("gpu", "rank:9"), open_, where) is None  # another node: another fault
True
>>> covering(("link", "node:n1"), [("switch", "switch:s0")], where)  # under the bad switch
('switch', 'switch:s0')
>>> covering(("link", "link:n0~n2"), [("gpu", "rank:3")], where)  # the slow rank's sends
('gpu', 'rank:3')
>>> covering(("link", "link:n1~n2"), [("gpu", "rank:3")], where) is None  # not its link
True

A degraded NIC also slows links it is not on: the traffic it holds up backs into its peers'
queues (PFC pause frames in a RoCE fabric, TCP back-off on a shared path), and the ranks it
delays send their next transfers into that congestion. Such a link may turn slow on the very
step the NIC did, or many steps later, as queues and TCP back-off build up: a drill's NIC at
20 Mbit/s slowed a pipeline link between two other nodes 19 steps after its own onset, and
made typical in the replay that link still looked costly. Two independent network faults at
once are rare, and one page per fault matters more, so while a network incident is open, a
new network candidate is its spread: kept as a suspect of it (where an SRE may look too). If
it outlives the incident, it opens one of its own then.

>>> spread_of(("link", "link:n0~n2"), 60, {("link", "node:n1"): 27, ("switch", "switch:s1"): 55})
('switch', 'switch:s1')
>>> spread_of(("link", "link:n0~n2"), 60, {("gpu", "rank:3"): 27}) is None  # no network one
True
>>> spread_of(("gpu", "rank:3"), 27, {("link", "node:n1"): 27}) is None  # not the network
True

A pipeline link's transfers go through the NICs at its two ends. A NIC that slows for a
second or two (a flapping one) holds up, in one step, the all-reduces and transfers of every
kind through it, which names the NIC; and in the next, only the sends still queued behind it,
which name the link it sent them on: one burst, read as two suspects, each with half of the
evidence, and an incident on the link if the next burst goes the same way. So a link one of
whose ends' NIC was a suspect in the steps just before is that NIC seen again
(`nic_of`): its evidence counts for the NIC. Without such an end it stays the link.

>>> where = Placement(switch_of_node={"n0": "s0", "n1": "s0", "n2": "s1", "n3": "s1"})
>>> recent = {("node:n1", "link"): 6.2, ("node:n3", "link"): 2.9}
>>> nic_of("link:n1~n3", "link", recent, where, bar=2.5, far=16)  # n1's NIC, seen again
'node:n1'
>>> nic_of("link:n0~n2", "link", recent, where, bar=2.5, far=16)  # no end was a suspect
'link:n0~n2'

The same burst, when only a stage's all-reduces were in flight, slows every node under the
stage's leaf switch alike, and names the switch. A switch is read as one of its nodes' NIC
only when that NIC, or a pipeline link of which it is the one end under the switch, was far
beyond any noise just before (`far`): a congested switch slows all its nodes, and noise on
one of them must not take its evidence.

>>> nic_of("switch:s0", "switch", {("link:n0~n2", "link"): 38.0}, where, bar=2.5, far=16)
'node:n0'
>>> nic_of("switch:s0", "switch", {("node:n0", "link"): 9.0}, where, bar=2.5, far=16)
'switch:s0'

Once the NIC is found, the bursts its link and its switch were charged with before are its
own (`earlier_views`), and count for it.

>>> costly = [("link:n0~n2", "link"), ("switch:s0", "switch"), ("link:n1~n3", "link")]
>>> earlier_views("node:n0", 38.0, costly, {}, where, bar=2.5, far=16)
[('link:n0~n2', 'link'), ('switch:s0', 'switch')]
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

Key = tuple[str, str]  # (kind, entity), the incident book's key

NETWORK_KINDS = ("link", "switch")
_PROCESS_KINDS = ("gpu", "host", "node")  # a fault in the ranks' processes, not the network


def is_nic(entity: str, kind: str) -> bool:
    """Is this suspect a node's NIC (the `link` kind on a node), one entity, where a pipeline
    link has two ends a burst cannot tell apart and a switch has every node under it?"""
    return kind == "link" and entity.startswith("node:")


@dataclass(slots=True)
class Placement:
    """Where ranks and nodes sit, as far as the job's data has shown it."""

    node_of_rank: dict[int, str] = field(default_factory=dict)
    switch_of_node: dict[str, str] = field(default_factory=dict)

    def places(self, entity: str) -> set[str]:
        """The entity itself and every entity that contains it (rank → node → switch)."""
        out = {entity}
        node: str | None = None
        if entity.startswith("rank:"):
            rank = entity[5:]
            node = self.node_of_rank.get(int(rank)) if rank.isdigit() else None
        elif entity.startswith("node:"):
            node = entity[5:]
        elif entity.startswith("link:"):
            a, _, b = entity[5:].partition("~")
            out |= {f"node:{a}", f"node:{b}"}
            out |= {f"switch:{s}" for s in (self.switch_of_node.get(a),
                                             self.switch_of_node.get(b)) if s}
        if node is not None:
            out.add(f"node:{node}")
            switch = self.switch_of_node.get(node)
            if switch:
                out.add(f"switch:{switch}")
        return out


def covering(candidate: Key, open_keys: Iterable[Key], where: Placement) -> Key | None:
    """The open incident that explains `candidate`, if any.

    Two entities are the same fault when one contains the other (a rank and its node, a node
    and its switch, a link and its nodes). `job` and group-level hangs cover nothing: a
    job-wide shift is what remains when no device is to blame, and a communication hang names
    no device. A pipeline link is also covered by an open GPU, host or node incident at
    either of its ends: gloo, or NCCL's proxy thread, moves a rank's bytes on its CPU, and
    a drill's rank held to a tenth of a core sent ×50 slower on the link to its pipeline
    peer while its node partner's sends there were slow too, and the link opened beside it.
    """
    _, entity = candidate
    if entity == "job" or entity.startswith("group:"):
        return None
    mine = where.places(entity)
    ends = {p for p in mine if p.startswith("node:")} if entity.startswith("link:") else set()
    for key in open_keys:
        other = key[1]
        if other == "job" or other.startswith("group:"):
            continue
        if other in mine or entity in where.places(other):
            return key
        if ends and key[0] in _PROCESS_KINDS and ends & where.places(other):
            return key
    return None


def spread_of(candidate: Key, onset: int, open_onsets: Mapping[Key, int]) -> Key | None:
    """The open network incident that `candidate`, a network slowdown starting at `onset`,
    spreads from: of those open, the nearest in onset."""
    if candidate[0] not in NETWORK_KINDS:
        return None
    near = [(abs(onset - o), key) for key, o in open_onsets.items()
            if key[0] in NETWORK_KINDS and key != candidate]
    return min(near)[1] if near else None


def nic_of(entity: str, kind: str, recent: Mapping[tuple[str, str], float], where: Placement,
           bar: float, far: float) -> str:
    """The NIC a pipeline link's or a leaf switch's slowness belongs to (module doc), or the
    entity itself.

    `recent`: (entity, kind) → its highest recent z (`EvidenceTracker.peaks`: in the evidence
    window, or a costly step of the last 25). A link is its end whose NIC was a suspect at
    `bar` (the z that lists a suspect at all), the stronger if both were. A switch is the one
    node under it whose NIC was at `far`, or that is the one end under it of a link at `far`;
    with none, or several, it stays the switch."""
    if kind == "link" and entity.startswith("link:"):
        ends = [f"node:{n}" for n in entity[5:].split("~")]
        z, end = max((recent.get((e, "link"), 0.0), e) for e in ends)
        return end if z >= bar else entity
    if kind != "switch" or not entity.startswith("switch:"):
        return entity
    under = {n for n, s in where.switch_of_node.items() if f"switch:{s}" == entity}
    found: set[str] = set()
    for (ent, k), z in recent.items():
        if k != "link" or z < far or not ent.startswith(("node:", "link:")):
            continue
        inside = set(ent[5:].split("~")) & under
        if len(inside) == 1:
            found |= inside
    return f"node:{found.pop()}" if len(found) == 1 else entity


def earlier_views(nic: str, z: float, costly: Iterable[tuple[str, str]],
                  recent: Mapping[tuple[str, str], float], where: Placement, bar: float,
                  far: float) -> list[tuple[str, str]]:
    """Of the links and switches with costly steps (`costly`: (entity, kind) tracker keys),
    those that `nic` (a NIC significant at `z` this step) now shows were itself: `nic_of`
    reads them as it, with this step's significance added to `recent`."""
    now = dict(recent)
    now[(nic, "link")] = max(now.get((nic, "link"), 0.0), z)
    return [(e, k) for e, k in costly
            if e != nic and k in NETWORK_KINDS and e.startswith(("link:", "switch:"))
            and nic_of(e, k, now, where, bar, far) == nic]
