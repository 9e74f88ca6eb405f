"""Which leaf switch each node hangs off, for the job's start event: switch incidents need it.

A congested switch slows every node under it, and only the node → switch map turns "these
nodes' transfers are slow" into "switch s3". The simulator sends that map; a real agent must
find it where clusters keep it. Rank 0's agent puts the map in the job's `start` event
(`nodes`, wire v1), read from the first of:
- `FLARE_TOPOLOGY`: the map inline, `node-0=leaf-0,node-1=leaf-0` (a Kubernetes DaemonSet can
  build it from node labels, or an SRE can pass it by hand);
- `--topology FILE` (`FLARE_TOPOLOGY_FILE`): JSON (`{"node": "switch"}` or a list of
  `{"node", "switch"}` objects) or Slurm's `topology.conf`;
- `/etc/slurm/topology.conf`, when it exists: Slurm keeps the same file on every node.

In `topology.conf` the leaf switches are the lines that list `Nodes=`; their node lists use
Slurm's host-list syntax, whose ranges are expanded here:

>>> leaf = parse_slurm("SwitchName=s0 Nodes=gpu[01-03]\\nSwitchName=s1 Nodes=gpu[04,06-07],login1"
...                    "\\nSwitchName=spine Switches=s[0-1]")
>>> sorted(leaf) == ["gpu01", "gpu02", "gpu03", "gpu04", "gpu06", "gpu07", "login1"]
True
>>> leaf["gpu03"], leaf["gpu06"], leaf["login1"]
('s0', 's1', 's1')
>>> parse_inline("a=s0, b=s1")
{'a': 's0', 'b': 's1'}
"""

from __future__ import annotations

import re
from pathlib import Path

import orjson

SLURM_TOPOLOGY = Path("/etc/slurm/topology.conf")
MAX_NODES = 100_000  # a map larger than any cluster is a wrong file, not a topology


class TopologyError(ValueError):
    """The topology could not be read: says which source and why."""


def expand_hostlist(text: str) -> list[str]:
    """Slurm's host list (`gpu[01-04,07],login1`) as host names, in order."""
    out: list[str] = []
    for item in re.findall(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", text):
        item = item.strip()
        if not item:
            continue
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if m is None:
            out.append(item)
            continue
        prefix, ranges, rest = m.groups()
        for tail in expand_hostlist(rest) if "[" in rest else [rest]:
            for part in ranges.split(","):
                lo, _, hi = part.partition("-")
                if not lo.isdigit() or (hi and not hi.isdigit()):
                    raise TopologyError(f"bad host range {part!r} in {item!r}")
                width = len(lo)
                for n in range(int(lo), int(hi or lo) + 1):
                    out.append(f"{prefix}{n:0{width}d}{tail}")
                    if len(out) > MAX_NODES:
                        raise TopologyError(f"host list {item!r} names over {MAX_NODES} hosts")
    return out


def parse_slurm(text: str) -> dict[str, str]:
    """Node → leaf switch from a Slurm `topology.conf` (tree plugin) text."""
    out: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        switch, nodes = fields.get("SwitchName"), fields.get("Nodes")
        if switch and nodes:
            for node in expand_hostlist(nodes):
                out[node] = switch
    return out


def parse_inline(text: str) -> dict[str, str]:
    """Node → switch from `node=switch` pairs separated by commas."""
    out: dict[str, str] = {}
    for pair in text.split(","):
        if not pair.strip():
            continue
        node, sep, switch = pair.partition("=")
        if not sep or not node.strip() or not switch.strip():
            raise TopologyError(f"FLARE_TOPOLOGY: {pair.strip()!r} is not node=switch")
        out[node.strip()] = switch.strip()
    return out


def parse_json(data: bytes) -> dict[str, str]:
    """Node → switch from `{"node": "switch"}` or `[{"node": ..., "switch": ...}]`."""
    obj = orjson.loads(data)
    if isinstance(obj, dict) and all(isinstance(v, str) for v in obj.values()):
        return {str(k): v for k, v in obj.items()}
    if isinstance(obj, list) and all(
        isinstance(e, dict) and isinstance(e.get("node"), str) and isinstance(e.get("switch"), str)
        for e in obj
    ):
        return {e["node"]: e["switch"] for e in obj}
    raise TopologyError('JSON topology must be {"node": "switch"} or [{"node", "switch"}]')


def read_file(path: Path) -> dict[str, str]:
    """A topology file: JSON when it parses as JSON, else Slurm's `topology.conf`."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TopologyError(f"cannot read {path}: {exc.strerror}") from None
    if data.lstrip()[:1] in (b"{", b"["):
        try:
            return parse_json(data)
        except orjson.JSONDecodeError as exc:
            raise TopologyError(f"{path}: not JSON ({exc})") from None
    try:
        return parse_slurm(data.decode())
    except UnicodeDecodeError:
        raise TopologyError(f"{path}: neither JSON nor a Slurm topology.conf") from None


def load_topology(inline: str = "", path: Path | None = None,
                  slurm: Path = SLURM_TOPOLOGY) -> dict[str, str]:
    """The node → switch map from the first source that has one (module docstring): `inline`
    pairs, the file at `path`, Slurm's file; empty when none does. A source that exists but
    is wrong raises TopologyError: a silently empty map would only show later, as a switch
    fault nobody can name."""
    if inline.strip():
        found = parse_inline(inline)
    elif path is not None:
        found = read_file(path)
    elif slurm.exists():
        found = read_file(slurm)
    else:
        return {}
    if len(found) > MAX_NODES:
        raise TopologyError(f"the topology names {len(found)} nodes, over {MAX_NODES}")
    return found
