"""Overhead of the Flare torch hook: cost per instrumented op, and step-time overhead on
real gloo training (goals: < 2 µs per op, < 1 % of step time).

    python load-tests/bench_hook_overhead.py [--ranks 4] [--steps 60] [--repeats 3]
        [--d-model 64] [--layers 2] [--seq 32] [--skip-op-cost] [--cpu-time]

Part 1 times the hook's own work per call: the wrapper around a do-nothing collective (what
the hook adds to any backend), and a real one-rank gloo all_reduce with and without the hook.
With `--cpu-time` it counts the calling thread's CPU time instead of the wall clock: on a
machine shared with other jobs, their time slices then stay out of the figures (gloo's own
threads do too, so the gloo figures are then only the calling thread's part).
Part 2 trains a small transformer with DDP on `--ranks` gloo processes, alternately with and
without the hook (daemon running, in this process), and compares median step times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]


# -- part 1: per-op cost -----------------------------------------------------------------------
_clock = time.perf_counter_ns  # part 1's clock (`--cpu-time`: time.thread_time_ns)


def _per_call_ns(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = _clock()
        for _ in range(n):
            fn()
        best = min(best, (_clock() - t0) / n)
    return best


def op_cost(n: int = 200_000) -> dict[str, float]:
    import torch
    import torch.distributed as dist

    from producers.torch_hook.buffer import OpLog
    from producers.torch_hook.groups import GroupRegistry
    from producers.torch_hook.patch import HookStats, Patcher

    # (a) the wrapper alone, around a collective that does nothing
    class PG:
        group_name, group_desc = "0", "default_pg"

    world = PG()

    def all_reduce(tensor, op=None, group=None, async_op=False):
        return None

    c10d = SimpleNamespace(all_reduce=all_reduce, _get_default_group=lambda: world,
                           _get_process_group_name=lambda pg: "0")
    fake = SimpleNamespace(distributed_c10d=c10d, get_rank=lambda group=None: 0,
                           all_reduce=all_reduce)
    for name in ("isend", "irecv", "send", "recv", "batch_isend_irecv",
                 "destroy_process_group", "init_process_group"):
        setattr(c10d, name, all_reduce)
    log = OpLog()
    p = Patcher(fake, log, GroupRegistry(fake), HookStats())
    t = torch.ones(4)
    holder = log.rows_ref
    ops_per_step = [10_000]

    def call() -> None:  # the same loop body with and without the hook
        c10d.all_reduce(t)
        if len(holder[0]) >= ops_per_step[0]:  # steps end now and then in real training
            log.cut()

    bare = _per_call_ns(call, n)
    # The rows of the current step live until the step ends. They used to be lists, which the
    # interpreter's garbage collector walked again and again, so the cost per op grew with the
    # step; they are now tuples it stops tracking at its first look (`buffer`). That one look
    # per op is missing from the smaller steps here, whose rows a cut frees before any
    # collection comes (this loop allocates nothing else); in training, collections come
    # anyway. Real steps hold hundreds to a few thousand ops.
    by_step: dict[str, float] = {}
    p.install()
    for size in (100, 1_000, 10_000):
        ops_per_step[0] = size
        by_step[f"wrapper_ns_at_{size}_ops_per_step"] = _per_call_ns(call, n) - bare
    hooked = by_step["wrapper_ns_at_10000_ops_per_step"] + bare
    p.uninstall()

    # (b) a real one-rank gloo all_reduce
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    m = max(n // 20, 2000)
    real = _per_call_ns(lambda: dist.all_reduce(t), m)
    log2 = OpLog()
    p2 = Patcher(dist, log2, GroupRegistry(dist), HookStats())
    p2.install()

    def real_hooked() -> None:
        dist.all_reduce(t)
        if len(log2.rows) > 10_000:
            log2.cut()

    real_h = _per_call_ns(real_hooked, m)
    w = dist.all_reduce(t, async_op=True)
    w.wait()

    def real_async() -> None:
        dist.all_reduce(t, async_op=True).wait()
        if len(log2.rows) > 10_000:
            log2.cut()

    real_async_h = _per_call_ns(real_async, m)
    p2.uninstall()
    real_async_b = _per_call_ns(lambda: dist.all_reduce(t, async_op=True).wait(), m)
    dist.destroy_process_group()
    return {
        **by_step,
        "wrapper_only_ns": hooked - bare,
        "gloo_all_reduce_ns": real,
        "gloo_all_reduce_hooked_ns": real_h,
        "gloo_sync_overhead_ns": real_h - real,
        "gloo_async_all_reduce_ns": real_async_b,
        "gloo_async_overhead_ns": real_async_h - real_async_b,
    }


# -- part 2: step time on real gloo training --------------------------------------------------
# On a shared machine, step times drift by tens of % between runs, far more than the hook's
# cost. So each run alternates blocks of steps with the hook on and off (the same processes,
# the same moment), and the overhead is the difference of the two medians.
BLOCK = 5


def bench_rank(rank: int, world: int, port: int, steps: int, out: str,
               size: tuple[int, int, int] = (64, 2, 32)) -> None:
    """One training rank; `size` is the model's (d_model, layers, sequence length): the
    default is a toy 8 ms step, larger ones give steps nearer a real model's."""
    import torch
    import torch.distributed as dist
    import torch.optim.optimizer as optim

    from producers import torch_hook

    hook = torch_hook.install()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    d_model, layers, seq = size
    layer = torch.nn.TransformerEncoderLayer(d_model=d_model, nhead=4,
                                             dim_feedforward=2 * d_model, batch_first=True)
    model = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=layers),
                                torch.nn.Linear(d_model, 16))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    hook.instrument_ddp(ddp)  # the comm hook stays in both modes: only Flare's cost differs
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(8, seq, d_model)

    def switch(on: bool) -> None:
        # everything the hook adds to the training thread goes on and off together: the
        # collective wrappers, the module and optimizer hooks, the named-stall patches
        if on:
            hook.patcher.install()
            hook.stalls.install()
            hook._handles.append(optim.register_optimizer_step_pre_hook(hook._opt_pre))
            hook._handles.append(optim.register_optimizer_step_post_hook(hook._opt_post))
            hook.instrument_module(ddp)
        else:
            hook.patcher.uninstall()
            hook.stalls.uninstall()
            for h in hook._handles:
                h.remove()
            hook._handles.clear()

    times: dict[str, list[float]] = {"on": [], "off": []}
    on = True
    for i in range(steps):
        if i % BLOCK == 0:
            on = not on
            switch(on)
        t0 = time.perf_counter()
        ddp(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if i >= 2 * BLOCK:  # warm-up
            times["on" if on else "off"].append(time.perf_counter() - t0)
    switch(True)
    dist.barrier()
    ops, cut_steps = hook.log.ops_cut, hook.log.step
    sent, dropped = hook.client.stats.sent_steps, hook.client.stats.dropped_steps
    torch_hook.uninstall()
    if rank == 0:
        Path(out).write_text(json.dumps({"times": times, "ops": ops, "steps": cut_steps,
                                         "sent": sent, "dropped": dropped}))
    dist.destroy_process_group()


def _run_training(world: int, steps: int, sock: Path, out: Path,
                  size: tuple[int, int, int]) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, FLARE_AGENT_SOCKET=str(sock), FLARE_JOB="bench", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("import runpy, sys; m = runpy.run_path(sys.argv[1]); "
            "m['bench_rank'](*map(eval, sys.argv[2:]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, __file__, str(r), str(world),
                               str(port), str(steps), repr(str(out)), repr(size)], env=env)
             for r in range(world)]
    for p in procs:
        if p.wait(600) != 0:
            raise SystemExit("a training rank failed")
    return json.loads(out.read_text())


