"""Stream-time order: what the simulator generated, released once nothing earlier can come.

A step's messages are generated together, but their true times interleave with the next
step's (a fast rank starts step n+1 while a slow one still finishes step n). The merge buffer
keeps generated items keyed by true time and releases, in key order, those older than a
watermark that no later step can undercut (the earliest rank clock).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class Merger:
    """Items keyed by true time, released in key order once the watermark passes them."""

    def __init__(self) -> None:
        self._keys: list[np.ndarray] = []
        self._src: list[np.ndarray] = []
        self._idx: list[np.ndarray] = []
        self._objs: dict[int, object] = {}
        self._n = 0

    def add(self, keys: np.ndarray, obj: object) -> None:
        """Item i of `obj` has time keys[i]."""
        if keys.shape[0] == 0:
            return
        oid = self._n
        self._n += 1
        self._objs[oid] = obj
        self._keys.append(np.asarray(keys, dtype=np.int64))
        self._src.append(np.full(keys.shape[0], oid, dtype=np.int64))
        self._idx.append(np.arange(keys.shape[0], dtype=np.int64))

    def release(self, watermark: float) -> Iterator[tuple[int, object, int]]:
        """(key, obj, i) of every item with key < watermark, in key order (stable)."""
        if not self._keys:
            return
        keys = np.concatenate(self._keys)
        src = np.concatenate(self._src)
        idx = np.concatenate(self._idx)
        order = np.argsort(keys, kind="stable")
        keys, src, idx = keys[order], src[order], idx[order]
        cut = len(keys)
        if np.isfinite(watermark):
            cut = int(np.searchsorted(keys, watermark, side="left"))
        rest = slice(cut, None)
        self._keys, self._src, self._idx = [keys[rest]], [src[rest]], [idx[rest]]
        objs = self._objs
        live = set(np.unique(src[rest]).tolist())
        head = zip(keys[:cut].tolist(), src[:cut].tolist(), idx[:cut].tolist(), strict=True)
        for k, o, i in head:
            yield k, objs[o], i
        self._objs = {o: objs[o] for o in live}
