"""The node → switch map an agent finds: inline, a JSON or Slurm file, Slurm's default."""

from __future__ import annotations

from pathlib import Path

import pytest

from producers.agent.topology import (
    TopologyError,
    expand_hostlist,
    load_topology,
    parse_slurm,
)


@pytest.mark.parametrize(("text", "hosts"), [
    ("gpu01", ["gpu01"]),
    ("gpu[1-3]", ["gpu1", "gpu2", "gpu3"]),
    ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),  # zero padding is kept
    ("a[1,3-4],b", ["a1", "a3", "a4", "b"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("x[2-3]y", ["x2y", "x3y"]),
])
def test_slurm_host_lists_expand_as_slurm_does(text: str, hosts: list[str]) -> None:
    assert sorted(expand_hostlist(text)) == sorted(hosts)


def test_a_bad_range_is_an_error_that_names_it() -> None:
    with pytest.raises(TopologyError, match="bad host range 'a-b'"):
        expand_hostlist("gpu[a-b]")


def test_slurm_topology_keeps_leaf_switches_and_skips_comments() -> None:
    conf = """# the fabric
SwitchName=leaf0 Nodes=gpu[01-02] LinkSpeed=400
SwitchName=leaf1 Nodes=gpu03   # one node
SwitchName=spine Switches=leaf[0-1]
"""
    assert parse_slurm(conf) == {"gpu01": "leaf0", "gpu02": "leaf0", "gpu03": "leaf1"}


def test_the_first_source_that_has_a_map_wins(tmp_path: Path) -> None:
    slurm = tmp_path / "topology.conf"
    slurm.write_text("SwitchName=s9 Nodes=n[1-2]\n")
    as_json = tmp_path / "topo.json"
    as_json.write_text('[{"node": "n1", "switch": "j0"}]')
    as_dict = tmp_path / "topo2.json"
    as_dict.write_text('{"n1": "k0", "n2": "k1"}')
    assert load_topology("n1=i0", as_json, slurm) == {"n1": "i0"}
    assert load_topology("", as_json, slurm) == {"n1": "j0"}
    assert load_topology("", as_dict, slurm) == {"n1": "k0", "n2": "k1"}
    assert load_topology("", None, slurm) == {"n1": "s9", "n2": "s9"}
    assert load_topology("", None, tmp_path / "absent.conf") == {}  # nothing to send


@pytest.mark.parametrize(("inline", "content", "says"), [
    ("n1", None, "'n1' is not node=switch"),
    ("", '{"n1": 3}', "JSON topology must be"),
    ("", "[{", "not JSON"),
    ("", "\xff\xfe", "neither JSON nor"),
])
def test_a_source_that_exists_but_is_wrong_says_so(tmp_path: Path, inline: str,
                                                   content: str | None, says: str) -> None:
    path = None
    if content is not None:
        path = tmp_path / "t"
        path.write_bytes(content.encode("latin-1"))
    with pytest.raises(TopologyError, match=says):
        load_topology(inline, path, tmp_path / "absent")
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology("", tmp_path / "missing.json", tmp_path / "absent")
