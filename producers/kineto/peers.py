"""The peer of each send and receive in a gloo trace, which names neither.

Why: gloo runs a p2p op on the calling thread and the trace names no group and no peer, yet
the detectors pair a transfer's two ends by their group and direction (`<group>.<src>-<dst>`,
as the hook names them). A pipeline's sends go over pair groups made for them, groups that
run no collective, so the rank's peers are their other members (`p2p_candidates`); with
several (a pipeline group of four stages), the one whose receive each send's data released
(`pick_peers`).

>>> import numpy as np
>>> t = np.arange(4) * 100
>>> recv = (np.zeros(4, dtype=bool), t - 50, t + 3)  # rank 4 receives 3 after each post
>>> pick_peers(0, np.ones(4, dtype=bool), t, t + 1, (0, 4, 6), {4: recv}).tolist()
[4, 4, 4, 4]
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from producers.kineto.groups import ProcessGroup

_PEER_SHARE = 0.2  # a p2p peer picked for fewer of a rank's sends (or receives) is noise


def p2p_candidates(groups: tuple[ProcessGroup, ...], serving: set[str]) -> tuple[int, ...]:
    """The ranks a rank's p2p ops may go to: the members of its groups that ran none of its
    collectives (a pipeline's pair groups exist for their sends and receives), the default
    group aside (it holds every rank and tells nothing)."""
    spare = [g for g in groups if g.name not in serving and g.desc != "default_pg"]
    return tuple(sorted({r for g in spare for r in g.ranks}))


def pick_peers(rank: int, is_send: np.ndarray, start_ns: np.ndarray, end_ns: np.ndarray,
               candidates: tuple[int, ...],
               posted: Mapping[int, tuple[np.ndarray, np.ndarray, np.ndarray]]) -> np.ndarray:
    """Each p2p op's peer rank (-1: not known).

    With one candidate that is the peer, traced or not. With several, a send's peer is the
    traced candidate whose receive ended soonest after the send was posted, and a receive's
    the one whose send was posted last before it ended: data is received after it is sent,
    and a blocked receiver is released by its own sender's data, not by another pair's.
    One op at a time that is noisy (a four-stage drill's ranks sent a tenth of their data
    to a stage two away), and a rank sends each way to the same few peers (a pipeline stage
    to its neighbours): a candidate picked for under `_PEER_SHARE` of a direction's ops is
    dropped, and those ops go to the likeliest peer left.
    `posted`: each traced rank's (is_send, start_ns, end_ns) of its p2p ops.
    """
    peer = np.full(is_send.size, -1, dtype=np.int64)
    others = [c for c in candidates if c != rank]
    if len(others) == 1:
        peer[:] = others[0]
        return peer
    traced = [c for c in others if c in posted]
    if not traced or is_send.size == 0:
        return peer
    delay = np.stack([_delays(is_send, start_ns, end_ns, posted[c]) for c in traced], axis=1)
    for way in (is_send, ~is_send):
        d = delay[way]
        if d.size == 0:
            continue
        matched = np.isfinite(d.min(axis=1))
        share = np.bincount(np.argmin(d, axis=1)[matched], minlength=len(traced)) \
            / max(int(matched.sum()), 1)
        d = np.where(share >= _PEER_SHARE, d, np.inf)  # the few peers it really talks to
        best = np.argmin(d, axis=1)
        found = np.isfinite(d[np.arange(best.size), best])
        peer[np.flatnonzero(way)[found]] = np.asarray(traced)[best[found]]
    return peer


def _delays(is_send: np.ndarray, start_ns: np.ndarray, end_ns: np.ndarray,
            theirs: tuple[np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """(n,) how long each of my ops waited for a matching op of one candidate: a send until
    its receive ended, a receive since its send was posted (inf: none fits)."""
    c_send, c_start, c_end = theirs
    recv_ends = np.sort(c_end[~c_send])
    send_starts = np.sort(c_start[c_send])
    delay = np.full(is_send.size, np.inf)
    if recv_ends.size:  # my send → its receive ending soonest after my post
        i = np.searchsorted(recv_ends, start_ns[is_send])
        ok = i < recv_ends.size
        d = np.full(i.size, np.inf)
        d[ok] = recv_ends[i[ok]] - start_ns[is_send][ok]
        delay[is_send] = d
    if send_starts.size:  # my receive ← its send posted last before my end
        i = np.searchsorted(send_starts, end_ns[~is_send], side="right") - 1
        ok = i >= 0
        d = np.full(i.size, np.inf)
        d[ok] = end_ns[~is_send][ok] - send_starts[i[ok]]
        delay[~is_send] = d
    return delay
