"""All suspects of one step: the compute, host and network views on one candidate list.

Each view judges an entity against its peers in the SAME step, so job-wide effects (GC,
checkpoints, level shifts) cancel; none of them decides alone whether an incident opens
(`evidence.EvidenceTracker` does, on what persists across steps):

- `compute_suspects`: a rank (`gpu`) or a whole `node` computing slower than its peers;
- `host_suspects`: a node's ranks idle between ops longer than their peers (`host`);
- `network_suspects`: a NIC or pipeline `link`, or a `switch`, behind slow transfers;
- `untraced_suspects`: with partial tracing, the node a group's traced members wait on when
  the member they wait for is not traced.

Four ranks on two nodes compute, then all-reduce; rank 2 computes 40 ms instead of 10 ms and
the others wait for it:

>>> from detectors.features import step_features
>>> from detectors.network_suspects import Topology, transfer_reference
>>> from detectors.noise import NoiseMemory
>>> from detectors.compute_suspects import compute_ratio
>>> from detectors.peers import stage_keys
>>> from detectors.testing import frame_of, rank_step
>>> def ops(r):
...     compute = 40.0 if r == 2 else 10.0
...     return [("compute", "fwd", "", 0, 0.0, compute, 0),
...             ("coll", "all_reduce", "tp.0", 1, compute, 45.0 - compute, 1 << 20)]
>>> frame = frame_of([rank_step(r, f"n{r // 2}", 0, ops(r)) for r in range(4)])
>>> feats = step_features(frame)
>>> stages = stage_keys(frame)
>>> ratio = compute_ratio(frame, feats, stages)
>>> c = step_suspects(frame, feats, ratio, Topology(), transfer_reference(feats.inst),
...                   NoiseMemory(), stages)
>>> c.entity, c.kind, round(c.excess_s[0], 3)
(['rank:2'], ['gpu'], 0.03)
"""

from __future__ import annotations

import numpy as np

from detectors.candidates import Candidates
from detectors.compute_suspects import TwoStages, compute_suspects
from detectors.features import StepFeatures
from detectors.host_suspects import host_suspects
from detectors.network_suspects import Burst, OwnPast, Topology, network_suspects
from detectors.noise import NoiseMemory
from detectors.untraced_suspects import WaitHistory, untraced_suspects
from schemas.frame import StepFrame


def step_suspects(
    frame: StepFrame,
    feats: StepFeatures,
    ratio: np.ndarray,
    topo: Topology,
    ref: np.ndarray,
    noise: NoiseMemory,
    stages: tuple[np.ndarray, int],
    waits: WaitHistory | None = None,
    own: OwnPast | None = None,
    burst: Burst | None = None,
    two_stages: TwoStages | None = None,
    clocks_ns: np.ndarray | None = None,
    usual_signature: np.ndarray | None = None,
) -> Candidates:
    """All suspects of one step with their significance (robust z) and cost in seconds.

    `ratio` is `compute_ratio(...)`, `ref` is `transfer_reference(feats.inst)`, `own` each
    instance's own past (`TransferHistory.reference`) and `stages` is
    `peers.stage_keys(frame)`: computed once per step by the caller, which stores them too;
    `burst` the step if it at least doubled (`network_suspects.burst_of`); `two_stages` the job's
    memory of its two stages (`compute_suspects.TwoStages`); `clocks_ns` its nodes' clock
    offsets as its healthy steps read them (`whatif.UsualStep.clocks_of`), for a burst's
    transfers; `usual_signature` (I,) whether each instance's signature ran its usual this step
    (`signature_history.SignatureCheck.usual`);
    `waits` is the job's memory of partially traced groups' waits (without it, nothing is
    said of untraced members). A single rank has no peers, hence no suspects."""
    out = Candidates()
    if frame.n_ranks < 2:
        return out
    compute_suspects(frame, feats, ratio, noise, out, stages, two_stages)
    host_suspects(frame, feats, stages, noise, out)
    network_suspects(frame, feats, topo, ref, out, own, burst, clocks_ns, usual_signature)
    if waits is not None and frame.n_ranks < topo.world:  # only partial tracing has them
        untraced_suspects(frame, feats, topo, stages, noise, waits, out)
    return out
