"""Wrapping the torch.distributed communication functions so every call becomes an op row.

Each wrapper times the outermost call only (torch's own functions call each other, e.g.
`send` calls `isend`), reads the group and input size from the arguments by position or
keyword, and for async ops stops the clock on completion: a future callback for collectives
(exact completion, even if the caller waits late) and, where the backend has no futures
(gloo send/recv), a thin proxy around the returned Work that stops it on `wait()` or on a
positive `is_completed()`. Bookkeeping never raises into training: a failure there is
counted and the original function runs untouched.

On a GPU group (`GroupInfo.gpu`: NCCL, with GPU timing on) a call with a CUDA tensor also
records CUDA events around the op (`gpu_timing`): a start event before the call, an end event
after a synchronous one, in an async one's future callback or after its `wait()`. The host
times are kept as before; the sender replaces them with the GPU's when the events resolve.
The CPU/gloo path pays one attribute read (`info.gpu`) for this.

Both `torch.distributed.<fn>` and `torch.distributed.distributed_c10d.<fn>` are replaced, so
calls through either name (and torch's internal calls) are seen; code that imported a function
by name before `install()` keeps the original (install first).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from producers.torch_hook.buffer import COLL, P2P, OpLog, Row, seal
from producers.torch_hook.gpu_timing import GpuSpan, GpuTimer
from producers.torch_hook.groups import GroupRegistry


@dataclass(frozen=True, slots=True)
class CollSpec:
    """Where a collective keeps its input tensor(s), group and async flag."""

    wire: str
    tensor: tuple[int, str] | None
    is_list: bool
    group: tuple[int, str]
    async_op: tuple[int, str] | None


COLLECTIVES: dict[str, CollSpec] = {
    "all_reduce": CollSpec("all_reduce", (0, "tensor"), False, (2, "group"), (3, "async_op")),
    "all_reduce_coalesced": CollSpec("all_reduce", (0, "tensors"), True, (2, "group"),
                                     (3, "async_op")),
    "all_gather": CollSpec("all_gather", (1, "tensor"), False, (2, "group"), (3, "async_op")),
    "all_gather_into_tensor": CollSpec("all_gather", (1, "input_tensor"), False, (2, "group"),
                                       (3, "async_op")),
    "all_gather_single": CollSpec("all_gather", (1, "input_tensor"), False, (2, "group"),
                                  (3, "async_op")),
    "reduce_scatter": CollSpec("reduce_scatter", (1, "input_list"), True, (3, "group"),
                               (4, "async_op")),
    "reduce_scatter_tensor": CollSpec("reduce_scatter", (1, "input"), False, (3, "group"),
                                      (4, "async_op")),
    "reduce_scatter_single": CollSpec("reduce_scatter", (1, "input"), False, (3, "group"),
                                      (4, "async_op")),
    "broadcast": CollSpec("broadcast", (0, "tensor"), False, (2, "group"), (3, "async_op")),
    "barrier": CollSpec("barrier", None, False, (0, "group"), (1, "async_op")),
    "all_to_all_single": CollSpec("all_to_all", (1, "input"), False, (4, "group"),
                                  (5, "async_op")),
    "all_to_all": CollSpec("all_to_all", (1, "input_tensor_list"), True, (2, "group"),
                           (3, "async_op")),
    "reduce": CollSpec("reduce", (0, "tensor"), False, (3, "group"), (4, "async_op")),
    "gather": CollSpec("gather", (0, "tensor"), False, (3, "group"), (4, "async_op")),
    "scatter": CollSpec("scatter", (0, "tensor"), False, (3, "group"), (4, "async_op")),
}
# Functions that only call another patched one (torch 2.13): patching the target is enough.
ALIASES = {"all_gather_into_tensor": "all_gather_single",
           "reduce_scatter_tensor": "reduce_scatter_single"}
# name -> (wire name, is send, always async)
P2PS: dict[str, tuple[str, bool, bool]] = {
    "send": ("send", True, False),
    "recv": ("recv", False, False),
    "isend": ("send", True, True),
    "irecv": ("recv", False, True),
}


def _on_cuda(tensor: Any, is_list: bool = False) -> bool:
    """Whether an op's input is on a CUDA device (a list: its first tensor)."""
    if is_list:
        tensor = tensor[0] if tensor else None
    return bool(getattr(tensor, "is_cuda", False))


