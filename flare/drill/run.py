"""One drill: real training on a run's own hosts, one real fault, Flare's verdict next to it.

The drill builds `nodes` network namespaces and a hub (`testbed`), starts a broker in the hub
(`hub`), one `flare agent` in each node publishing to it over the node's NIC, and the ranks
of `flare.drill.train` on the nodes. It waits until the job has trained `steps_before` steps,
injects the fault (`faults`), lets the job train `steps_after` more steps (a hang: a fixed
wait past Flare's hang timeout), undoes the fault and stops everything. What the broker
received is read back, put in event-time order and run through the same detectors as the
worker (`flare.offline`). The verdict compares the first incident opened after the fault with
the truth, and counts device incidents on a clean run. Each agent also keeps its own copy of
what it sent (`--record`), which is how the drill follows the job's progress and counts what
the broker lost.

With `cpu_share`, every rank also runs in a cgroup of its own, held to a fixed share of the
machine's cores (`rank_share`) by a steady quota (`CpuQuota.steady`: a rate, not a budget
per 100 ms that a rank which waited spends at full speed). The ranks share a few cores, so
without it a rank computes faster while the others wait, which a GPU never does; with it
each rank computes at one rate whatever its peers do, as a GPU job's ranks would, and a
drill measures what such a job loses (`flare.drill.cost`). The slowed rank's fault then sits
inside its share, steady too.

Without root there are no namespaces, cgroups or qdiscs: the broker and every rank run on
loopback, and only the faults that need none (freeze through SIGSTOP, kill, none) can be
drilled, with no CPU shares.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from flare.drill.cost import SLOWING, measured_slowdown, step_times
from flare.drill.faults import (
    CGROUP_ROOT,
    CpuQuota,
    Fault,
    FaultError,
    Flapping,
    Freeze,
    Interface,
    Kill,
    RateLimit,
)
from flare.drill.hub import HubBroker
from flare.drill.testbed import Host, Testbed
from flare.eval_cost import evidence_steps
from schemas.wire import IncidentV1

FAULTS = ("none", "slow-rank", "nic", "flapping-nic", "freeze", "kill")
# which ranks run the hook: every one, one per tensor-parallel group (a node's first, as
# production tracers often record only TP rank 0), rank 0 and a seeded random half, or all
# but the last node's (its agent is down; the job start still names it)
TRACED = ("all", "tp0", "half", "node_dark")
ROOTLESS_FAULTS = ("none", "freeze", "kill")
# what a correct diagnosis of each fault reports: (incident kind, entity kind of the culprit)
EXPECTED_KIND = {"slow-rank": "gpu", "nic": "link", "flapping-nic": "link", "freeze": "hang",
                 "kill": "hang"}
# A hang is left this long: past Flare's hang timeout (10 s, or 3 step times on long steps)
# and the heartbeats that show it; `hang_wait_s` scales it with the drill's own steps.
HANG_WAIT_S = 20.0
HANG_WAIT_STEPS = 5.0
KILL_WAIT_S = 10.0  # after a kill, its peers fail in their collectives within seconds
STALL_S = 120.0  # a job that finishes no step for this long (or 10 of its steps) is stuck
# With fixed CPU shares the ranks together get this much of the cores: the rest is for the
# broker, the agents and the drill itself, which would otherwise take it from the ranks, so a
# rank's rate would again depend on what else runs.
RANKS_CORES = 0.8


class DrillError(RuntimeError):
    """The drill could not run (no root for this fault, training failed to start, ...)."""


@dataclass(frozen=True, slots=True)
class DrillSpec:
    """What to run and what to inject."""

    fault: str = "none"
    ranks: int = 8
    nodes: int = 4
    pp: int = 2
    steps_before: int = 40
    steps_after: int = 40
    batch: int = 24
    seed: int = 0
    cpus: float = 0.1  # slow-rank: the rank's CPU quota, in CPUs
    mbit: float = 20.0  # nic: the rate its NIC is held to
    flap_s: float = 2.0  # flapping-nic: seconds on, then off
    traced: str = "all"  # which ranks report (TRACED)
    comm_only: bool = False  # diagnose without compute ops, as a communication-only tracer logs
    kineto: bool = False  # traced ranks also write profiler traces, diagnosed and judged too
    workdir: Path = Path("drill-runs")
    tag: str = ""
    cpu_share: bool = False  # every rank held to `rank_share` CPUs (needs root and cgroups)

    def __post_init__(self) -> None:
        if self.fault not in FAULTS:
            raise ValueError(f"unknown fault {self.fault!r}; one of {', '.join(FAULTS)}")
        if self.traced not in TRACED:
            raise ValueError(f"unknown tracing {self.traced!r}; one of {', '.join(TRACED)}")
        if self.ranks < 2 or self.nodes < 1 or self.ranks % self.nodes:
            raise ValueError("at least 2 ranks, spread evenly over the nodes")
        if self.nodes % self.pp:
            raise ValueError("the nodes must split evenly into the pipeline stages")
        if self.traced == "node_dark" and self.nodes < 2:
            raise ValueError("a dark node needs at least 2 nodes (the first one starts the job)")
        if self.steps_before < 10 or self.steps_after < 5:
            raise ValueError("at least 10 steps before the fault and 5 after")
        share = self.share
        if share is not None and self.fault == "slow-rank" and self.cpus >= share:
            raise ValueError(f"with CPU shares the slowed rank's quota (cpus {self.cpus:g}) "
                             f"must be below each rank's share, {share:.3g} CPUs")

    @property
    def share(self) -> float | None:
        """Each rank's CPUs with `cpu_share` (None without): `rank_share` of this machine."""
        return rank_share(self.ranks, os.cpu_count() or 1) if self.cpu_share else None

    @property
    def per_node(self) -> int:
        return self.ranks // self.nodes

    def traced_ranks(self) -> frozenset[int]:
        """The ranks that run the hook. Rank 0 always does: its agent starts the job.

        >>> sorted(DrillSpec(traced="tp0").traced_ranks())
        [0, 2, 4, 6]
        >>> half = DrillSpec(traced="half", seed=5).traced_ranks()
        >>> len(half), 0 in half, half == DrillSpec(traced="half", seed=5).traced_ranks()
        (4, True, True)
        >>> sorted(DrillSpec(traced="node_dark").traced_ranks())
        [0, 1, 2, 3, 4, 5]
        """
        if self.traced == "node_dark":
            return frozenset(range(self.ranks - self.per_node))
        if self.traced == "tp0":
            return frozenset(range(0, self.ranks, self.per_node))
        if self.traced == "half":
            rest = random.Random(f"traced-{self.seed}").sample(range(1, self.ranks),
                                                                self.ranks // 2 - 1)
            return frozenset([0, *rest])
        return frozenset(range(self.ranks))


def rank_share(ranks: int, cores: int) -> float:
    """The CPUs each rank may use with fixed shares: `RANKS_CORES` of the cores, split evenly.

    >>> rank_share(8, 2)
    0.2
    """
    return RANKS_CORES * cores / ranks


def cpu_shares(spec: DrillSpec, pids: list[int], root: Path = CGROUP_ROOT) -> list[CpuQuota]:
    """Each rank's share (rank r is `pids[r]`), not applied yet; none without `cpu_share`."""
    if spec.share is None:
        return []
    return [CpuQuota(pid, spec.share, name=_share_group(spec, r), root=root, steady=True)
            for r, pid in enumerate(pids)]


def _rank_group(spec: DrillSpec, r: int) -> str:
    """Rank r's cgroup name, unique to the drill: its tag, or this process (one at a time)."""
    return f"flare-{spec.tag or os.getpid()}-{r}"


def _share_group(spec: DrillSpec, r: int) -> str:
    return f"{_rank_group(spec, r)}-share"


def slow_rank_quota(spec: DrillSpec, r: int, pid: int, root: Path = CGROUP_ROOT) -> CpuQuota:
    """The slow-rank fault on rank r (process `pid`), not applied yet. With shares it sits
    inside the rank's share and is steady like it: the rank computes at `cpus` throughout,
    below its share, and undoing the fault gives the share back."""
    if spec.cpu_share:
        return CpuQuota(pid, spec.cpus, name=f"{_share_group(spec, r)}/fault", root=root,
                        steady=True)
    return CpuQuota(pid, spec.cpus, name=_rank_group(spec, r), root=root)


@dataclass(frozen=True, slots=True)
class Truth:
    """The injected fault: what was done to which entity, and the first step it touched."""

    fault: str
    kind: str | None  # the incident kind a correct diagnosis reports (None: no fault)
    culprit: str | None  # rank:<n> or node:<name>
    onset_step: int | None  # the first step that ran wholly under the fault (latency from it)
    # an untraced culprit rank is named right by its node: the narrowest entity the data of
    # its traced peers can support
    untraced_node: str | None = None
    # a NIC of a job of two nodes is named right by the link between them: every transfer
    # across nodes goes through both NICs and the path between
    only_link: str | None = None

    def named(self, culprit: str) -> bool:
        """Whether an incident's culprit names the faulty entity."""
        return culprit in (self.culprit, self.only_link) or (
            self.untraced_node is not None and culprit == f"node:{self.untraced_node}")

    def answered(self, found: IncidentV1 | None, false_device: list[IncidentV1]) -> bool:
        """Whether a judged diagnosis (`judge`) is right: the incident that answers the
        fault names it with its kind, and no device incident is false (for `none`: none)."""
        if self.culprit is None:
            return not false_device
        return (found is not None and self.named(found.culprit) and found.kind == self.kind
                and not false_device)


@dataclass(slots=True)
class KinetoVerdict:
    """The drill judged again from its traced ranks' PyTorch profiler traces, replayed as
    `flare replay --kineto` does: what a job that runs the profiler, not Flare's hook,
    gives Flare."""

    incidents: list[IncidentV1]
    steps: int
    recording: Path
    found: IncidentV1 | None = None
    false_device: list[IncidentV1] = field(default_factory=list)
    error: str = ""  # the traces could not be replayed (KinetoError's message)

    def passed(self, truth: Truth) -> bool:
        return not self.error and truth.answered(self.found, self.false_device)


@dataclass(slots=True)
class DrillResult:
    truth: Truth
    incidents: list[IncidentV1]
    steps: int
    rootless: bool
    recording: Path
    sent: int = 0  # messages the agents handed to Kafka
    received: int = 0  # messages the broker held at the end (the recording diagnosed)
    found: IncidentV1 | None = None  # the first incident opened at or after the fault
    false_device: list[IncidentV1] = field(default_factory=list)
    step_s: float = 0.0  # the job's seconds per step before the fault
    kineto: KinetoVerdict | None = None  # the same drill seen from its profiler traces
    # what the job's own steps show the fault cost, over the found incident's evidence
    # steps (its `slowdown` is the estimate over the same steps): None for faults that stop
    # the job, or nothing found
    measured_slowdown: float | None = None

    @property
    def passed(self) -> bool:
        """The first incident after the fault names it, no device incident is false, and
        the profiler traces (when asked for) say the same."""
        if self.kineto is not None and not self.kineto.passed(self.truth):
            return False
        return self.truth.answered(self.found, self.false_device)

    @property
    def latency_steps(self) -> int | None:
        return latency_steps(self.found, self.truth)


def latency_steps(found: IncidentV1 | None, truth: Truth) -> int | None:
    """Steps from the fault's first whole step to the incident that answers it."""
    if found is None or truth.onset_step is None:
        return None
    return found.opened_step - truth.onset_step


def judge(truth: Truth, incidents: list[IncidentV1]) -> tuple[IncidentV1 | None,
                                                             list[IncidentV1]]:
    """The incident that answers the fault, and the device incidents that are false.

    Job-level incidents (`job`: a shift with no device to blame) are never false alarms: the
    fault itself shifts the job's step time. A device incident opened before the fault, or
    after it on another entity, is false. The step in progress when the fault began is
    already touched by it.
    """
    ordered = sorted(incidents, key=lambda i: (i.opened_step, i.id))
    device = [i for i in ordered if i.kind != "job"]
    if truth.onset_step is None:
        return None, device
    before = [i for i in device if i.opened_step < truth.onset_step - 1]
    after = [i for i in device if i.opened_step >= truth.onset_step - 1]
    found = after[0] if after else None
    wrong = [i for i in after if not truth.named(i.culprit)]
    return found, before + wrong


def _say_nothing(_text: str) -> None:
    return None


def run_drill(spec: DrillSpec, say: Callable[[str], None] = _say_nothing) -> DrillResult:
    """Run one drill end to end; raises DrillError when it cannot run at all."""
    rootless = os.geteuid() != 0
    if rootless and spec.fault not in ROOTLESS_FAULTS:
        raise DrillError(
            f"fault {spec.fault!r} needs root (network namespaces, cgroups and tc are "
            f"root-only); without root only {', '.join(ROOTLESS_FAULTS)} can be drilled")
    if rootless and spec.cpu_share:
        raise DrillError("fixed CPU shares need root (each rank gets a cgroup of its own); "
                         "drill without them")
    tag = spec.tag or f"d{os.getpid() % 100000}s{spec.seed}"  # one folder per drill
    out = spec.workdir / tag
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(spec.seed)
    if rootless:
        say("not root: no network namespaces, cgroups or tc here, so every rank and the "
            "broker run on this host's loopback, and a freeze is a SIGSTOP")
    with contextlib.ExitStack() as stack:
        hosts, broker = _hosts(spec, tag, rootless, out, stack)
        job = f"drill-{tag}"
        agents = _agents(hosts, out, broker.bootstrap, stack)
        ranks = _ranks(spec, hosts, job, out, stack)
        _hold_to_shares(spec, ranks, stack, say)
        say(f"training: {spec.ranks} ranks on {len(hosts)} node(s), job {job}")
        step_s = _wait_steps(agents[0], spec.steps_before, ranks, spec)
        say(f"{step_s:.2f} s per step")
        truth, fault = _fault(spec, rng, hosts, ranks, agents)
        if fault is not None:
            stack.callback(fault.undo)
            fault.apply()
            say(f"fault {spec.fault} on {truth.culprit} from step {truth.onset_step}")
        if spec.fault == "freeze":
            time.sleep(hang_wait_s(step_s))
        elif spec.fault == "kill":
            time.sleep(max(KILL_WAIT_S, 2 * step_s))
        else:
            _wait_steps(agents[0], spec.steps_before + spec.steps_after, ranks, spec)
        if spec.fault == "freeze":
            # the verdict is what Flare saw while the rank was frozen: the agents stop (and
            # flush) before the thaw lets it run on and dump its stacks from somewhere new
            _stop_all([a.process for a in agents])
        if fault is not None:
            fault.undo()
        _stop_all(ranks)
        _stop_all([a.process for a in agents])  # each flushes what it holds as it stops
        sent = sum(1 for a in agents for _ in _lines(a.out))
        received = broker.collect(out / "broker.jsonl", sent)
    recording = out / "recording.jsonl"
    sort_recording(out / "broker.jsonl", recording)
    if spec.comm_only:
        recording = without_compute(recording, out / "recording.comm-only.jsonl")
    incidents, steps, events = _diagnose(recording)
    found, false_device = judge(truth, incidents)
    say(f"{sent} messages sent, {received} received by the broker, {steps} job steps "
        "diagnosed")
    kineto = _kineto_verdict(out, job, truth) if spec.kineto else None
    measured = None
    if spec.fault in SLOWING and found is not None and truth.onset_step is not None:
        measured = measured_slowdown(step_times(recording), truth.onset_step,
                                     evidence_steps(events, found.id))
    return DrillResult(truth, incidents, steps, rootless, recording, sent, received, found,
                       false_device, step_s, kineto, measured)


def _hold_to_shares(spec: DrillSpec, ranks: list[subprocess.Popen[bytes]],
                    stack: contextlib.ExitStack, say: Callable[[str], None]) -> None:
    """Put each rank in its share as soon as it started (before it trains a step), each
    share removed when the drill ends."""
    for quota in cpu_shares(spec, [p.pid for p in ranks]):
        stack.callback(quota.undo)
        try:
            quota.apply()
        except FaultError as exc:
            raise DrillError(f"cannot hold the ranks to CPU shares: {exc}") from None
    if spec.share is not None:
        say(f"each rank held to {spec.share:.3g} CPUs")


def _kineto_verdict(out: Path, job: str, truth: Truth) -> KinetoVerdict:
    """Replay the profiler traces the traced ranks wrote, diagnose them and judge."""
    from producers.kineto.replay import KinetoError, kineto_to_events
    from producers.recording import write_events

    recording = out / "kineto.jsonl"
    try:
        write_events(list(kineto_to_events([out / "kineto"], job)), recording)
    except KinetoError as exc:
        return KinetoVerdict([], 0, recording, error=str(exc))
    incidents, steps, _ = _diagnose(recording)
    found, false_device = judge(truth, incidents)
    return KinetoVerdict(incidents, steps, recording, found, false_device)


@dataclass(frozen=True, slots=True)
class _Agent:
    host: Host
    out: Path  # its own copy of what it published
    socket: Path
    process: subprocess.Popen[bytes]


BROKER_PORT = 9092  # in the hub's own namespace nothing else listens


def _hosts(spec: DrillSpec, tag: str, rootless: bool, out: Path,
           stack: contextlib.ExitStack) -> tuple[list[Host], HubBroker]:
    """The nodes, and the broker they publish to (entered: running until the stack ends)."""
    log = out / "broker.log"
    if rootless:
        from flare.local.broker import free_port

        hub = HubBroker("127.0.0.1", free_port(), [], log)
        return [Host("node-0", "", "127.0.0.1", "lo", "")], stack.enter_context(hub)
    bed = stack.enter_context(Testbed(tag=tag, nodes=spec.nodes,
                                      subnet=60 + os.getpid() % 150))
    hub = HubBroker(bed.hub.address, BROKER_PORT, bed.hub.argv([]), log)
    return bed.hosts, stack.enter_context(hub)


def _in_host(h: Host, argv: list[str]) -> list[str]:
    return h.argv(argv) if h.netns else argv


def _agents(hosts: list[Host], out: Path, bootstrap: str,
            stack: contextlib.ExitStack) -> list[_Agent]:
    """One agent per node, started together (each takes a second or so to import and bind
    its socket; one after another that was seconds of every drill)."""
    started = []
    for h in hosts:
        sock, rec = out / f"{h.name}.sock", out / f"{h.name}.jsonl"
        for stale in (sock, rec):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        argv = [sys.executable, "-m", "flare", "agent", "--record", str(rec), "--socket",
                str(sock), "--node", h.name, "--interval", "0.5"]
        env = dict(os.environ, FLARE_KAFKA_BOOTSTRAP=bootstrap)
        with open(out / f"{h.name}.agent.log", "wb") as log:
            p = subprocess.Popen(_in_host(h, argv), stdout=log, stderr=log, env=env)
        stack.callback(_stop, p)
        started.append(_Agent(h, rec, sock, p))
    deadline = time.monotonic() + 30
    for a in started:
        while not a.socket.exists():
            if a.process.poll() is not None or time.monotonic() > deadline:
                raise DrillError(f"the agent of {a.host.name} did not start: see "
                                 f"{a.host.name}.agent.log")
            time.sleep(0.05)
    return started


def _stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """End training (or the agents) as a scheduler does: SIGTERM to all at once (the ranks
    exit through Python and say goodbye, an agent flushes to the broker), SIGKILL only for
    one still there after a while. All at once: one by one, each agent's flush was waited
    for in turn."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 20
    for p in procs:
        try:
            p.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def _ranks(spec: DrillSpec, hosts: list[Host], job: str, out: Path,
           stack: contextlib.ExitStack) -> list[subprocess.Popen[bytes]]:
    procs = []
    per_node = spec.ranks // len(hosts)
    master = f"{hosts[0].address}:{29500 + os.getpid() % 1000}"
    traced = spec.traced_ranks()
    for r in range(spec.ranks):
        h = hosts[r // per_node]
        env = dict(os.environ, FLARE_AGENT="1" if r in traced else "0", FLARE_JOB=job,
                   FLARE_NODE=h.name, FLARE_AGENT_SOCKET=str(out / f"{h.name}.sock"),
                   LOCAL_RANK=str(r % per_node), GLOO_SOCKET_IFNAME=h.nic, OMP_NUM_THREADS="1")
        if spec.traced == "node_dark":  # the job start names every node: the dark one too
            env["FLARE_JOB_NODES"] = ",".join(x.name for x in hosts)
        argv = [sys.executable, "-m", "flare.drill.train", "--rank", str(r), "--world",
                str(spec.ranks), "--per-node", str(per_node),
                "--pp", str(spec.pp if len(hosts) > 1 else 1), "--master", master,
                "--batch", str(spec.batch)]
        if spec.kineto and r in traced:
            argv += ["--profile", str(out / "kineto"), "--node-name", h.name]
        with open(out / f"rank{r}.log", "wb") as log:
            p = subprocess.Popen(_in_host(h, argv), env=env, stdout=log, stderr=log)
        stack.callback(_stop, p)
        procs.append(p)
    return procs


def newest_steps(recordings: Iterable[Path]) -> dict[int, int]:
    """The newest step each rank finished, from its node agent's copy of what it published."""
    newest: dict[int, int] = {}
    for path in recordings:
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            for line in f:
                if b'"flare.steps.v1"' in line and line.endswith(b"\n"):
                    v = orjson.loads(line)["value"]
                    rank, step = int(v["rank"]), int(v["step"])
                    newest[rank] = max(newest.get(rank, -1), step)
    return newest


def fault_onset(newest: dict[int, int]) -> int:
    """The first step that runs wholly under a fault applied now.

    Ranks are steps apart (a pipeline's first stage starts a step before its last one ends),
    so a fault lands in the step the rank furthest behind is still in, and touches the job
    from there on; the step after it is the first wholly under the fault.
    """
    return min(newest.values(), default=-1) + 2


def _newest_step(agent: _Agent) -> int:
    """The newest step any rank of `agent`'s node finished."""
    return max(newest_steps([agent.out]).values(), default=-1)


def hang_wait_s(step_s: float) -> float:
    """How long a frozen rank is left frozen: past Flare's hang timeout, which is the longer
    of 10 s and 3 of the job's step times, with time for the heartbeats that show it."""
    return max(HANG_WAIT_S, HANG_WAIT_STEPS * step_s)


def _wait_steps(agent: _Agent, step: int, ranks: list[subprocess.Popen[bytes]],
                spec: DrillSpec) -> float:
    """Wait until `agent`'s node finished `step`; the seconds per step it took since the
    first step seen. Steps of any length: only a job that stops finishing steps is stuck."""
    start = now = time.monotonic()
    newest, first, first_at = _newest_step(agent), None, now
    progress_at = now
    while newest < step:
        failed = [i for i, p in enumerate(ranks) if p.poll() not in (None, 0)]
        if failed:
            raise DrillError(f"rank {failed[0]} exited before step {step}: see "
                             f"rank{failed[0]}.log in {spec.workdir}")
        per_step = (now - first_at) / max(newest - first, 1) if first is not None else 0.0
        if now - progress_at > max(STALL_S, 10 * per_step):
            raise DrillError(f"the job did not reach step {step}: no step finished in "
                             f"{now - progress_at:.0f} s (step {newest} was the newest)")
        time.sleep(0.25)
        now = time.monotonic()
        seen = _newest_step(agent)
        if seen > newest:
            newest, progress_at = seen, now
            if first is None:
                first, first_at = seen, now
    if first is None or newest <= first:
        return (time.monotonic() - start) / max(step, 1)
    return (now - first_at) / (newest - first)


def _fault(spec: DrillSpec, rng: random.Random, hosts: list[Host],
           ranks: list[subprocess.Popen[bytes]], agents: list[_Agent]
           ) -> tuple[Truth, Fault | None]:
    """Pick the target with the drill's seed and build its fault (not applied yet)."""
    onset = fault_onset(newest_steps(a.out for a in agents))
    if spec.fault == "none":
        return Truth("none", None, None, None), None
    if spec.fault in ("nic", "flapping-nic"):
        h = hosts[rng.randrange(len(hosts))]
        limit = RateLimit([Interface(h.nic, h.netns), Interface(h.hub_side, h.hub_netns)],
                          spec.mbit)
        fault: Fault = (limit if spec.fault == "nic"
                        else Flapping(limit, spec.flap_s, spec.flap_s))
        pair = "~".join(sorted(x.name for x in hosts)) if len(hosts) == 2 else None
        return Truth(spec.fault, "link", f"node:{h.name}", onset,
                     only_link=f"link:{pair}" if pair else None), fault
    r = rng.randrange(spec.ranks)
    pid = ranks[r].pid  # `ip netns exec` execs the command: the pid is the rank's own
    built: Fault
    if spec.fault == "slow-rank":
        built = slow_rank_quota(spec, r, pid)
    elif spec.fault == "freeze":
        built = Freeze(pid, name=_rank_group(spec, r))
    else:
        built = Kill(pid)
    dark = None if r in spec.traced_ranks() else hosts[r // spec.per_node].name
    return Truth(spec.fault, EXPECTED_KIND[spec.fault], f"rank:{r}", onset, dark), built


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                continue  # the agent was stopped mid-line: nothing it published is lost
            m = orjson.loads(line)
            v = m["value"]
            yield int(v.get("t_end_ns") or v.get("ts_ns") or 0), line


def sort_recording(path: Path, out: Path) -> int:
    """`path`'s messages in event-time order into `out` (the worker's step assembly orders
    by event time as well; the broker keeps each topic in arrival order)."""
    events = sorted(_lines(path), key=lambda e: e[0])
    with open(out, "wb") as f:
        for _, line in events:
            f.write(line)
    return len(events)


def without_compute(path: Path, out: Path) -> Path:
    """`path` as a communication-only tracer would have logged it: every step's compute ops
    left out, its collectives and transfers as they were (Holmes-style logs)."""
    with open(path, "rb") as src, open(out, "wb") as dst:
        for line in src:
            m = orjson.loads(line)
            if m["topic"] == "flare.steps.v1":
                ops = m["value"]["ops"]
                keep = [i for i, k in enumerate(ops["kind"]) if k != "compute"]
                m["value"]["ops"] = {col: [vals[i] for i in keep] if isinstance(vals, list)
                                     else vals for col, vals in ops.items()}
                line = orjson.dumps(m) + b"\n"
            dst.write(line)
    return out


def _diagnose(recording: Path) -> tuple[list[IncidentV1], int, list[IncidentV1]]:
    """The recording's incidents (each as it ended), its steps diagnosed, and every
    incident event in order (an incident's evidence steps are read from them)."""
    from flare.offline import diagnose_messages, recording_messages

    res = diagnose_messages(recording_messages(str(recording)))
    return list(res.incidents.values()), res.steps, res.events
