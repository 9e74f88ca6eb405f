"""Group naming and counters of the hook, against a small stand-in of torch.distributed."""

from __future__ import annotations

import pytest

from producers.torch_hook.groups import GroupRegistry


class PG:
    """A process group as far as naming needs: a torch name, a description, members."""

    def __init__(self, name: str, ranks: list[int], desc: str = "undefined") -> None:
        self.group_name = name
        self.group_desc = desc
        self.ranks = ranks


class FakeC10d:
    def __init__(self, default: PG) -> None:
        self.default = default

    def _get_default_group(self) -> PG:
        return self.default

    def _get_process_group_name(self, pg: PG) -> str:
        return pg.group_name


class FakeDist:
    """The four calls GroupRegistry makes, for global rank `me`."""

    def __init__(self, me: int, default: PG) -> None:
        self.me = me
        self.distributed_c10d = FakeC10d(default)

    def get_rank(self, group: PG | None = None) -> int:
        if group is None:
            return self.me
        return group.ranks.index(self.me) if self.me in group.ranks else -1

    def get_world_size(self, group: PG | None = None) -> int:
        return len((group or self.distributed_c10d.default).ranks)


WORLD = PG("0", [0, 1, 2, 3], "default_pg")


def test_default_group_is_world_and_counts_per_group():
    reg = GroupRegistry(FakeDist(2, WORLD))
    sub = PG("1", [2, 3])
    w = reg.get(None)
    assert w.name == "world.0" and reg.get(WORLD) is w
    assert [w.next_seq() for _ in range(3)] == [0, 1, 2]
    s = reg.get(sub)
    assert s.name == "pg.1" and s.next_seq() == 0


def test_tagging_names_the_group_and_sets_the_coordinate():
    reg = GroupRegistry(FakeDist(3, WORLD))
    tp = PG("5", [2, 3])
    dp = PG("6", [1, 3])
    assert reg.tag(tp, "tp", 1) == "tp.1"
    assert reg.tag(dp, "dp") == "dp.6"  # torch's own group name when no index is given
    assert reg.get(tp).name == "tp.1" and reg.get(dp).name == "dp.6"
    assert reg.coords == {"tp": 1, "dp": 1}


def test_tagged_groups_give_the_layout_of_the_kinds_wire_v1_has():
    reg = GroupRegistry(FakeDist(3, WORLD))
    reg.tag(PG("5", [2, 3]), "tp", 1)
    reg.tag(PG("6", [1, 3, 5]), "dp")
    reg.tag(PG("7", [3, 7]), "cp")  # context parallel: a coordinate, not in v1's layout
    reg.tag(PG("8", [0, 1]), "pp")  # not a member: no coordinate, no size
    assert reg.sizes == {"tp": 2, "dp": 3}
    assert reg.get(PG("9", [0, 1, 2, 3], desc="mesh_ep")).name == "ep.9"
    assert reg.sizes == {"tp": 2, "dp": 3, "ep": 4}


def test_group_desc_of_a_kind_is_an_automatic_tag():
    reg = GroupRegistry(FakeDist(1, WORLD))
    mesh_tp = PG("3", [0, 1], desc="mesh_tp")
    assert reg.get(mesh_tp).name == "tp.3"
    assert reg.coords == {"tp": 1} and reg.sizes == {"tp": 2}


def test_tag_after_first_use_keeps_the_counter():
    reg = GroupRegistry(FakeDist(0, WORLD))
    g = PG("2", [0, 1])
    reg.get(g).next_seq()
    reg.tag(g, "pp", 0)
    info = reg.get(g)
    assert info.name == "pp.0" and info.next_seq() == 1


def test_p2p_groups_are_per_direction_with_their_own_seq():
    reg = GroupRegistry(FakeDist(1, WORLD))
    w = reg.get(None)
    assert w.p2p_next(1, 2) == ("world.0.1-2", 0)
    assert w.p2p_next(1, 2) == ("world.0.1-2", 1)
    assert w.p2p_next(2, 1) == ("world.0.2-1", 0)
    assert w.p2p_next(-1, 1) == ("world.0.any-1", 0)
    assert w.next_seq() == 0  # collectives count apart from transfers


def test_bad_tags_are_refused():
    reg = GroupRegistry(FakeDist(0, WORLD))
    with pytest.raises(ValueError, match="kind"):
        reg.tag(WORLD, "zz")
    with pytest.raises(ValueError, match="word"):
        reg.tag(WORLD, "tp", "a b")