def _nbytes(obj: Any, is_list: bool) -> int:
    if obj is None:
        return 0
    if is_list:
        return sum(int(t.nbytes) for t in obj)
    return int(obj.nbytes)


class TimedWork:
    """A Work whose completion stops an op's clock (for backends without futures).

    With GPU spans, `wait()` also records their end events: once it returns, the caller's
    stream waits for the op, so an event recorded now runs when the op has ended on the GPU.
    A positive `is_completed()` records none (the stream may be far past the op by then).
    """

    __slots__ = ("_work", "_log", "_rows", "_spans", "_gpu")

    def __init__(self, work: Any, log: OpLog, rows: list[Row],
                 spans: list[GpuSpan | None] | None = None, gpu: GpuTimer | None = None) -> None:
        self._work = work
        self._log = log
        self._rows = rows
        self._spans = spans
        self._gpu = gpu

    def _done(self) -> None:
        for row in self._rows:
            self._log.end(row)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        if self._spans and self._gpu is not None:
            for span in self._spans:
                self._gpu.stop(span)
        self._done()
        return out

    def is_completed(self) -> bool:
        done = bool(self._work.is_completed())
        if done:
            self._done()
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@dataclass(slots=True)
class HookStats:
    """What the hook did that a user may want to know; never raised, only counted."""

    hook_errors: int = 0
    first_error: str = ""

    def error(self, exc: BaseException) -> None:
        """Count `exc`; never raises (it runs inside callbacks the interpreter calls)."""
        self.hook_errors += 1
        if not self.first_error:
            try:
                self.first_error = f"{type(exc).__name__}: {exc}"
            except Exception:  # an exception whose str() itself fails
                self.first_error = type(exc).__name__


