"""Host suspects: a node whose ranks sit idle between ops longer than their peers.

Launch delays and CPU contention (a data loader, a noisy neighbour, a throttled CPU) leave
GPU durations normal and stretch the gaps between ops. Each rank's idle gap is compared with
its stage peers in the same step, as a share of the stage's step span; a node counts what
most of its ranks show, so one starved host stands out from the other hosts while a job-wide
stall cancels.

Three nodes of two ranks, each computing 2 × 10 ms; the ranks of node n1 wait 20 ms between
their two kernels:

>>> from detectors.features import step_features
>>> from detectors.noise import NoiseMemory
>>> from detectors.peers import stage_keys
>>> from detectors.testing import frame_of, rank_step
>>> frame = frame_of([
...     rank_step(r, f"n{r // 2}", 0, [
...         ("compute", "fwd", "", 0, 0.0, 10.0, 0),
...         ("compute", "bwd", "", 1, 30.0 if r // 2 == 1 else 10.0, 10.0, 0),
...     ]) for r in range(6)
... ])
>>> out = Candidates()
>>> host_suspects(frame, step_features(frame), stage_keys(frame), NoiseMemory(), out)
>>> out.entity, out.kind, out.detail
(['node:n1'], ['host'], ['idle gaps +20 ms per rank'])
"""

from __future__ import annotations

import numpy as np

from detectors.candidates import Z_REPORT, Candidates
from detectors.features import StepFeatures
from detectors.noise import NoiseMemory
from detectors.segments import grouped_majority, grouped_median
from schemas.frame import StepFrame

# σ floor of the idle-gap share (0.3% of the step span): with identical hosts the spread is
# zero and any scheduling microsecond would count as infinitely significant
_HOST_SIGMA_FLOOR = 0.003
# σ floor of one rank's idle-gap share (1% of the step span). A single process's gaps jitter
# far more than a node's majority does, and when every rank stalls alike (a job-wide GC) the
# spread between them grows before the noise memory has seen it; with this floor a rank must
# idle about Z_REPORT % of a step more than its peers to stand out.
_RANK_SIGMA_FLOOR = 0.01


def host_suspects(
    frame: StepFrame,
    feats: StepFeatures,
    stages: tuple[np.ndarray, int],
    noise: NoiseMemory,
    out: Candidates,
) -> None:
    """Add the step's `host` suspects (one entry per node) to `out`."""
    if not feats.has_compute:
        return  # gaps then include compute: the compute view already uses them
    n_nodes = len(frame.nodes)
    if n_nodes < 2:
        # a host is judged against other hosts; on the only one, contention slows every rank
        # alike (the job's step time shows it) and what is left between its own ranks is
        # scheduling noise (oversubscribed CPU: z up to 6 on a healthy run)
        return
    keys, n_keys = stages
    ref_gap = grouped_median(feats.gap_s, keys, n_keys)[keys]
    ref_span = grouped_median(feats.span_s, keys, n_keys)[keys]
    extra = feats.gap_s - ref_gap
    h = np.where(ref_span > 0, extra / np.maximum(ref_span, 1e-9), 0.0)
    # a host is starved when most of its ranks are: one rank's own stalls (its process
    # throttled, its loader late) are that rank's, and its compute shows them too
    node_h = np.nan_to_num(grouped_majority(h, frame.node, n_nodes))
    node_extra = np.nan_to_num(grouped_majority(extra, frame.node, n_nodes))
    if n_nodes >= 3:
        sh = noise.sigma("host", node_h, _HOST_SIGMA_FLOOR)
    else:
        # two hosts: their two means are no spread; the ranks' own shares are the pool
        sh = noise.sigma("host1", h, _HOST_SIGMA_FLOOR)
    # a node with one traced rank (partial tracing) has no majority: its "most ranks" is
    # one process, whose gaps jitter as a rank's do (a drill with one rank per node traced
    # paged for 6-12 ms of a loaded machine's scheduling on three steps)
    lone = np.bincount(frame.node, minlength=n_nodes) == 1
    zh = node_h / np.where(lone, max(sh, _RANK_SIGMA_FLOOR), sh)
    for n in np.flatnonzero(zh >= Z_REPORT):
        out.add(
            f"node:{frame.nodes[n]}",
            "host",
            zh[n],
            node_extra[n],
            f"idle gaps +{node_extra[n] * 1e3:.0f} ms per rank",
        )
    _rank_stalls(frame, h, extra, zh >= Z_REPORT, keys, n_keys, noise, out)


def _rank_stalls(frame: StepFrame, h: np.ndarray, extra: np.ndarray, node_starved: np.ndarray,
                 keys: np.ndarray, n_keys: int, noise: NoiseMemory, out: Candidates) -> None:
    """One rank idle between its ops far longer than its stage peers, on a node whose other
    ranks are fine: that process's own stall (a GC pause, a late data loader, a sleep, a
    synchronous checkpoint). Its GPU compute is normal, so the compute view is blind to it,
    and every peer that meets it in a collective waits. It needs at least 3 ranks in its
    stage to have a majority to differ from."""
    stage_size = np.bincount(keys, minlength=n_keys)[keys]
    sr = noise.sigma("host_rank", h, _RANK_SIGMA_FLOOR)
    zr = h / sr
    for i in np.flatnonzero((zr >= Z_REPORT) & (stage_size >= 3) & ~node_starved[frame.node]):
        out.add(f"rank:{int(frame.rank[i])}", "host", zr[i], extra[i],
                f"idle +{extra[i] * 1e3:.0f} ms per step between its ops")
