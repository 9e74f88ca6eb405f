"""Which ranks are each other's peers when no coords say (`detectors.peers.stage_keys`)."""

from __future__ import annotations

from detectors.peers import stage_keys
from detectors.testing import frame_of, rank_step


def test_stages_of_a_gpu_trace_are_told_by_their_transfers():
    """A GPU trace replays a step's kernels as one `gpu_compute` op on every stage: the first
    stage is the one that sends before it receives, a middle stage talks to two neighbours
    (twice the transfers), the last receives first."""
    def ops(stage: int) -> list[tuple[str, str, str, int, float, float, int]]:
        out = [("compute", "gpu_compute", "", 0, 0.0, 50.0, 0)]
        if stage == 0:
            return out + [("p2p", "send", "pp.a", 0, 50.0, 5.0, 64),
                          ("p2p", "recv", "pp.a", 1, 60.0, 5.0, 64)]
        more = [("p2p", "send", "pp.b", 0, 55.0, 5.0, 64),
                ("p2p", "recv", "pp.b", 1, 62.0, 5.0, 64)] if stage == 1 else []
        return out + [("p2p", "recv", "pp.a", 0, 1.0, 49.0, 64),
                      ("p2p", "send", "pp.a", 1, 70.0, 5.0, 64), *more]

    stage_of = [0, 0, 1, 1, 2, 2]
    frame = frame_of([rank_step(r, f"n{r}", 0, ops(s)) for r, s in enumerate(stage_of)])
    keys, n = stage_keys(frame)
    assert n == 3
    assert len({(int(k), s) for k, s in zip(keys, stage_of, strict=True)}) == 3
    alike = frame_of([rank_step(r, f"n{r}", 0, ops(0)[:1]) for r in range(4)])
    assert stage_keys(alike)[1] == 1  # no transfers: one stage, as before