class Patcher:
    """Installs and removes the wrappers on one torch.distributed module."""

    def __init__(self, dist: Any, log: OpLog, groups: GroupRegistry, stats: HookStats,
                 gpu: GpuTimer | None = None) -> None:
        self.dist = dist
        self.log = log
        self.groups = groups
        self.stats = stats
        self.gpu = gpu  # GPU timing; groups mark themselves `gpu` only when it is on
        self.local = threading.local()
        self._saved: dict[str, Callable[..., Any]] = {}

    # -- install -------------------------------------------------------------------------
    def install(self) -> None:
        if self._saved:
            return
        c10d = self.dist.distributed_c10d
        wrappers: dict[str, Callable[..., Any]] = {}
        for fname, spec in COLLECTIVES.items():
            if hasattr(c10d, fname) and not hasattr(c10d, ALIASES.get(fname, "-")):
                wrappers[fname] = self._wrap_coll(getattr(c10d, fname), spec)
        for fname, (wire, is_send, always_async) in P2PS.items():
            wrappers[fname] = self._wrap_p2p(getattr(c10d, fname), wire, is_send, always_async)
        wrappers["batch_isend_irecv"] = self._wrap_batch(c10d.batch_isend_irecv)
        for fname in ("destroy_process_group", "init_process_group"):
            wrappers[fname] = self._wrap_reset(getattr(c10d, fname))
        for fname, w in wrappers.items():
            self._saved[fname] = getattr(c10d, fname)
            setattr(c10d, fname, w)
            if getattr(self.dist, fname, None) is self._saved[fname]:
                setattr(self.dist, fname, w)

    def uninstall(self) -> None:
        c10d = self.dist.distributed_c10d
        for fname, orig in self._saved.items():
            setattr(c10d, fname, orig)
            setattr(self.dist, fname, orig)
        self._saved.clear()

    # -- wrappers ------------------------------------------------------------------------
    def _wrap_reset(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        groups = self.groups

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return orig(*args, **kwargs)
            finally:
                groups.clear()

        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        wrapper.__name__ = orig.__name__
        return wrapper

    def _wrap_coll(self, orig: Callable[..., Any], spec: CollSpec) -> Callable[..., Any]:
        # Hot path: everything it touches is bound to a local name here, and the op log's
        # begin/end are inlined (a method call costs as much as the row itself). A synchronous
        # op on the CPU path is logged as a tuple, replaced by its finished tuple in the same
        # slot when the call returns: the step's rows then hold nothing the cyclic GC walks
        # (`buffer`'s module doc). Async and GPU-timed ops keep a list row (`OpLog.begin`),
        # which a callback, a Work or the GPU timer ends later.
        log, groups, stats = self.log, self.groups, self.stats
        infos, rows, pending, clock = groups._infos, log.rows_ref, log.pending, log.clock
        wire, is_list = spec.wire, spec.is_list
        t_pos, t_kw = spec.tensor if spec.tensor else (-1, "")
        g_pos, g_kw = spec.group
        a_pos, a_kw = spec.async_op if spec.async_op else (-1, "")
        patcher = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # No reentrancy guard here: no patched collective calls another one (the aliases
            # all_gather_into_tensor / reduce_scatter_tensor are left unpatched, see install).
            try:
                n = len(args)
                group = args[g_pos] if n > g_pos else kwargs.get(g_kw)
                info = infos.get(group) or groups.get(group)
                if t_pos < 0:
                    nbytes = 0
                elif is_list:
                    nbytes = _nbytes(args[t_pos] if n > t_pos else kwargs.get(t_kw), True)
                else:
                    t = args[t_pos] if n > t_pos else kwargs.get(t_kw)
                    nbytes = t.nbytes if t is not None else 0
                seq = info.seq
                info.seq = seq + 1
                is_async = args[a_pos] if n > a_pos >= 0 else kwargs.get(a_kw, False)
                if is_async or info.gpu:
                    row: Row | None = log.begin(COLL, wire, info.name, seq, nbytes,
                                                not is_async)
                else:
                    row = None
                    step = rows[0]
                    gname = info.name
                    start = clock()
                    flying = (COLL, wire, gname, seq, start, -1, nbytes, True)
                    step.append(flying)
                    key = id(flying)
                    pending[key] = flying
            except Exception as exc:
                stats.error(exc)
                return orig(*args, **kwargs)
            if row is not None:
                if info.gpu:
                    return patcher._gpu_coll(orig, args, kwargs, row, is_async, spec)
                return patcher._async_coll(orig, args, kwargs, row)
            try:
                return orig(*args, **kwargs)
            finally:  # the op ends when the call returns or raises
                done = (COLL, wire, gname, seq, start, clock(), nbytes, True)
                if step[-1] is flying:  # nothing was logged meanwhile (nearly always)
                    step[-1] = done
                else:
                    seal(step, flying, done)
                pending.pop(key, None)

        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        wrapper.__name__ = orig.__name__
        wrapper.__doc__ = orig.__doc__
        return wrapper

    def _async_coll(self, orig: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any], row: Row) -> Any:
        """The rest of an async collective on the CPU path, once its row is logged."""
        out = self._call(orig, args, kwargs, row)
        if out is None:
            self.log.end(row)
            return out
        return self._on_completion(out, [row])

    def _call(self, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              row: Row) -> Any:
        """The original call; a call that raises ends its row (it will not complete)."""
        try:
            return orig(*args, **kwargs)
        except BaseException:
            self.log.end(row)
            raise

    def _gpu_start(self, row: Row, on_cuda: bool) -> GpuSpan | None:
        return self.gpu.start(row) if on_cuda and self.gpu is not None else None

    def _gpu_stop(self, span: GpuSpan | None) -> None:
        if span is not None and self.gpu is not None:
            self.gpu.stop(span)

    def _gpu_coll(self, orig: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  row: Row, is_async: bool, spec: CollSpec) -> Any:
        """The rest of a collective on a GPU group, once its row is logged: CUDA events around
        the call when its input is on CUDA (a barrier has none: NCCL runs it on the GPU)."""
        span = None
        try:
            if spec.tensor is None:
                on_cuda = True
            else:
                pos, kw = spec.tensor
                on_cuda = _on_cuda(args[pos] if len(args) > pos else kwargs.get(kw), spec.is_list)
            span = self._gpu_start(row, on_cuda)
        except Exception as exc:
            self.stats.error(exc)
        out = self._call(orig, args, kwargs, row)
        if not is_async or out is None:
            self._gpu_stop(span)  # the caller's stream now waits for NCCL's: the op's end
            self.log.end(row)
            return out
        if span is None:
            return self._on_completion(out, [row])
        if self.gpu is not None:
            self.gpu.attach(span, out)
        return self._on_completion(out, [row], [span])

    def _peer(self, info: Any, args: tuple[Any, ...], kwargs: dict[str, Any], is_send: bool,
              group: Any) -> int:
        """Global rank of the other end (-1: any source)."""
        peer = args[1] if len(args) > 1 else kwargs.get("dst" if is_send else "src")
        if peer is not None:
            return int(peer)
        gpeer = args[4] if len(args) > 4 else kwargs.get("group_dst" if is_send else "group_src")
        if gpeer is None:
            return -1
        pg = group if group is not None else info.pg
        return int(self.dist.get_global_rank(pg, int(gpeer)))

    def _wrap_p2p(self, orig: Callable[..., Any], wire: str, is_send: bool,
                  always_async: bool) -> Callable[..., Any]:
        local, log, groups, stats = self.local, self.log, self.groups, self.stats
        patcher = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "busy", False):
                return orig(*args, **kwargs)
            local.busy = True
            span = None
            try:
                try:
                    group = args[2] if len(args) > 2 else kwargs.get("group")
                    info = groups.get(group)
                    peer = patcher._peer(info, args, kwargs, is_send, group)
                    src, dst = (info.me, peer) if is_send else (peer, info.me)
                    gname, seq = info.p2p_next(src, dst)
                    t = args[0] if args else kwargs.get("tensor")
                    row = log.begin(P2P, wire, gname, seq, _nbytes(t, False),
                                    blocks=not always_async)
                    if info.gpu:
                        span = patcher._gpu_start(row, _on_cuda(t))
                except Exception as exc:
                    stats.error(exc)
                    row = None
                try:
                    out = orig(*args, **kwargs)
                except BaseException:
                    if row is not None:
                        log.end(row)
                    raise
                if row is None:
                    return out
                if not always_async or out is None:
                    patcher._gpu_stop(span)
                    log.end(row)
                    return out
                if span is None:
                    return TimedWork(out, log, [row])
                if patcher.gpu is not None:
                    patcher.gpu.attach(span, out)
                return TimedWork(out, log, [row], [span], patcher.gpu)
            finally:
                local.busy = False

        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        wrapper.__name__ = orig.__name__
        wrapper.__doc__ = orig.__doc__
        return wrapper

    def _wrap_batch(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        local, log, groups, stats = self.local, self.log, self.groups, self.stats
        c10d = self.dist.distributed_c10d
        patcher, gpu = self, self.gpu

        def wrapper(p2p_op_list: Any) -> Any:
            if getattr(local, "busy", False):
                return orig(p2p_op_list)
            local.busy = True
            try:
                rows: list[Row] = []
                spans: list[GpuSpan | None] = []
                try:
                    for op in p2p_op_list:
                        info = groups.get(op.group)
                        is_send = op.op is c10d.isend or getattr(op.op, "__name__", "") == "isend"
                        src, dst = (info.me, op.peer) if is_send else (op.peer, info.me)
                        gname, seq = info.p2p_next(int(src), int(dst))
                        row = log.begin(P2P, "send" if is_send else "recv", gname, seq,
                                        _nbytes(op.tensor, False))
                        span = patcher._gpu_start(row, _on_cuda(op.tensor)) if info.gpu else None
                        rows.append(row)
                        spans.append(span)
                except Exception as exc:
                    stats.error(exc)
                try:
                    works = orig(p2p_op_list)
                except BaseException:
                    for row in rows:
                        log.end(row)
                    raise
                if not works:
                    for row in rows:
                        log.end(row)
                    return works
                if not any(spans):
                    spans = []
                if len(works) == len(rows):
                    return [TimedWork(w, log, [r], spans[i:i + 1], gpu)
                            for i, (w, r) in enumerate(zip(works, rows, strict=True))]
                # Coalesced: one work for the batch; every op ends when it does.
                return [TimedWork(w, log, rows, spans, gpu) for w in works]
            finally:
                local.busy = False

        wrapper.__wrapped__ = orig  # type: ignore[attr-defined]
        wrapper.__name__ = orig.__name__
        wrapper.__doc__ = orig.__doc__
        return wrapper

    def _on_completion(self, work: Any, rows: list[Row],
                       spans: list[GpuSpan | None] | None = None) -> Any:
        """Stop the rows' clock when `work` completes; returns what the caller should get.

        With a GPU span, the future callback also records the op's end event: torch runs it
        with a current stream made to wait on the Work's CUDA events (ivalue::Future::
        invokeCallback), so the event runs when the op has ended on the GPU.
        """
        log = self.log
        try:
            fut = work.get_future()
        except Exception:
            return TimedWork(work, log, rows, spans, self.gpu)
        row = rows[0]
        if not spans:
            fut.add_done_callback(lambda _f: log.end(row))
            return work
        span, stop = spans[0], self._gpu_stop

        def done(_f: Any) -> None:
            stop(span)
            log.end(row)

        fut.add_done_callback(done)
        return work