def _cpu_per_step(n_ops: int) -> float:
    """CPU seconds the sender thread spends building and encoding one step of n_ops ops."""
    from producers.torch_hook.buffer import OpLog, RankMeta, encode, steps_message

    log = OpLog()
    for i in range(n_ops):
        log.end(log.begin("coll", "all_reduce", "dp.0", i, 4096))
    cut = log.cut()
    meta = RankMeta("bench", 0, "node", 0, 4, {"dp": 0})
    t0 = time.process_time()
    for _ in range(200):
        encode(steps_message(meta, cut, 0))
    return (time.process_time() - t0) / 200


def step_overhead(world: int, steps: int, repeats: int,
                  size: tuple[int, int, int] = (64, 2, 32)) -> dict:
    from producers.agent.core import AgentCore
    from producers.agent.outbox import Outbox
    from producers.agent.server import AgentDaemon
    from producers.testing import MemoryPublisher

    tmp = Path(tempfile.mkdtemp(prefix="flare-bench-", dir="/tmp"))
    sock = tmp / "agent.sock"
    pub = MemoryPublisher()
    daemon = AgentDaemon(AgentCore("bench-node"), Outbox(pub), sock)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    th = threading.Thread(target=lambda: loop.run_until_complete(daemon.serve(stop)),
                          daemon=True)
    th.start()
    runs = []
    try:
        for _ in range(repeats):
            r = _run_training(world, steps, sock, tmp / "out.json", size)
            on, off = statistics.median(r["times"]["on"]), statistics.median(r["times"]["off"])
            runs.append({"step_s_on": on, "step_s_off": off,
                         "overhead_pct": 100.0 * (on - off) / off,
                         "ops_per_step": r["ops"] / max(r["steps"], 1),
                         "sent": r["sent"], "dropped": r["dropped"]})
    finally:
        loop.call_soon_threadsafe(stop.set)
        th.join(30)
        shutil.rmtree(tmp, ignore_errors=True)
    ops = runs[-1]["ops_per_step"]
    return {"ranks": world, "steps": steps, "block": BLOCK, "model": size, "runs": runs,
            "overhead_pct_median": statistics.median(x["overhead_pct"] for x in runs),
            "sender_cpu_s_per_step": _cpu_per_step(int(round(ops))),
            "sender_cpu_s_per_step_1000_ops": _cpu_per_step(1000),
            "messages_published": len(pub.messages)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-training", action="store_true")
    ap.add_argument("--skip-op-cost", action="store_true")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--cpu-time", action="store_true",
                    help="part 1 counts this thread's CPU time, not wall time")
    a = ap.parse_args()
    if a.cpu_time:
        global _clock
        _clock = time.thread_time_ns
    if not a.skip_op_cost:
        print(json.dumps({"op_cost": op_cost()}, indent=2), flush=True)
    if not a.skip_training:
        size = (a.d_model, a.layers, a.seq)
        print(json.dumps({"training": step_overhead(a.ranks, a.steps, a.repeats, size)},
                         indent=2))


if __name__ == "__main__":
    main()
