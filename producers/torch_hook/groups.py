"""Names and sequence counters of process groups, as the wire contract wants them.

A group is `<kind>.<id>`: the kind (tp, dp, pp, ep, cp) when the user tags the group or gives
it such a `group_desc` (DeviceMesh and `new_group(group_desc=...)` do), `world` for the
default group, `pg` otherwise. The id must be equal on every member and unique in the job, so
it is the user's index or torch's own group name (assigned in creation order, which torch
already requires to be the same on every rank). Tagging a group also gives the rank its
coordinate in that dimension, its rank inside the group, and the job's layout its size in that
dimension: with partial tracing the layout is how a detector knows that a group has members
which never report (they are untraced, not absent).

A group also says whether its ops run on a GPU (`GroupInfo.gpu`: its backend is NCCL and GPU
timing is on), decided once when it is resolved, so the CPU/gloo hot path pays one attribute
read for GPU timing and nothing more.

Point-to-point transfers get one group per direction, `<kind>.<id>.<src>-<dst>` with global
ranks, so the k-th send from a to b and the k-th receive of b from a share group and seq
whatever else either side does in between.
"""

from __future__ import annotations

import re
from typing import Any

TAG_KINDS = ("tp", "dp", "pp", "ep", "cp")
LAYOUT_KINDS = ("tp", "pp", "dp", "ep")  # the dimensions wire v1's job layout has
_DESC_KIND = re.compile(r"(?:^|[_\-.:])(tp|dp|pp|ep|cp)$")


class GroupInfo:
    """One group's wire name, collective counter and per-direction p2p counters."""

    __slots__ = ("name", "kind", "gid", "seq", "p2p", "me", "pg", "gpu")

    def __init__(self, kind: str, gid: str, me: int, pg: Any) -> None:
        self.kind = kind
        self.gid = gid
        self.name = f"{kind}.{gid}"
        self.seq = 0
        self.p2p: dict[tuple[int, int], list[Any]] = {}
        self.me = me
        self.pg = pg
        self.gpu = False  # its ops get GPU events (`gpu_timing`)

    def next_seq(self) -> int:
        s = self.seq
        self.seq = s + 1
        return s

    def p2p_next(self, src: int, dst: int) -> tuple[str, int]:
        """Group name and seq of the next transfer from global rank src to dst (-1: any)."""
        slot = self.p2p.get((src, dst))
        if slot is None:
            a = "any" if src < 0 else str(src)
            slot = self.p2p[(src, dst)] = [f"{self.name}.{a}-{dst}", 0]
        s = slot[1]
        slot[1] = s + 1
        return slot[0], s


class GroupRegistry:
    """Resolves the `group` argument of a torch.distributed call to its GroupInfo.

    The fast path is one dict lookup keyed by the argument itself (None for the default
    group); resolution happens once per group. `dist` is the torch.distributed module.
    `gpu`: GPU timing is on, so groups on NCCL are marked `GroupInfo.gpu`.
    """

    def __init__(self, dist: Any, gpu: bool = False) -> None:
        self._dist = dist
        self.gpu = gpu
        self._infos: dict[Any, GroupInfo] = {}
        self._tags: dict[Any, tuple[str, str]] = {}
        self._counters: dict[Any, GroupInfo] = {}
        self.coords: dict[str, int] = {}
        self.sizes: dict[str, int] = {}  # members per group, by tagged kind (the layout)

    def get(self, group: Any) -> GroupInfo:
        info = self._infos.get(group)
        if info is None:
            info = self._resolve(group)
        return info

    def clear(self) -> None:
        """Forget resolved groups (default group destroyed or re-created)."""
        self._infos.clear()
        self._counters.clear()

    def tag(self, pg: Any, kind: str, index: int | str | None = None) -> str:
        """Name `pg` `<kind>.<index>` and record this rank's coordinate in that dimension."""
        if kind not in TAG_KINDS:
            raise ValueError(f"group kind {kind!r} is not one of {TAG_KINDS}")
        real = pg if pg is not None else self._default()
        gid = str(index) if index is not None else self._pg_name(real)
        if not gid or any(c.isspace() for c in gid):
            raise ValueError(f"group id {gid!r} must be a non-empty word")
        self._tags[real] = (kind, gid)
        self._infos.clear()
        self._set_coord(kind, real)
        return f"{kind}.{gid}"

    # -- slow path ------------------------------------------------------------------------
    def _default(self) -> Any:
        return self._dist.distributed_c10d._get_default_group()

    def _pg_name(self, pg: Any) -> str:
        try:
            return str(self._dist.distributed_c10d._get_process_group_name(pg))
        except Exception:
            return str(getattr(pg, "group_name", "") or id(pg))

    def _set_coord(self, kind: str, pg: Any) -> None:
        """This rank's coordinate in `kind` (its rank in `pg`) and the layout's size there."""
        try:
            r = int(self._dist.get_rank(pg))
        except Exception:
            return
        if r < 0:
            return
        self.coords[kind] = r
        if kind in LAYOUT_KINDS:
            try:
                self.sizes[kind] = int(self._dist.get_world_size(pg))
            except Exception:
                pass

    def _resolve(self, group: Any) -> GroupInfo:
        pg = group if group is not None else self._default()
        info = self._counters.get(pg)
        if info is None:
            default = self._default()
            tag = self._tags.get(pg)
            if tag is None:
                desc = str(getattr(pg, "group_desc", "") or "")
                m = _DESC_KIND.search(desc.lower())
                if m is not None and pg is not default:
                    tag = (m.group(1), self._pg_name(pg))
                    self._set_coord(tag[0], pg)
                elif pg is default:
                    tag = ("world", "0")
                else:
                    tag = ("pg", self._pg_name(pg))
            info = GroupInfo(tag[0], tag[1], int(self._dist.get_rank()), pg)
            info.gpu = self.gpu and self._on_nccl(pg)
            self._counters[pg] = info
        elif info.name != self._tagged_name(pg, info):
            # Tagged after first use: keep the counter, take the new name.
            kind, gid = self._tags[pg]
            renamed = GroupInfo(kind, gid, info.me, pg)
            renamed.seq, renamed.gpu = info.seq, info.gpu
            self._counters[pg] = info = renamed
        self._infos[group] = info
        return info

    def _on_nccl(self, pg: Any) -> bool:
        """Whether `pg` runs (some of) its ops on NCCL ("nccl", or "cpu:gloo,cuda:nccl", where
        the tensor's device then decides)."""
        try:
            return "nccl" in str(self._dist.get_backend(pg)).lower()
        except Exception:
            return False

    def _tagged_name(self, pg: Any, info: GroupInfo) -> str:
        tag = self._tags.get(pg)
        return info.name if tag is None else f"{tag[0]}.{tag[1]}"
