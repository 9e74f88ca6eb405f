"""One rank of a drill's training: a small transformer, tensor-, pipeline- and data-parallel.

    python -m flare.drill.train --rank 3 --world 8 --per-node 2 --pp 2 --master 10.77.0.10:29500

The layout is Megatron's, shrunk to a few CPU processes on gloo:
- the ranks of a node are a tensor-parallel group: every layer all-reduces its output over it
  in the forward (a row-parallel layer) and its input's gradient in the backward (Megatron's
  `f` before a column-parallel one), so a step holds as many such collectives per layer as a
  production job's does, and a slow member delays every one of them;
- the nodes are split into `pp` pipeline stages, in order; a rank sends its activations to
  the rank with the same place on the matching node of the next stage, and the gradients
  come back the same way (GPipe: all microbatches forward, then all backward);
- the ranks with the same place in the nodes of one stage are a data-parallel group: after
  the backward they all-reduce their gradients, which crosses the nodes' NICs.

The Flare hook is installed before the process group exists (when FLARE_AGENT=1, the
torchrun way), tags every group and times the forward and backward, so the node's agent gets
what a production job's hook sends. A rank without it trains the same and reports nothing,
as an untraced rank of a production job does. Nothing here knows about faults: a drill slows,
limits, freezes or kills this process or its node from outside, as a real fault would.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

PROFILE_WINDOW = 10  # steps per profiler trace file (--profile)
_CLONE_NEWUTS = 0x04000000


@dataclass(frozen=True, slots=True)
class Place:
    """Where a rank sits: node, place in the node (tp), stage (pp), replica (dp)."""

    rank: int
    world: int
    per_node: int
    pp: int

    @property
    def nodes(self) -> int:
        return self.world // self.per_node

    @property
    def node(self) -> int:
        return self.rank // self.per_node

    @property
    def tp(self) -> int:
        return self.rank % self.per_node

    @property
    def stage_nodes(self) -> int:
        return self.nodes // self.pp

    @property
    def stage(self) -> int:
        return self.node // self.stage_nodes

    @property
    def dp(self) -> int:
        return self.node % self.stage_nodes

    def rank_at(self, stage: int, dp: int, tp: int) -> int:
        """The rank at (stage, replica, place in node).

        >>> p = Place(rank=0, world=8, per_node=2, pp=2)
        >>> [p.rank_at(s, d, t) for s in (0, 1) for d in (0, 1) for t in (0, 1)]
        [0, 1, 2, 3, 4, 5, 6, 7]
        """
        return (stage * self.stage_nodes + dp) * self.per_node + tp


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="flare.drill.train")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--per-node", type=int, required=True, help="ranks per node (= TP size)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (nodes split in order)")
    p.add_argument("--master", required=True, help="host:port of rank 0's rendezvous store")
    p.add_argument("--steps", type=int, default=1_000_000, help="stop after this many steps")
    p.add_argument("--batch", type=int, default=16, help="sequences per microbatch")
    p.add_argument("--micro", type=int, default=2, help="microbatches per step")
    p.add_argument("--width", type=int, default=128, help="model width (gradient size)")
    p.add_argument("--profile", default="",
                   help="also write PyTorch profiler (Kineto) traces here, a file per window "
                        "of steps, as a production job's profiler does")
    p.add_argument("--node-name", default="",
                   help="with --profile: the host name the traces carry (the rank's node)")
    a = p.parse_args(argv)
    if a.world % a.per_node or not 0 <= a.rank < a.world or (a.world // a.per_node) % a.pp:
        p.error("--world must be a multiple of --per-node, the nodes a multiple of --pp, "
                "and 0 <= --rank < --world")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # a drill (or a scheduler) ends training with SIGTERM: exit through Python, so the hook
    # says goodbye; only a rank that is killed or crashes hard vanishes without one
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit(0))
    import torch
    import torch.distributed as dist

    from producers import torch_hook

    torch.set_num_threads(1)
    hook = torch_hook.install_from_env()
    host, port = a.master.rsplit(":", 1)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=a.rank,
                            world_size=a.world)
    me = Place(a.rank, a.world, a.per_node, a.pp)
    # every rank creates every group, in the same order (torch.distributed requires it)
    tp_groups = {n: dist.new_group([n * a.per_node + i for i in range(a.per_node)])
                 for n in range(me.nodes)}
    dp_groups = {(s, t): dist.new_group([me.rank_at(s, d, t) for d in range(me.stage_nodes)])
                 for s in range(a.pp) for t in range(a.per_node)}
    pp_groups = {(d, t): dist.new_group([me.rank_at(s, d, t) for s in range(a.pp)])
                 for d in range(me.stage_nodes) for t in range(a.per_node)}
    tp, dp = tp_groups[me.node], dp_groups[(me.stage, me.tp)]
    pp = pp_groups[(me.dp, me.tp)]
    if hook is not None:
        hook.tag_group(tp, "tp", me.node)
        hook.tag_group(dp, "dp", me.stage * a.per_node + me.tp)
        hook.tag_group(pp, "pp", me.dp * a.per_node + me.tp)
        hook.set_coords(tp=me.tp, pp=me.stage, dp=me.dp)
    prev = me.rank_at(me.stage - 1, me.dp, me.tp) if me.stage > 0 else None
    nxt = me.rank_at(me.stage + 1, me.dp, me.tp) if me.stage < a.pp - 1 else None

    torch.manual_seed(me.stage)
    layer = torch.nn.TransformerEncoderLayer(d_model=a.width, nhead=4,
                                             dim_feedforward=2 * a.width, batch_first=True)
    body = torch.nn.TransformerEncoder(layer, num_layers=2)

    tp_size = a.per_node

    class ReduceGradOverTp(torch.autograd.Function):
        """Identity forward; the gradient all-reduced (averaged) over the node backward."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=tp)
            return grad / tp_size

    class Stage(torch.nn.Module):
        """This stage's layers, each between a backward and a forward all-reduce over the
        node, as a tensor-parallel layer is."""

        def __init__(self) -> None:
            super().__init__()
            self.body = body

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for each in self.body.layers:
                x = each(ReduceGradOverTp.apply(x))
                shared = x.detach().clone()
                dist.all_reduce(shared, group=tp)
                x = x + 0.0 * shared
            return x

    model = Stage()
    if hook is not None:
        hook.instrument_module(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=1e-4)
    gen = torch.Generator().manual_seed(a.rank)
    shape = (a.batch, 32, a.width)
    with contextlib.ExitStack() as stack:
        profiler = stack.enter_context(_profiler(a)) if a.profile else None
        for _ in range(a.steps):
            outs, ins = [], []
            for _mb in range(a.micro):  # forward of every microbatch
                if prev is None:
                    x = torch.randn(*shape, generator=gen)
                else:
                    x = torch.empty(shape)
                    dist.recv(x, prev, group=pp)
                    x.requires_grad_(True)
                y = model(x)
                if nxt is not None:
                    dist.send(y.detach(), nxt, group=pp)
                ins.append(x)
                outs.append(y)
            for x, y in zip(ins, outs, strict=True):  # then every backward
                if nxt is None:
                    y.pow(2).mean().backward()
                else:
                    g = torch.empty(shape)
                    dist.recv(g, nxt, group=pp)
                    y.backward(g)
                if prev is not None and x.grad is not None:
                    dist.send(x.grad, prev, group=pp)
            flat = torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None])
            dist.all_reduce(flat, group=dp)  # the data-parallel gradient reduction
            opt.step()
            opt.zero_grad()
            if profiler is not None:
                profiler.step()
    dist.barrier()
    torch_hook.uninstall()
    dist.destroy_process_group()


def _profiler(a: argparse.Namespace) -> Any:
    """A profiler of every step, written a window of `PROFILE_WINDOW` steps at a time, named
    by the rank's node: each node of a drill is a network namespace of one machine, so the
    rank takes its node's name as its host name, in a host-name namespace of its own."""
    import torch

    if a.node_name:
        _own_host_name(a.node_name)
    return torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU],
        schedule=torch.profiler.schedule(wait=0, warmup=0, active=PROFILE_WINDOW, repeat=0),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            a.profile, worker_name=f"{a.node_name or 'node'}_{a.rank}", use_gzip=True))


def _own_host_name(name: str) -> None:
    """This process's host name (a UTS namespace of its own; root only, else unchanged)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWUTS) == 0:
        raw = name.encode()
        libc.sethostname(raw, len(raw))


if __name__ == "__main__":
    main()
