"""The rank hook: one call in a training script makes torch.distributed report to Flare.

    from producers import torch_hook
    hook = torch_hook.install()                 # or install_from_env(): only if FLARE_AGENT=1
    hook.tag_group(tp_group, "tp")              # optional: name groups tp/dp/pp/ep/cp
    hook.instrument_module(model)               # fwd/bwd phases from module hooks
    ...                                         # steps end at optimizer.step() (or hook.step())

What it records (DESIGN §3): every collective and p2p call (kind, name, group, per-group seq,
start, duration until completion, input bytes), compute phases (module hooks, `phase()`),
named host stalls (GC, DataLoader waits, checkpoint saves, `stall()`; `stalls`), and step
boundaries (the optimizer's step, or explicit `step()` calls, which then take over). On CUDA,
communication on NCCL groups and the compute phases are also timed on the GPU with CUDA
events (`gpu_timing`; FLARE_GPU_TIMING, on when CUDA is available). Ops
go to a per-rank op log; at step end the step is handed to a background sender that ships one
wire-v1 message to the node daemon (`flare agent`) over a Unix socket, and about every second
the rank's in-flight table. Nothing here blocks or raises into training: when the daemon is
away, steps are dropped and counted (`hook.client.stats`).

One hook per process (torch.distributed is process-global), which is why the module keeps the
active hook: `step()` / `phase()` at module level reach it from anywhere in a script.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from producers.torch_hook.buffer import COMPUTE, OpLog, RankMeta, Row
from producers.torch_hook.client import AgentClient
from producers.torch_hook.exits import ExitReporter
from producers.torch_hook.gpu_timing import GpuSpan, GpuTimer, gpu_timer, on_cuda
from producers.torch_hook.groups import GroupRegistry
from producers.torch_hook.patch import HookStats, Patcher
from producers.torch_hook.stacks import StackWatch, capture_if_due
from producers.torch_hook.stalls import StallPatches
from producers.torch_hook.wire import default_socket_path

_active: FlareHook | None = None


# Each setting and the environment variables it is read from, first found wins.
_ENV: dict[str, tuple[str, ...]] = {
    "agent": ("FLARE_AGENT",),
    "job": ("FLARE_JOB", "TORCHELASTIC_RUN_ID"),
    "node": ("FLARE_NODE", "SLURMD_NODENAME"),
    "job_nodes": ("FLARE_JOB_NODES", "SLURM_JOB_NODELIST"),
    "agent_socket": ("FLARE_AGENT_SOCKET",),
    "agent_interval_s": ("FLARE_AGENT_INTERVAL_S",),
    "local_rank": ("FLARE_LOCAL_RANK", "LOCAL_RANK"),
    "stacks_after_s": ("FLARE_STACKS_AFTER_S",),
    "gpu_timing": ("FLARE_GPU_TIMING",),
    "nccl_timing": ("TORCH_NCCL_ENABLE_TIMING",),
}


class HookSettings(BaseModel):
    """Environment of the hook inside a training process (read once, at `install`).

    Separate from `flare.settings.Settings` because a trainer needs none of the broker or
    database settings, only how to reach its node's daemon and who it is. Read by
    `from_env` with pydantic's parsing (FLARE_AGENT=1/true/yes, names in any case), not by
    pydantic-settings: the training-node side stays on the plain dependencies, and the
    producers depend on no settings machinery (the import-linter contract).
    """

    model_config = ConfigDict(extra="ignore")

    agent: bool = Field(False, description="FLARE_AGENT=1 turns the hook on (install_from_env)")
    job: str = Field("", description="job id, equal on every rank (or TORCHELASTIC_RUN_ID)")
    node: str = Field("", description="node name (FLARE_NODE, else Slurm's SLURMD_NODENAME); "
                      "default: the host name")
    job_nodes: str = Field("", description="the job's nodes as a Slurm host list "
                           "(FLARE_JOB_NODES, else SLURM_JOB_NODELIST), for the job's start")
    agent_socket: str = Field("", description="Unix socket of the node daemon")
    agent_interval_s: float = Field(1.0, description="period of the in-flight table")
    local_rank: int | None = Field(None, description="FLARE_LOCAL_RANK, else LOCAL_RANK")
    stacks_after_s: float = Field(5.0, description="a step lasting this long (and 1.5 usual "
                                  "steps) sends every thread's stack (hang forensics)")
    gpu_timing: bool | Literal["auto"] = Field(
        "auto", description="FLARE_GPU_TIMING: time ops on the GPU with CUDA events "
        "(auto: when CUDA is available)")
    nccl_timing: bool = Field(False, description="TORCH_NCCL_ENABLE_TIMING, torch's own "
                              "switch: NCCL times its kernels, async collectives use it")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HookSettings:
        """The settings of this process's environment (or of `environ`)."""
        env = {k.lower(): v for k, v in (os.environ if environ is None else environ).items()}
        found: dict[str, str] = {}
        for name, variables in _ENV.items():
            for var in variables:
                if var.lower() in env:
                    found[name] = env[var.lower()]
                    break
        return cls.model_validate(found)

    def resolved_job(self) -> str:
        return self.job if self.job and self.job != "none" else "torch-job"


