"""The cost model: compute phase durations, buffer sizes, and transfer time per instance.

Numbers are a plausible dense transformer (bf16, TP8 inside an NVLink node, 200 Gb/s per GPU
across nodes): a tp all_reduce costs ~12% of its forward chunk, the dp reduce_scatter and
all_gather ~10% of a step together, p2p a few %. Only the ratios matter: the simulator scales
compute and bandwidth-bound time by one factor so that a healthy step lasts `step_time_s`,
while launch gaps and link latencies stay absolute (they are what they are on real hardware).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from producers.simulator.topology import G_DP, G_EP, G_PP_NEXT, G_TP, Topology

MiB = 1 << 20


@dataclass(frozen=True)
class CostModel:
    """Unscaled costs (seconds, bytes, bytes/s)."""

    embed_s: float = 0.002
    fwd_s: float = 0.010  # one forward chunk of one microbatch
    bwd_s: float = 0.020  # backward ≈ 2× forward
    loss_s: float = 0.003
    expert_s: float = 0.006
    expert_bwd_s: float = 0.012
    optimizer_s: float = 0.015
    gap_lo_s: float = 10e-6  # launch gap before every op (CPU issue → GPU start)
    gap_hi_s: float = 30e-6
    act_bytes: int = 32 * MiB  # p2p activations / gradients of one microbatch
    tp_bytes: int = 64 * MiB  # tp all_reduce buffer
    grad_bytes: int = 512 * MiB  # dp reduce_scatter input (all_gather input = one shard)
    a2a_bytes: int = 16 * MiB  # MoE all_to_all buffer of an average member
    nvlink_Bps: float = 100e9
    net_Bps: float = 12.5e9
    lat_intra_s: float = 8e-6
    lat_net_s: float = 20e-6


@dataclass
class Transfers:
    """Per group kind, per stage: transfer time of each instance, split as latency + bytes.

    `lat` stays absolute, `bw` is multiplied by the calibration scale; shapes are tp: (dp,),
    dp: (tp,), ep: (dp/ep, tp), p2p between stage s and s+1: (S,).
    """

    lat: dict[int, list[np.ndarray]]
    bw: dict[int, list[np.ndarray]]

    def total(self, scale: float) -> dict[int, list[np.ndarray]]:
        return {
            k: [lat + scale * bw for lat, bw in zip(self.lat[k], self.bw[k], strict=True)]
            for k in self.lat
        }


def _instance(cross: np.ndarray, n: int, algo: float, nbytes: float, c: CostModel):
    """latency (log2 n hops) and bandwidth time of instances of an n-member collective."""
    hops = max(1.0, float(np.log2(max(n, 2))))
    lat = np.where(cross, c.lat_net_s, c.lat_intra_s) * hops * 1e9
    bw = np.where(cross, algo * nbytes / c.net_Bps, algo * nbytes / c.nvlink_Bps) * 1e9
    return lat, bw


def transfer_times(topo: Topology, c: CostModel) -> Transfers:
    """Unscaled transfer of every instance, in ns (cross-node ones go over the network)."""
    lay = topo.layout
    lat: dict[int, list[np.ndarray]] = {G_TP: [], G_DP: [], G_EP: [], G_PP_NEXT: []}
    bw: dict[int, list[np.ndarray]] = {G_TP: [], G_DP: [], G_EP: [], G_PP_NEXT: []}
    for s in range(lay.pp):
        # ring all_reduce moves 2(n-1)/n of the buffer, reduce_scatter / all_gather (n-1)/n
        for kind, cross, n, algo, nbytes in (
            (G_TP, topo.cross_tp[s], lay.tp, 2 * (lay.tp - 1) / lay.tp, c.tp_bytes),
            (G_DP, topo.cross_dp[s], lay.dp, (lay.dp - 1) / lay.dp, c.grad_bytes),
            (G_EP, topo.cross_ep[s], lay.ep, (lay.ep - 1) / lay.ep, c.a2a_bytes),
        ):
            a, b = _instance(cross, n, algo, nbytes, c)
            lat[kind].append(a)
            bw[kind].append(b)
        if s < lay.pp - 1:
            a, b = _instance(topo.cross_pp[s], 2, 1.0, c.act_bytes, c)
            lat[G_PP_NEXT].append(a)
            bw[G_PP_NEXT].append(b)
    return Transfers(lat, bw)
