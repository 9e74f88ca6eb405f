"""A run's own hosts: one network namespace per node, joined by a bridge in a hub namespace.

Real training across nodes needs real links between them, and a NIC fault needs a NIC of its
own to slow. Linux gives both without containers: each node is a network namespace with one
veth interface (`eth0`, its NIC) whose peer sits on a bridge in the hub namespace, which also
hosts the broker. Every address is in a private /24 of the run's choosing, so no packet ever
leaves the namespaces the run created; tearing the run down deletes them and with them every
interface and qdisc.

Names carry the run's tag so two drills on one machine, or a drill next to a leftover of a
crashed one, never touch each other's hosts.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType


class TestbedError(RuntimeError):
    """The namespaces could not be built (not root, no `ip`, a kernel without netns)."""


def _ip(*args: str) -> None:
    try:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise TestbedError("the `ip` tool (iproute2) is not installed") from None
    except subprocess.CalledProcessError as exc:
        raise TestbedError(f"ip {' '.join(args)}: {exc.stderr.strip()}") from None


@dataclass(frozen=True, slots=True)
class Host:
    """One host of the run: a node (or the hub) with its namespace, NIC and address."""

    name: str  # the node name Flare reports (node-0, ...) or "hub"
    netns: str
    address: str
    nic: str  # the interface inside `netns` that carries its traffic
    hub_side: str  # the veth end on the hub's bridge ("" for the hub itself)
    hub_netns: str = ""  # the namespace `hub_side` is in (the hub's)

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.netns, *argv]


@dataclass(slots=True)
class Testbed:
    """`nodes` hosts and a hub on one bridge; a context manager that removes them all.

    >>> bed = Testbed(tag="doc", nodes=2, subnet=77)  # nothing is created until entered
    >>> [h.address for h in bed.hosts], bed.hub.address
    (['10.77.0.10', '10.77.0.11'], '10.77.0.1')
    """

    tag: str
    nodes: int
    subnet: int = 77  # the run's /24 is 10.<subnet>.0.0/24
    hosts: list[Host] = field(init=False)
    hub: Host = field(init=False)
    _made: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 200 or not 1 <= self.subnet <= 254:
            raise ValueError("between 1 and 200 nodes, and a subnet of 1..254")
        net = f"10.{self.subnet}.0"
        self.hub = Host("hub", f"flare-{self.tag}-hub", f"{net}.1", "br0", "")
        self.hosts = [
            Host(f"node-{i}", f"flare-{self.tag}-n{i}", f"{net}.{10 + i}", "eth0",
                 f"v{self.tag[:6]}{i}", self.hub.netns)
            for i in range(self.nodes)
        ]

    def __enter__(self) -> Testbed:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _add_netns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        hub = self.hub
        self._add_netns(hub.netns)
        _ip("-n", hub.netns, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub.netns, "addr", "add", f"{hub.address}/24", "dev", "br0")
        _ip("-n", hub.netns, "link", "set", "br0", "up")
        for h in self.hosts:
            self._add_netns(h.netns)
            # create the pair inside the hub, then move the node's end into its namespace:
            # nothing is ever created in the namespace the drill was started from
            _ip("-n", hub.netns, "link", "add", h.hub_side, "type", "veth", "peer", "name",
                h.nic, "netns", h.netns)
            _ip("-n", hub.netns, "link", "set", h.hub_side, "master", "br0")
            _ip("-n", hub.netns, "link", "set", h.hub_side, "up")
            _ip("-n", h.netns, "addr", "add", f"{h.address}/24", "dev", h.nic)
            _ip("-n", h.netns, "link", "set", h.nic, "up")

    def close(self) -> None:
        """Delete every namespace this run made (their interfaces and qdiscs go with them)."""
        while self._made:
            name = self._made.pop()
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def leftovers(tag_prefix: str = "flare-") -> list[str]:
    """Namespaces of earlier runs still present (a crashed drill), for a clear error."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in out.stdout.splitlines()
            if line.startswith(tag_prefix)]
