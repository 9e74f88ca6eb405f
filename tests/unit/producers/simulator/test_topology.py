"""Where each rank sits: coordinates, nodes, and the members of every group."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from producers.simulator import ClusterSimulator
from schemas.rankstep import COMPUTE
from tests.unit.producers.simulator.support import SMALL, frames, scenario


def test_rank_coords_nodes_and_group_membership():
    sim = ClusterSimulator(scenario(steps=2))
    f = frames(sim)[-1]
    lay = SMALL
    tp, pp, dp = f.coord("tp"), f.coord("pp"), f.coord("dp")
    assert np.array_equal(f.rank, np.arange(16))
    assert np.array_equal(f.rank, pp * (lay.dp * lay.tp) + dp * lay.tp + tp)
    assert np.array_equal(f.coord("ep"), dp % lay.ep)
    assert [f.nodes[n] for n in f.node] == [f"node-{r // 4:04d}" for r in range(16)]
    assert np.array_equal(f.local_rank, f.rank % 4)
    ri = f.op_rank_index()
    members: dict[tuple[int, int], list[int]] = defaultdict(list)
    names: dict[tuple[int, int], list[str]] = defaultdict(list)
    for i in np.flatnonzero(f.op_kind != COMPUTE):
        r = int(ri[i])
        g = f.groups[f.op_group[i]]
        kind, ident = g.split(".")
        if kind == "tp":
            assert ident == f"{pp[r]}-{dp[r]}"
        elif kind == "dp":
            assert ident == f"{pp[r]}-{tp[r]}"
        elif kind == "ep":
            assert ident == f"{pp[r]}-{tp[r]}-{dp[r] // lay.ep}"
        else:
            a, b = map(int, ident.split("-"))
            assert int(f.rank[r]) in (a, b) and b - a == lay.dp * lay.tp
        members[(int(f.op_group[i]), int(f.op_seq[i]))].append(int(f.rank[r]))
        names[(int(f.op_group[i]), int(f.op_seq[i]))].append(f.names[f.op_name[i]])
    size = {"tp": lay.tp, "dp": lay.dp, "ep": lay.ep, "pp": 2}
    for (g, _), ranks in members.items():
        assert len(ranks) == len(set(ranks)) == size[f.groups[g].split(".")[0]]
        if f.groups[g].startswith("pp."):
            assert sorted(names[(g, _)]) == ["recv", "send"]
        else:
            assert len(set(names[(g, _)])) == 1
