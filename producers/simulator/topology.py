"""Where every rank sits: coordinates, node, leaf switch, and the communication groups.

Ranks are numbered rank = pp*(dp*tp) + d*tp + t (tp fastest), so the ranks of one pipeline
stage are one contiguous block of S = dp*tp ranks, and index j = d*tp + t inside a block is
the same (d, t) position in every stage. The engine exploits this: it works on one (S,) array
per stage, and every group kind is a reshape of that block ((dp, tp) for tp and dp groups,
(dp/ep, ep, tp) for ep groups, element-wise between neighbour stages for p2p).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from producers.simulator.scenario import Layout
from schemas.rankstep import COORD_DIMS

# Group kinds of an op slot; row `gtype` of `Topology.gid` gives every rank's group of a kind.
G_NONE, G_TP, G_DP, G_EP, G_PP_NEXT, G_PP_PREV = range(6)


class Topology:
    """Static placement of a layout; built once per simulator (O(world) numpy work)."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        tp, dp, ep = layout.tp, layout.dp, layout.ep
        self.world = layout.world
        self.stage_size = dp * tp
        S = self.stage_size
        rank = np.arange(self.world, dtype=np.int64)
        self.tp_of = (rank % tp).astype(np.int32)
        self.dp_of = ((rank // tp) % dp).astype(np.int32)
        self.pp_of = (rank // S).astype(np.int32)
        self.node_of = (rank // layout.gpus_per_node).astype(np.int32)
        self.local_rank = (rank % layout.gpus_per_node).astype(np.int32)
        self.n_nodes = layout.n_nodes
        self.n_switches = layout.n_switches
        self.switch_of_node = (
            np.arange(self.n_nodes, dtype=np.int32) // layout.nodes_per_switch
        ).astype(np.int32)
        nw = max(4, len(str(self.n_nodes - 1)))
        sw = max(2, len(str(self.n_switches - 1)))
        self.node_names = [f"node-{i:0{nw}d}" for i in range(self.n_nodes)]
        self.switch_names = [f"leaf-{i:0{sw}d}" for i in range(self.n_switches)]

        coords = np.full((self.world, len(COORD_DIMS)), -1, dtype=np.int32)
        coords[:, COORD_DIMS.index("tp")] = self.tp_of
        coords[:, COORD_DIMS.index("pp")] = self.pp_of
        coords[:, COORD_DIMS.index("dp")] = self.dp_of
        if ep > 1:
            coords[:, COORD_DIMS.index("ep")] = self.dp_of % ep
        self.coords = coords

        self._build_groups()
        self._build_cross()

    # ------------------------------------------------------------------ groups
    def _build_groups(self) -> None:
        """Interned group names and, per stage, every rank's group id of each kind."""
        tp, pp, dp, ep = self.layout.tp, self.layout.pp, self.layout.dp, self.layout.ep
        S = self.stage_size
        names: list[str] = [""]
        base_tp = len(names)
        names += [f"tp.{s}-{d}" for s in range(pp) for d in range(dp)]
        base_dp = len(names)
        names += [f"dp.{s}-{t}" for s in range(pp) for t in range(tp)]
        base_ep = len(names)
        ne = dp // ep
        if ep > 1:
            names += [f"ep.{s}-{t}-{e}" for s in range(pp) for t in range(tp) for e in range(ne)]
        base_pp = len(names)
        names += [f"pp.{s * S + j}-{(s + 1) * S + j}" for s in range(pp - 1) for j in range(S)]
        self.groups = names
        self.group_index = {g: i for i, g in enumerate(names)}

        j = np.arange(S, dtype=np.int64)
        d, t = j // tp, j % tp
        gid = np.zeros((pp, 6, S), dtype=np.int32)
        for s in range(pp):
            gid[s, G_TP] = base_tp + s * dp + d
            gid[s, G_DP] = base_dp + s * tp + t
            if ep > 1:
                gid[s, G_EP] = base_ep + (s * tp + t) * ne + d // ep
            gid[s, G_PP_NEXT] = base_pp + s * S + j if s < pp - 1 else 0
            gid[s, G_PP_PREV] = base_pp + (s - 1) * S + j if s > 0 else 0
        self.gid = gid

    def dp_group_name(self, stage: int, tp_index: int) -> str:
        return f"dp.{stage}-{tp_index}"

    # ------------------------------------------------------- instance geometry
    def stage_nodes(self, s: int) -> np.ndarray:
        """(dp, tp) node index of each rank of stage s."""
        S = self.stage_size
        return self.node_of[s * S : (s + 1) * S].reshape(self.layout.dp, self.layout.tp)

    def _ep_view(self, a: np.ndarray) -> np.ndarray:
        lay = self.layout
        return a.reshape(lay.dp // lay.ep, lay.ep, lay.tp)

    def _build_cross(self) -> None:
        """Per stage and group kind: does an instance leave its node (network, not NVLink)?"""
        pp = self.layout.pp
        self.cross_tp, self.cross_dp, self.cross_ep, self.cross_pp = [], [], [], []
        for s in range(pp):
            n = self.stage_nodes(s)
            self.cross_tp.append(n.min(axis=1) != n.max(axis=1))
            self.cross_dp.append(n.min(axis=0) != n.max(axis=0))
            e = self._ep_view(n)
            self.cross_ep.append(e.min(axis=1) != e.max(axis=1))
            if s < pp - 1:
                self.cross_pp.append((n != self.stage_nodes(s + 1)).ravel())

    def instances_touching(self, node_hit: np.ndarray) -> dict[int, list[np.ndarray]]:
        """Cross-node instances with a member on a node where `node_hit` (n_nodes,) is true.

        Returns, per group kind (G_TP, G_DP, G_EP, G_PP_NEXT), one boolean array per stage
        (per pair of stages for p2p) shaped like that kind's instances.
        """
        return self._cross_node_instances(lambda s: node_hit[self.stage_nodes(s)])

    def instances_of_ranks(self, rank_hit: np.ndarray) -> dict[int, list[np.ndarray]]:
        """Cross-node instances with a member where `rank_hit` (world,) is true: the
        transfers those ranks' processes drive over the network (as `instances_touching`)."""
        S, lay = self.stage_size, self.layout
        return self._cross_node_instances(
            lambda s: rank_hit[s * S : (s + 1) * S].reshape(lay.dp, lay.tp))

    def _cross_node_instances(self, hit_of: Callable[[int], np.ndarray]
                              ) -> dict[int, list[np.ndarray]]:
        """Per group kind, per stage: the cross-node instances with a member where
        `hit_of(s)` ((dp, tp) bool of stage s's ranks) is true."""
        pp = self.layout.pp
        out: dict[int, list[np.ndarray]] = {G_TP: [], G_DP: [], G_EP: [], G_PP_NEXT: []}
        for s in range(pp):
            h = hit_of(s)
            out[G_TP].append(h.any(axis=1) & self.cross_tp[s])
            out[G_DP].append(h.any(axis=0) & self.cross_dp[s])
            out[G_EP].append(self._ep_view(h).any(axis=1) & self.cross_ep[s])
            if s < pp - 1:
                out[G_PP_NEXT].append((h | hit_of(s + 1)).ravel() & self.cross_pp[s])
        return out

    def p2p_node_pairs(self) -> list[tuple[int, int, int, int]]:
        """Distinct cross-node (stage, node_a, node_b, example j) p2p links, a < b."""
        seen: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        for s in range(self.layout.pp - 1):
            a = self.stage_nodes(s).ravel()
            b = self.stage_nodes(s + 1).ravel()
            for j in np.flatnonzero(self.cross_pp[s]).tolist():
                key = (min(int(a[j]), int(b[j])), max(int(a[j]), int(b[j])))
                seen.setdefault(key, (s, key[0], key[1], j))
        return list(seen.values())

    def link_mask(self, node_a: int, node_b: int) -> list[np.ndarray]:
        """Per pair of stages, the p2p instances between nodes a and b (either direction)."""
        out = []
        for s in range(self.layout.pp - 1):
            a = self.stage_nodes(s).ravel()
            b = self.stage_nodes(s + 1).ravel()
            out.append(((a == node_a) & (b == node_b)) | ((a == node_b) & (b == node_a)))
        return out

    # ----------------------------------------------------------------- names
    def rank_entity(self, rank: int) -> str:
        return f"rank:{rank}"

    def node_entity(self, node: int) -> str:
        return f"node:{self.node_names[node]}"

    def switch_entity(self, switch: int) -> str:
        return f"switch:{self.switch_names[switch]}"

    def link_entity(self, node_a: int, node_b: int) -> str:
        a, b = sorted((self.node_names[node_a], self.node_names[node_b]))
        return f"link:{a}~{b}"

    def nodes_table(self) -> list[dict[str, str]]:
        """The `nodes` list of the jobs start event."""
        return [
            {"node": self.node_names[i], "switch": self.switch_names[int(self.switch_of_node[i])]}
            for i in range(self.n_nodes)
        ]
