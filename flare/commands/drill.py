"""`flare drill`: real training on the run's own hosts, one real fault, Flare's verdict."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from flare.drill.run import DrillResult
    from schemas.wire import IncidentV1


def register(app: typer.Typer) -> None:
    @app.command("drill")
    def drill_cmd(
        fault: str = typer.Option(
            "none", "--fault",
            help="none | slow-rank (cgroup CPU quota) | nic (tbf on its NIC) | flapping-nic "
                 "| freeze (cgroup freezer) | kill (SIGKILL)"),
        ranks: int = typer.Option(8, help="training ranks (torch gloo)"),
        nodes: int = typer.Option(4, help="nodes: one network namespace each"),
        pp: int = typer.Option(2, help="pipeline stages the nodes are split into"),
        steps_before: int = typer.Option(40, help="steps trained before the fault"),
        steps_after: int = typer.Option(40, help="steps trained with the fault"),
        seed: int = typer.Option(0, help="picks the faulty rank or node"),
        repeat: int = typer.Option(1, min=1, help="drills to run, with seeds seed, seed+1, ..."),
        batch: int = typer.Option(24, min=1, help="sequences per microbatch: each step's "
                                             "work (steps of 10 s and more: see the README)"),
        cpus: float = typer.Option(0.1, help="slow-rank: its CPU quota, in CPUs (with "
                                             "--cpu-share: below each rank's share)"),
        mbit: float = typer.Option(20.0, help="nic: the rate its NIC is held to, Mbit/s"),
        traced: str = typer.Option(
            "all", help="ranks that run the hook: all | tp0 (each node's first rank, one per "
                        "tensor-parallel group) | half (rank 0 and a random half, by --seed) "
                        "| node_dark (all but the last node's: its agent is down); a fault on "
                        "an untraced rank is named right by its node"),
        comm_only: bool = typer.Option(
            False, "--comm-only", help="diagnose the recording without its compute ops, as a "
                                       "communication-only tracer logs"),
        kineto: bool = typer.Option(
            False, "--kineto", help="the traced ranks also run the PyTorch profiler; its "
                                    "traces are replayed (as `flare replay --kineto`), "
                                    "diagnosed and judged too"),
        cpu_share: bool = typer.Option(
            False, "--cpu-share", help="hold every rank to a fixed CPU share (a cgroup quota of "
                                       "0.8 x cores / ranks), so a rank computes as fast "
                                       "whether or not the others wait, as a GPU does; the "
                                       "cost check then measures what a GPU job loses. Root "
                                       "only; drills run slower"),
        workdir: Path = typer.Option(Path("drill-runs"), help="logs and recordings go here"),
        as_json: bool = typer.Option(False, "--json", help="print the verdict as JSON"),
    ) -> None:
        """Inject one real fault into real training and check that Flare names it.

        Exits 0 when the first incident after the fault names the right culprit and kind
        (for `none`: when no device incident opened) in every drill, 1 when it does not, 2
        when the drill cannot run. With --repeat, one verdict per drill and a tally.
        """
        import dataclasses

        from flare.drill.run import DrillError, DrillSpec, run_drill

        try:
            spec = DrillSpec(fault=fault, ranks=ranks, nodes=nodes, pp=pp,
                             steps_before=steps_before, steps_after=steps_after, seed=seed,
                             batch=batch,
                             cpus=cpus, mbit=mbit, traced=traced, comm_only=comm_only,
                             kineto=kineto, workdir=workdir, cpu_share=cpu_share)
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None

        def say(text: str) -> None:
            if not as_json:
                typer.echo(text, err=True)

        passed = 0
        for i in range(repeat):
            try:
                res = run_drill(dataclasses.replace(spec, seed=seed + i), say)
            except DrillError as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from None
            _show(res, as_json)
            passed += res.passed
        if repeat > 1 and not as_json:
            typer.echo(f"{fault}: {passed} of {repeat} drills passed")
        if passed < repeat:
            raise typer.Exit(1)


def _show(res: DrillResult, as_json: bool) -> None:
    """One drill's verdict: a JSON line, or the incidents next to the truth."""
    import msgspec

    from flare.drill.run import latency_steps

    t, k = res.truth, res.kineto
    if as_json:
        typer.echo(msgspec.json.encode({
            "passed": res.passed,
            "truth": {"fault": t.fault, "kind": t.kind, "culprit": t.culprit,
                      "onset_step": t.onset_step, "untraced_node": t.untraced_node,
                      "only_link": t.only_link},
            "found": res.found,
            "latency_steps": res.latency_steps,
            "false_device_incidents": res.false_device,
            "incidents": sorted(res.incidents, key=lambda i: (i.opened_step, i.id)),
            "steps": res.steps,
            "step_s": round(res.step_s, 3),
            "rootless": res.rootless,
            "recording": str(res.recording),
            "messages_sent": res.sent,
            "messages_received": res.received,
            "cost": None if res.measured_slowdown is None or res.found is None else {
                "estimated_slowdown": res.found.slowdown,
                "measured_slowdown": round(res.measured_slowdown, 4)},
            "kineto": None if k is None else {
                "passed": k.passed(t), "found": k.found, "error": k.error or None,
                "latency_steps": latency_steps(k.found, t),
                "false_device_incidents": k.false_device,
                "incidents": sorted(k.incidents, key=lambda i: (i.opened_step, i.id)),
                "steps": k.steps, "recording": str(k.recording)},
        }).decode())
        return
    untraced = f", not traced: its node {t.untraced_node} names it" if t.untraced_node else ""
    if t.only_link:
        untraced = f", one of two nodes: {t.only_link} names it"
    typer.echo(f"truth: {t.fault} on {t.culprit or '-'}{untraced} (expect "
               f"{t.kind or 'nothing'}) from step "
               f"{t.onset_step if t.onset_step is not None else '-'}")
    typer.echo(f"broker: {res.received} of the {res.sent} messages the agents sent")
    _lines(res.incidents, res.found, res.false_device)
    if res.measured_slowdown is not None and res.found is not None:
        est, got = res.found.slowdown, res.measured_slowdown
        typer.echo(f"cost: the incident says its steps run ×{est:.2f}, they ran "
                   f"×{got:.2f} against those before the fault ({est / got - 1:+.0%})")
    if k is not None:
        typer.echo(f"profiler traces ({k.steps} job steps): "
                   + (f"error: {k.error}" if k.error else ("PASS" if k.passed(t) else "FAIL")))
        _lines(k.incidents, k.found, k.false_device)
    typer.echo(("PASS" if res.passed else "FAIL")
               + (f" in {res.latency_steps} step(s)" if res.latency_steps is not None else ""))


def _lines(incidents: list[IncidentV1], found: IncidentV1 | None,
           false: list[IncidentV1]) -> None:
    """The incidents, the one that answers the fault marked *, false ones !."""
    for i in sorted(incidents, key=lambda i: (i.opened_step, i.id)):
        mark = "*" if i is found else ("!" if i in false else " ")
        typer.echo(f"{mark} step {i.opened_step:>4} {i.kind:<5} {i.culprit:<14} "
                   f"{i.status:<8} {i.summary}")

