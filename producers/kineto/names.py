"""Naming rules of Kineto traces: collective names, dtypes, message sizes, process groups.

Traces of different PyTorch generations spell the same thing differently: `allreduce`,
`c10d::allreduce_`, `nccl:all_reduce`, `gloo:all_reduce`, `ncclKernel_AllReduce_RING_LL...`,
`ncclDevKernel_AllGather_RING_LL`; sizes come as `In msg nelems` + `dtype` (recent traces),
or as `Input Dims` + `Input type` (older ones and `record_shapes=True`). Everything here maps
those spellings onto the wire contract's names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

P2P_NAMES = frozenset({"send", "recv"})
_PREFIXES = ("c10d::", "nccl:", "gloo:", "ucc:", "mpi:")
_RULES = (  # (prefix of the squashed lower-case name, wire name); first match wins
    ("allreduce", "all_reduce"),
    ("allgather", "all_gather"),
    ("reducescatter", "reduce_scatter"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("barrier", "barrier"),
    ("sendrecv", "sendrecv"),
    ("send", "send"),
    ("recv", "recv"),
    ("gather", "gather"),
    ("scatter", "scatter"),
    ("reduce", "reduce"),
)
_KERNEL = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)", re.IGNORECASE)
_DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2,
    "bfloat16": 2, "c10::half": 2, "c10::bfloat16": 2, "int": 4, "int32": 4, "long": 8,
    "int64": 8, "long int": 8, "short": 2, "int16": 2, "char": 1, "int8": 1, "byte": 1,
    "uint8": 1, "unsigned char": 1, "signed char": 1, "bool": 1, "float8_e4m3fn": 1,
    "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "complexfloat": 8,
    "complexdouble": 16,
}
_DESC_KIND = re.compile(r"(?:^|[_\-.:])(tp|dp|pp|ep|cp)$")
_SAFE = re.compile(r"[^A-Za-z0-9_\-:]")
UNKNOWN_GROUP = "pg.unknown"
_THREAD_PREFIX = UNKNOWN_GROUP + "-t"  # a gloo op's group until its thread's is inferred
_STREAM_PREFIX = UNKNOWN_GROUP + "-s"  # an NCCL kernel's with no group, until inferred


def canonical(name: str) -> str | None:
    """Wire name of a collective name as trace args spell it (`allreduce`, `_allgather_base`)."""
    key = name.strip().lower().replace("_", "").replace(" ", "")
    for prefix, wire in _RULES:
        if key.startswith(prefix):
            return wire
    return None


def comm_event_name(event_name: str) -> str | None:
    """Wire name of a trace event that is a communication op, else None.

    Only prefixed names count (`nccl:`, `gloo:`, `c10d::`, NCCL kernels): a bare `gather` may
    be `aten::gather`, which is compute.
    """
    s = event_name.strip()
    m = _KERNEL.match(s)
    if m is not None:
        return canonical(m.group(1))
    low = s.lower()
    for p in _PREFIXES:
        if low.startswith(p):
            return canonical(low[len(p):])
    return None


def is_nccl_kernel(name: str) -> bool:
    return _KERNEL.match(name) is not None


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a trace dtype spelling; 0 when unknown (e.g. `TensorList`)."""
    return _DTYPE_BYTES.get(str(dtype).strip().lower(), 0)


def _elements(dims: Any) -> int:
    """Elements of one `Input Dims` entry: a shape, or a list of shapes (TensorList)."""
    if not isinstance(dims, list) or not dims:
        return 0 if isinstance(dims, list) else int(dims) if isinstance(dims, int) else 0
    if all(isinstance(d, int) for d in dims):
        n = 1
        for d in dims:
            n *= max(int(d), 0)
        return n
    return sum(_elements(d) for d in dims)


def message_bytes(args: Mapping[str, Any], wire: str) -> int:
    """Input buffer size of one collective from its trace args (0 when unknown)."""
    nelems = args.get("In msg nelems")
    if isinstance(nelems, int | float) and nelems >= 0:
        return int(nelems) * dtype_bytes(args.get("dtype", ""))
    dims = args.get("Input Dims")
    types = args.get("Input type")
    if not isinstance(dims, list) or not dims:
        return 0
    # torch's own ops put the output first for these three; the input is the second.
    idx = 1 if wire in ("all_gather", "reduce_scatter", "all_to_all") and len(dims) > 1 else 0
    if isinstance(types, list) and len(types) > idx:
        size = dtype_bytes(types[idx])
    else:
        size = 0
    return _elements(dims[idx]) * size


def group_name(args: Mapping[str, Any]) -> str:
    """`<kind>.<id>` of a collective's process group from its trace args."""
    pg = args.get("Process Group Name")
    if pg is None or pg == "":
        return UNKNOWN_GROUP
    gid = _SAFE.sub("_", str(pg)) or "0"
    desc = str(args.get("Process Group Description", "") or "").lower()
    if desc == "default_pg":
        return f"world.{gid}"
    m = _DESC_KIND.search(desc)
    if m is not None:
        return f"{m.group(1)}.{gid}"
    return f"pg.{gid}"


def thread_group(tid: Any) -> str:
    """Placeholder group of an unlabelled op run by worker thread `tid` (see `groups`)."""
    return f"{_THREAD_PREFIX}{tid}"


def thread_of(group: str) -> str | None:
    """The thread of a `thread_group` placeholder, else None."""
    return group[len(_THREAD_PREFIX):] if group.startswith(_THREAD_PREFIX) else None


def stream_group(stream: Any) -> str:
    """Placeholder group of an unlabelled NCCL kernel run on CUDA stream `stream` (see
    `streams`)."""
    return f"{_STREAM_PREFIX}{stream}"


def stream_of(group: str) -> str | None:
    """The stream of a `stream_group` placeholder, else None."""
    return group[len(_STREAM_PREFIX):] if group.startswith(_STREAM_PREFIX) else None
