"""One fault, one incident: a candidate inside (or containing) an open incident's entity."""

from __future__ import annotations

from detectors.reconcile import Placement, covering

WHERE = Placement(node_of_rank={0: "a", 1: "a", 8: "b"},
                  switch_of_node={"a": "s0", "b": "s0", "c": "s1"})


def test_a_rank_and_its_node_are_one_fault_whichever_opened_first():
    assert covering(("gpu", "rank:1"), [("host", "node:a")], WHERE) == ("host", "node:a")
    assert covering(("host", "node:a"), [("gpu", "rank:1")], WHERE) == ("gpu", "rank:1")


def test_a_switch_covers_its_nodes_links_and_ranks():
    sw = [("switch", "switch:s0")]
    assert covering(("link", "node:b"), sw, WHERE) == sw[0]
    assert covering(("gpu", "rank:8"), sw, WHERE) == sw[0]
    assert covering(("link", "link:a~b"), sw, WHERE) == sw[0]
    assert covering(("link", "node:c"), sw, WHERE) is None  # under another switch


def test_a_link_covers_its_two_ends():
    assert covering(("link", "node:b"), [("link", "link:a~b")], WHERE) == ("link", "link:a~b")


def test_other_places_jobs_and_group_hangs_stay_separate():
    assert covering(("gpu", "rank:8"), [("gpu", "rank:1")], WHERE) is None
    assert covering(("job", "job"), [("gpu", "rank:1")], WHERE) is None
    assert covering(("gpu", "rank:1"), [("hang", "group:tp.0")], WHERE) is None
    assert covering(("gpu", "rank:99"), [("host", "node:a")], WHERE) is None  # unknown rank
