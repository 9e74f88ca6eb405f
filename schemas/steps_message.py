"""The one builder of a `flare.steps.v1` message (DESIGN §3), for every producer.

The torch hook, the Kineto importer and the simulator all describe a rank's step as columns
of ops; they used to assemble the JSON object each in its own way, so a field added to the
contract could reach one producer and not the others, and the key order differed between
them. Here the object is built once: the keys in the order DESIGN §3 shows, `coords` only
when the producer knows them, and the optional `issue_ns` column (CPU launch → GPU start per
op, additive in v1) only when the producer measured it, so every other message is unchanged.

The columns are taken as given (lists, or int64 numpy arrays for the hook, which encodes with
orjson's numpy option); nothing is checked here, because the worker's decoder validates every
message and a producer's hot path should not pay for it twice.

>>> msg = steps_message(job="j", rank=3, node="n1", step=7, t_start_ns=100, t_end_ns=150,
...                     kind=["compute", "coll"], name=["fwd", "all_reduce"],
...                     group=["", "dp.0"], seq=[0, 12], start_ns=[0, 20], dur_ns=[20, 30],
...                     bytes=[0, 4096], local_rank=1, coords={"dp": 0})
>>> list(msg)
['v', 'job', 'rank', 'node', 'local_rank', 'step', 't_start_ns', 't_end_ns', 'coords', 'ops']
>>> msg["ops"]["name"], list(msg["ops"])
(['fwd', 'all_reduce'], ['kind', 'name', 'group', 'seq', 'start_ns', 'dur_ns', 'bytes'])
>>> idle = steps_message(job="j", rank=0, node="n", step=0, t_start_ns=0, t_end_ns=0, kind=[],
...                      name=[], group=[], seq=[], start_ns=[], dur_ns=[], bytes=[])
>>> "coords" in idle   # a step without ops is valid; coords only when known
False
>>> gpu = steps_message(job="j", rank=0, node="n", step=0, t_start_ns=0, t_end_ns=9,
...                     kind=["coll"], name=["all_reduce"], group=["dp.0"], seq=[0],
...                     start_ns=[4], dur_ns=[5], bytes=[64], issue_ns=[4])
>>> list(gpu["ops"])[-1], gpu["ops"]["issue_ns"]
('issue_ns', [4])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

Column = Sequence[Any] | np.ndarray


def steps_message(
    *,
    job: str,
    rank: int,
    node: str,
    step: int,
    t_start_ns: int,
    t_end_ns: int,
    kind: Column,
    name: Column,
    group: Column,
    seq: Column,
    start_ns: Column,
    dur_ns: Column,
    bytes: Column,
    local_rank: int = 0,
    coords: Mapping[str, int] | None = None,
    issue_ns: Column | None = None,
) -> dict[str, Any]:
    """One rank's step as the v1 JSON object: `start_ns` are offsets from `t_start_ns`;
    `issue_ns` per op from the CPU's launch to the GPU's start (-1: no GPU measure)."""
    msg: dict[str, Any] = {
        "v": 1,
        "job": job,
        "rank": rank,
        "node": node,
        "local_rank": local_rank,
        "step": step,
        "t_start_ns": t_start_ns,
        "t_end_ns": t_end_ns,
    }
    if coords:
        msg["coords"] = dict(coords)
    msg["ops"] = {
        "kind": kind,
        "name": name,
        "group": group,
        "seq": seq,
        "start_ns": start_ns,
        "dur_ns": dur_ns,
        "bytes": bytes,
    }
    if issue_ns is not None:
        msg["ops"]["issue_ns"] = issue_ns
    return msg
