"""Incident summaries: the numbers an SRE acts on, and what the data cannot tell."""

from __future__ import annotations

import numpy as np

from detectors.explain import COMM_ONLY_NOTE, summarize
from detectors.features import step_features
from detectors.testing import frame_of, rank_step


def _frame(with_compute: bool):
    def ops(r: int):
        gap = 30.0 if r == 2 else 10.0
        out = [("compute", "fwd", "", 0, 0.0, gap, 0)] if with_compute else []
        return out + [("coll", "all_reduce", "tp.0", 1, gap, 45.0 - gap, 1 << 20)]
    return frame_of([rank_step(r, f"n{r // 2}", 0, ops(r)) for r in range(4)])


def test_communication_only_summaries_say_the_kind_is_a_guess():
    frame = _frame(with_compute=False)
    text = summarize("host", "node:n1", "idle ×3.0", 0.02, 1.1, frame, step_features(frame),
                     np.ones(4))
    assert text.endswith(COMM_ONLY_NOTE)


def test_summaries_with_compute_ops_make_no_such_caveat():
    frame = _frame(with_compute=True)
    text = summarize("gpu", "rank:2", "compute ×3.00", 0.02, 1.1, frame, step_features(frame),
                     np.array([1.0, 1.0, 3.0, 1.0]))
    assert "rank 2" in text and COMM_ONLY_NOTE not in text


def test_an_intermittent_faults_summary_quotes_what_each_step_it_hits_loses():
    """A flapping NIC confirmed between its bursts costs that step nothing: "the job loses
    0.00 s per step (×1.00)" paged for a NIC that quadrupled the steps it hit."""
    frame = _frame(with_compute=True)
    text = summarize("link", "node:n1", "transfers ×300 on 4 of 10", 1.02, 4.1, frame,
                     step_features(frame), np.ones(4), intermittent=True)
    assert text.endswith("each step it hits loses 1.02 s (×4.10)")