class FlareHook:
    """All hook state of one process: op log, groups, patches, sender."""

    def __init__(
        self,
        *,
        job: str,
        node: str,
        socket_path: Path | str,
        interval_s: float = 1.0,
        local_rank: int | None = None,
        step_on_optimizer: bool = True,
        clock: Callable[[], int] = time.time_ns,
        dist: Any = None,
        stacks_after_s: float = 5.0,
        job_nodes: str = "",
        gpu: GpuTimer | None = None,
    ) -> None:
        if dist is None:
            import torch.distributed as dist
        self.dist = dist
        self.job = job
        self.node = node
        self.local_rank = local_rank
        self.step_on_optimizer = step_on_optimizer
        self.explicit_steps = False
        self.log = OpLog(clock)
        self.gpu = gpu  # GPU-side timing (`gpu_timing`); None: host times only
        self.groups = GroupRegistry(dist, gpu=gpu is not None)
        self.stats = HookStats()
        self.patcher = Patcher(dist, self.log, self.groups, self.stats, gpu)
        self.stalls = StallPatches(self.log, self.stats)
        self.watch = StackWatch(after_s=stacks_after_s)
        self.client = AgentClient(socket_path, self.meta, self._table,
                                  interval_s=interval_s, clock=clock, gpu=gpu)
        self.exits = ExitReporter(socket_path)
        self.client.farewell = lambda: self.exits.report
        self.client.job_nodes = job_nodes
        self._coords: dict[str, int] = {}
        self._handles: list[Any] = []
        self._meta: RankMeta | None = None
        self._opt_rows: dict[int, Row] = {}
        self._opt_spans: dict[int, GpuSpan | None] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def install(self) -> FlareHook:
        import torch.optim.optimizer as optim

        self.patcher.install()
        self.stalls.install()
        self.exits.install()
        self.client.fault_file = self.exits.fault_file
        self._handles.append(optim.register_optimizer_step_pre_hook(self._opt_pre))
        self._handles.append(optim.register_optimizer_step_post_hook(self._opt_post))
        self.client.start()
        return self

    def uninstall(self, timeout_s: float = 2.0) -> None:
        """Restore torch.distributed, send what is queued, close the socket."""
        global _active
        if _active is self:
            _active = None
        self.patcher.uninstall()
        self.stalls.uninstall()
        self.exits.uninstall()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.client.close(timeout_s)

    def meta(self) -> RankMeta | None:
        """Who this rank is; None until torch.distributed is initialised (or RANK is set)."""
        if self._meta is None:
            if self.dist.is_available() and self.dist.is_initialized():
                rank, world = int(self.dist.get_rank()), int(self.dist.get_world_size())
            else:
                return None
            local = self.local_rank if self.local_rank is not None else rank
            self._meta = RankMeta(self.job, rank, self.node, local, world)
        self._meta.coords = {**self.groups.coords, **self._coords}
        return self._meta

    # -- user API --------------------------------------------------------------------------
    def step(self) -> None:
        """End the current training step (from now on, the optimizer no longer does)."""
        self.explicit_steps = True
        self._cut()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a compute phase: `with hook.phase("fwd"): ...` (on the GPU too, when on)."""
        row = self.log.begin(COMPUTE, name, "", -1, 0)
        span = self.gpu.start(row) if self.gpu is not None else None
        try:
            yield
        finally:
            if self.gpu is not None:
                self.gpu.stop(span)
            self.log.end(row)

    def stall(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time a host-side wait by name (`with hook.stall("eval"): ...` → `host:eval`):
        the rank does not compute meanwhile, and an incident can say where its time went."""
        return self.stalls.stall(name)

    def tag_group(self, pg: Any, kind: str, index: int | str | None = None) -> str:
        """Name a process group `<kind>.<index>` (kind: tp, dp, pp, ep, cp); returns the name."""
        return self.groups.tag(pg, kind, index)

    def set_coords(self, **coords: int) -> None:
        """Say the rank's position (tp=, pp=, dp=, ep=, cp=) when tagging cannot tell it."""
        self._coords.update({k: int(v) for k, v in coords.items()})

    def instrument_module(self, module: Any) -> None:
        """Time `module`'s forward ("fwd") and the backward pass through it ("bwd")."""
        import torch
        from torch.utils._pytree import tree_leaves

        log, stats, gpu = self.log, self.stats, self.gpu
        state: dict[str, Row] = {}
        spans: dict[str, GpuSpan | None] = {}  # GPU timing, when the module is on CUDA
        engine = torch.autograd.Variable._execution_engine

        def bwd_end() -> None:
            row = state.pop("bwd", None)
            if row is not None:
                if gpu is not None:  # final callbacks run after the caller's stream has
                    gpu.stop(spans.pop("bwd", None))  # waited for the backward's streams
                log.end(row)

        def bwd_start(_grad: Any) -> None:
            try:
                if "bwd" not in state:
                    state["bwd"] = row = log.begin(COMPUTE, "bwd", "", -1, 0)
                    if gpu is not None:
                        spans["bwd"] = gpu.start(row) if on_cuda(module) else None
                    engine.queue_callback(bwd_end)
            except Exception as exc:
                stats.error(exc)

        def pre(_mod: Any, _inputs: Any) -> None:
            try:
                state["fwd"] = row = log.begin(COMPUTE, "fwd", "", -1, 0)
                if gpu is not None:
                    spans["fwd"] = gpu.start(row) if on_cuda(module) else None
            except Exception as exc:
                stats.error(exc)

        def post(_mod: Any, _inputs: Any, output: Any) -> None:
            try:
                row = state.pop("fwd", None)
                if row is not None:
                    if gpu is not None:
                        gpu.stop(spans.pop("fwd", None))
                    log.end(row)
                if torch.is_grad_enabled():
                    for leaf in tree_leaves(output):
                        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                            leaf.register_hook(bwd_start)
                            break
            except Exception as exc:
                stats.error(exc)

        self._handles.append(module.register_forward_pre_hook(pre))
        self._handles.append(module.register_forward_hook(post))

    def instrument_ddp(self, ddp_model: Any) -> None:
        """Route DDP's gradient all-reduces through torch.distributed.all_reduce (timed).

        DDP's reducer calls the process group from C++, past any Python wrapper; its default
        comm hook, registered explicitly, does the same all-reduce through the Python API. The
        hook's state is the model's own process group: with none, the default hook reduces
        over the whole world, which for a DDP over a data-parallel subgroup would both change
        the training and report every replica's gradients as one world collective.
        """
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp_model.register_comm_hook(getattr(ddp_model, "process_group", None),
                                     default_hooks.allreduce_hook)

    # -- internals -------------------------------------------------------------------------
    def _cut(self) -> None:
        # whoever ends steps trains: its data and checkpoint calls are the rank's stalls
        self.stalls.training_thread = threading.get_ident()
        try:
            cut = self.log.cut()
            if self.gpu is not None:
                cut.gpu = self.gpu.take()
            self.watch.step_done(cut.boundary_ns - cut.t_start_ns)
            self.client.submit(cut)
        except Exception as exc:
            self.stats.error(exc)

    def _table(self) -> dict[str, Any]:
        """The in-flight table the sender thread sends about every second, with every
        thread's stack when the current step has lasted far past the usual (`stacks`), and
        the layout its tagged groups tell (rank 0's agent starts the job with it)."""
        table = self.log.inflight()
        if self.groups.sizes:
            table["layout"] = dict(self.groups.sizes)
        stacks = capture_if_due(self.watch, self.log.step_t0, self.log.clock(),
                                lambda: self.stalls.training_thread)
        if stacks is not None:
            table.update(stacks)
        return table

    def _opt_pre(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        try:
            self._opt_rows[id(opt)] = row = self.log.begin(COMPUTE, "optimizer", "", -1, 0)
            if self.gpu is not None and on_cuda(opt):
                self._opt_spans[id(opt)] = self.gpu.start(row)
        except Exception as exc:
            self.stats.error(exc)

    def _opt_post(self, opt: Any, _args: Any, _kwargs: Any) -> None:
        row = self._opt_rows.pop(id(opt), None)
        if row is not None:
            if self.gpu is not None:
                self.gpu.stop(self._opt_spans.pop(id(opt), None))
            self.log.end(row)
        if self.step_on_optimizer and not self.explicit_steps:
            self._cut()


def install(settings: HookSettings | None = None, **overrides: Any) -> FlareHook:
    """Instrument torch.distributed in this process (idempotent); returns the hook.

    `overrides` are FlareHook arguments (job, node, socket_path, interval_s, ...) that win
    over the environment.
    """
    global _active
    if _active is not None:
        return _active
    s = settings or HookSettings.from_env()
    kwargs: dict[str, Any] = {
        "job": s.resolved_job(),
        "node": s.node or socket.gethostname(),
        "socket_path": s.agent_socket or default_socket_path(),
        "interval_s": s.agent_interval_s,
        "local_rank": s.local_rank,
        "stacks_after_s": s.stacks_after_s,
        "job_nodes": s.job_nodes,
    }
    kwargs.update(overrides)
    if "gpu" not in kwargs:
        kwargs["gpu"] = gpu_timer(s.gpu_timing, nccl_timing=s.nccl_timing,
                                  clock=kwargs.get("clock", time.time_ns))
    hook = FlareHook(**kwargs).install()
    _active = hook
    atexit.register(_close_at_exit, hook)
    return hook


def install_from_env(settings: HookSettings | None = None) -> FlareHook | None:
    """`install()` when FLARE_AGENT=1 is set (the torchrun way), else do nothing."""
    s = settings or HookSettings.from_env()
    return install(s) if s.agent else None


def uninstall() -> None:
    """Uninstall the active hook, if any."""
    if _active is not None:
        _active.uninstall()


def active() -> FlareHook | None:
    return _active


def step() -> None:
    """End the training step of the active hook (no-op without one)."""
    if _active is not None:
        _active.step()


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """Time a compute phase on the active hook (a no-op context without one)."""
    return _active.phase(name) if _active is not None else contextlib.nullcontext()


def stall(name: str) -> contextlib.AbstractContextManager[None]:
    """Time a named host stall on the active hook (a no-op context without one)."""
    return _active.stall(name) if _active is not None else contextlib.nullcontext()


def _close_at_exit(hook: FlareHook) -> None:
    if hook is _active:
        with contextlib.suppress(Exception):
            hook.client.close(1.0)


__all__ = ["FlareHook", "HookSettings", "active", "install", "install_from_env", "phase",
           "stall", "step", "uninstall"]
