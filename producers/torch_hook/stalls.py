"""Named host stalls: GC pauses, DataLoader waits and checkpoint saves become ops of their own.

A rank that waits on its host does not compute, yet without names the time is only an idle
gap: the diagnosis could say "idle +400 ms" but not "GC". Each stall is sent as a compute op
named `host:<what>` (the wire v1 convention of `schemas.rankstep.HOST_STALL_PREFIX`: group "",
seq -1 in the log, 0 bytes), begun as blocking, so a forward timed around a GC pause is cut
around it (`buffer.exclusive_compute`) and the step assembly counts it as idle time, by name:

- `host:gc`: every collection, from `gc.callbacks` (whichever thread ran it: the collector
  holds the interpreter, so every thread of the rank waited);
- `host:data`: each `__next__` of a DataLoader iterator, the call that ends an epoch
  included (a multi-worker loader joins its workers there);
- `host:checkpoint`: `torch.save`, and `torch.distributed.checkpoint`'s `save`,
  `save_state_dict` and `async_save` (its blocking part, the staging);
- `host:<name>`: a phase a user marks with `hook.stall(name)`.

Data and checkpoint calls count only on the training thread (the one that ends steps; until
the first step, the one that installed the hook): on any other thread they run beside
training, as `async_save`'s writer does with its `torch.save` calls, and the rank waited for
nothing.

Only the outermost of nested calls of one kind is timed (a checkpoint save that calls
`torch.save` is one stall, as is a dataset that reads from an inner DataLoader); stalls of
different kinds nest and are all recorded (a GC inside a `torch.save`). Like the
torch.distributed wrappers (`patch`), the wrappers are installed on the owning module or
class and restored by `uninstall`; code that bound `torch.save` by name before the hook was
installed keeps the original (install first).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from producers.torch_hook.buffer import COMPUTE, OpLog, Row
from producers.torch_hook.patch import HookStats
from schemas.rankstep import HOST_STALL_PREFIX

GC = f"{HOST_STALL_PREFIX}gc"
DATA = f"{HOST_STALL_PREFIX}data"
CHECKPOINT = f"{HOST_STALL_PREFIX}checkpoint"
# Where the checkpoint saves a training script calls live; the ones this torch lacks are skipped.
CHECKPOINT_SAVES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torch", ("save",)),
    ("torch.distributed.checkpoint", ("save", "save_state_dict", "async_save")),
)


class StallPatches:
    """The GC callback and the DataLoader and checkpoint wrappers of one hook."""

    def __init__(self, log: OpLog, stats: HookStats) -> None:
        self.log = log
        self.stats = stats
        # The collection in progress. Collections never overlap (the collector runs one at a
        # time, and its callbacks on the thread that triggered it), so one slot is enough.
        self._gc_row: Row | None = None
        self._restore: list[Callable[[], None]] = []
        self.training_thread = threading.get_ident()  # see the module doc; FlareHook updates it
        self._timing: set[str] = set()  # the stall kinds the training thread is in already

    # -- install / uninstall -------------------------------------------------------------
    def install(self) -> None:
        """Register the GC callback and wrap the data and checkpoint calls. Distributed
        checkpointing is imported here (once, about half a second) so that a script importing
        it after the hook (any script the launcher runs) is covered too."""
        if self._restore:
            return
        self.training_thread = threading.get_ident()
        from torch.utils.data.dataloader import _BaseDataLoaderIter

        gc.callbacks.append(self._on_gc)
        self._restore.append(self._remove_gc_callback)
        self._wrap(_BaseDataLoaderIter, "__next__", DATA)
        for module, attrs in CHECKPOINT_SAVES:
            try:
                owner = importlib.import_module(module)
            except ImportError:  # a torch built without distributed checkpointing
                continue
            for attr in attrs:
                if hasattr(owner, attr):
                    self._wrap(owner, attr, CHECKPOINT)

    def uninstall(self) -> None:
        """Put every original back; a collection caught half-way ends now, not never."""
        while self._restore:
            self._restore.pop()()
        row, self._gc_row = self._gc_row, None
        if row is not None:
            self.log.end(row)

    def _remove_gc_callback(self) -> None:
        with contextlib.suppress(ValueError):  # someone else took it out already
            gc.callbacks.remove(self._on_gc)

    def _wrap(self, owner: Any, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        begin, end, stats, timing = self.log.begin, self.log.end, self.stats, self._timing
        get_ident, patches = threading.get_ident, self

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if name in timing or get_ident() != patches.training_thread:
                return original(*args, **kwargs)
            try:
                row = begin(COMPUTE, name, "", -1, 0, True)
            except Exception as exc:  # bookkeeping never raises into training
                stats.error(exc)
                return original(*args, **kwargs)
            timing.add(name)
            try:
                return original(*args, **kwargs)
            finally:
                timing.discard(name)
                end(row)

        setattr(owner, attr, timed)
        self._restore.append(lambda: setattr(owner, attr, original))

    # -- the stalls ----------------------------------------------------------------------
    def _on_gc(self, phase: str, _info: dict[str, int]) -> None:
        """A collection starts or stops (called by the interpreter, which must never see an
        exception from here). A stop whose start this hook did not see (installed during
        the collection) is ignored; a start while a row is open means a stop was lost, and
        the open row ends there rather than running on as in flight."""
        try:
            row = self._gc_row
            if phase == "start":
                if row is not None:
                    self.log.end(row)
                self._gc_row = self.log.begin(COMPUTE, GC, "", -1, 0, True)
            elif phase == "stop" and row is not None:
                self._gc_row = None
                self.log.end(row)
        except Exception as exc:
            self.stats.error(exc)

    @contextlib.contextmanager
    def stall(self, name: str) -> Iterator[None]:
        """Time a host phase a user names: `with hook.stall("eval"): ...` → `host:eval`."""
        row = self.log.begin(COMPUTE, f"{HOST_STALL_PREFIX}{name}", "", -1, 0, True)
        try:
            yield
        finally:
            self.log.end(row)
