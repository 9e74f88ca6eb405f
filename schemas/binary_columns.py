"""Integer columns as bytes: the one layout of Flare's binary encodings.

Two messages are binary: a shard's assembled step between the two stages
(`schemas.partial_frame`) and a rank's step in `flare.steps.v2` (`schemas.steps_v2`). Both
are a head, then columns of integers, each stored in the narrowest dtype its values fit
(little-endian) and padded to 8 bytes, so numpy reads each with one `frombuffer` at an
aligned offset. Reading checks every dtype and size against the message's length before a
byte is read, so a corrupt or truncated message is an `InvalidMessage`, never a crash or a
read past its end.

>>> import numpy as np
>>> parts, dtypes, sizes = pack_columns([np.array([3, 300]), np.array([-1, 0, 1])])
>>> dtypes, sizes, len(b"".join(parts))
(['u2', 'i1'], [2, 3], 16)
>>> [c.tolist() for c in read_columns(b"".join(parts), 0, dtypes, sizes, ("a", "b"))]
[[3, 300], [-1, 0, 1]]
>>> read_columns(b"".join(parts)[:9], 0, dtypes, sizes, ("a", "b"))
Traceback (most recent call last):
...
schemas.errors.InvalidMessage: $: truncated: the columns need 16 bytes, the message has 9
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from schemas.errors import InvalidMessage

ALIGN = 8
_NARROW = tuple(np.dtype(t) for t in ("uint8", "int8", "uint16", "int16", "uint32", "int32"))


def narrowest(values: np.ndarray) -> np.dtype:
    """The smallest integer dtype that holds every value (int64 past 32 bits)."""
    if values.size == 0:
        return np.dtype("uint8")
    lo, hi = int(values.min()), int(values.max())
    for dt in _NARROW:
        info = np.iinfo(dt)
        if info.min <= lo and hi <= info.max:
            return dt
    return np.dtype("int64")


def pad(n: int) -> bytes:
    """The zero bytes that bring `n` bytes to the next multiple of 8."""
    return b"\0" * (-n % ALIGN)


def pack_columns(columns: Sequence[np.ndarray]) -> tuple[list[bytes], list[str], list[int]]:
    """Each column's bytes (padded), stored dtype name and size, in order."""
    parts: list[bytes] = []
    dtypes: list[str] = []
    sizes: list[int] = []
    for a in columns:
        a = np.asarray(a).ravel()
        dt = narrowest(a) if a.dtype.kind in "iu" else a.dtype
        b = a.astype(dt.newbyteorder("<"), copy=False).tobytes()
        parts += [b, pad(len(b))]
        dtypes.append(dt.str.lstrip("<|="))
        sizes.append(int(a.size))
    return parts, dtypes, sizes


def read_columns(raw: bytes, pos: int, dtypes: Sequence[str], sizes: Sequence[int],
                 names: Sequence[str]) -> list[np.ndarray]:
    """The columns stored from `pos` (a multiple of 8) on, as read-only views of `raw`.

    InvalidMessage (`$.<name>`) for a dtype that is not an integer's (or is uint64, which
    int64 cannot hold and `pack_columns` never writes), a negative size, or columns that run
    past the end of `raw`."""
    if len(dtypes) != len(names) or len(sizes) != len(names):
        raise InvalidMessage("$.header", f"{len(dtypes)} columns, not {len(names)}")
    spans = []
    for name, dt_name, size in zip(names, dtypes, sizes, strict=True):
        try:
            dt = np.dtype(dt_name).newbyteorder("<")
        except TypeError:
            raise InvalidMessage(f"$.{name}", f"unknown dtype {dt_name!r}") from None
        if dt.kind not in "iu" or (dt.kind == "u" and dt.itemsize == 8) or size < 0:
            raise InvalidMessage(f"$.{name}", f"dtype {dt_name!r}, {size} elements")
        spans.append((pos, dt, size))
        n = dt.itemsize * size
        pos += n + (-n % ALIGN)
    if pos > len(raw):
        raise InvalidMessage("$", f"truncated: the columns need {pos} bytes, the message has "
                                  f"{len(raw)}")
    return [np.frombuffer(raw, dtype=dt, count=size, offset=at) for at, dt, size in spans]
