"""`flare simulate`: a simulated cluster run, written to disk (recording + ground truth) or,
with `--bootstrap`, published live to Kafka as the cluster's agents would."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer


def truth_line(truth: dict[str, Any]) -> str:
    """The ground truth in one line (`--json` prints it whole).

    >>> print(truth_line({"job": "j", "family": "nic", "kind": "link", "culprit": "node:n-3",
    ...                   "onset_step": 50, "severity": 3.0, "gpus": 64, "steps": 200}))
    truth: nic ×3 on node:n-3 (link) from step 50; job j, 64 GPUs, 200 steps
    >>> print(truth_line({"job": "j", "family": None, "gpus": 8, "steps": 3}))
    truth: a clean run; job j, 8 GPUs, 3 steps
    """
    def fault(t: dict[str, Any]) -> str:
        return (f"{t['family']} ×{t['severity']:g} on {t['culprit']} ({t['kind']}) from step "
                f"{t['onset_step']}")

    what = fault(truth) if truth.get("family") else "a clean run"
    if truth.get("second"):
        what += f", and {fault(truth['second'])}"
    return f"truth: {what}; job {truth['job']}, {truth['gpus']} GPUs, {truth['steps']} steps"


def _print_truth(truth: dict[str, Any], as_json: bool) -> None:
    import orjson

    typer.echo(orjson.dumps(truth, option=orjson.OPT_INDENT_2).decode() if as_json
               else truth_line(truth))


def register(app: typer.Typer) -> None:
    @app.command("simulate")
    def simulate_cmd(
        gpus: int = typer.Option(256, help="cluster size, a power of two >= 8 (preset layout)"),
        steps: int = typer.Option(200, min=1, help="training steps to simulate"),
        fault: str | None = typer.Option(
            None,
            help="fault family: slow_gpu, thermal, slow_node, host, nic, switch, "
            "pp_link, hang_rank, comm_hang, straggler (a GPU 5-20× slow but alive), "
            "flapping_nic (a NIC fault that comes and goes) (none: a clean run)",
        ),  # fmt: skip
        severity: float | None = typer.Option(
            None, help="fault severity (default: the middle of the family's grid)"
        ),
        onset: int | None = typer.Option(None, min=0, help="first faulty step (default steps/4)"),
        target: str | None = typer.Option(
            None,
            help="culprit, e.g. rank:17, node:node-0002, switch:leaf-01, "
            "link:node-0001~node-0009, group:dp.3-1 (default: drawn from the seed)",
        ),  # fmt: skip
        seed: int = typer.Option(0, min=0, help="random seed (same seed, same run)"),
        out: Path = typer.Option(Path("run.jsonl"), help="recording to write (.jsonl)"),
        job: str | None = typer.Option(None, help="job id (default: derived from the options)"),
        step_time: float = typer.Option(2.0, min=0.001, help="healthy step time, seconds"),
        ep: int = typer.Option(1, min=1, help="MoE expert-parallel size (divides dp)"),
        heartbeats: bool = typer.Option(True, help="emit ~1 Hz heartbeats per rank"),
        traced: str = typer.Option(
            "all",
            help="ranks that report: all, tp0 (one per TP group), half (a seeded random "
            "half), node_dark (all but one seeded node)",
        ),  # fmt: skip
        comm_only: bool = typer.Option(False, help="log only collectives and p2p (no compute ops)"),
        seq_imbalance: float = typer.Option(
            0.0,
            help="sequence-length imbalance: σ of each DP replica's per-step compute "
            "multiplier (some replicas persistently heavier); 0: none",
        ),  # fmt: skip
        stage_imbalance: float = typer.Option(
            1.0, help="the last pipeline stage computes this many times longer by design"
        ),
        fault2: str | None = typer.Option(
            None,
            help="a second, simultaneous fault family (needs --fault): the middle of its "
            "grid, at the same onset, drawn in another node and DP group",
        ),  # fmt: skip
        bootstrap: str | None = typer.Option(
            None, help="publish live to this Kafka (host:port) instead of writing --out"
        ),
        speed: float = typer.Option(
            1.0, min=0.0001, help="with --bootstrap: X times real time (0: no pacing)"
        ),
        as_json: bool = typer.Option(
            False, "--json", help="print the ground truth as JSON (as run.truth.json)"),
    ) -> None:
        """Simulate a training job with an optional fault; write the recording and its truth."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        from producers.simulator import (
            FAMILIES,
            SEVERITIES,
            ClusterSimulator,
            Fault,
            Scenario,
            layout_for_gpus,
        )
        from producers.simulator.recording import truth_path, write_simulation

        console = Console(stderr=True)
        try:
            flt = None
            if fault is not None:
                if fault not in FAMILIES:
                    raise ValueError(f"--fault must be one of {', '.join(FAMILIES)}")
                grid = SEVERITIES[fault]
                sev = severity if severity is not None else grid[len(grid) // 2]
                flt = Fault(fault, sev, onset if onset is not None else steps // 4, target)
            elif severity is not None or onset is not None or target is not None or fault2:
                raise ValueError("--severity, --onset, --target and --fault2 need --fault")
            flt2 = None
            if fault2 is not None and flt is not None:
                if fault2 not in FAMILIES:
                    raise ValueError(f"--fault2 must be one of {', '.join(FAMILIES)}")
                grid2 = SEVERITIES[fault2]
                flt2 = Fault(fault2, grid2[len(grid2) // 2], flt.onset_step)
            name = job or f"sim-{gpus}-{fault or 'clean'}-s{seed}"
            scenario = Scenario(
                job=name, layout=layout_for_gpus(gpus, ep=ep), steps=steps, seed=seed,
                fault=flt, step_time_s=step_time, heartbeats=heartbeats, traced=traced,
                comm_only=comm_only, seq_imbalance=seq_imbalance,
                stage_imbalance=stage_imbalance, fault2=flt2,
                # published live, the job runs now (a recording keeps its fixed epoch)
                epoch_ns=time.time_ns() if bootstrap else None,
            )  # fmt: skip
            sim = ClusterSimulator(scenario)  # raises if the fault cannot happen on the layout
        except ValueError as exc:
            console.print(f"[red]error:[/red] {exc}")
            raise typer.Exit(2) from None

        if bootstrap:
            _print_truth(sim.truth.to_dict(), as_json)  # what the live run will show
            _publish_live(sim, bootstrap, speed, console)
            return
        with Progress(
            "[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=console,
        ) as progress:  # fmt: skip
            task = progress.add_task(f"simulating {name}", total=steps)
            truth = write_simulation(
                sim, out, on_step=lambda s: progress.update(task, completed=s + 1)
            )
            progress.update(task, completed=steps)
        console.print(f"wrote {out} and {truth_path(out)}")
        _print_truth(truth.to_dict(), as_json)


def _publish_live(sim, bootstrap: str, speed: float, console) -> None:  # noqa: ANN001
    """Publish the run in (scaled) real time until it ends or SIGTERM / Ctrl-C."""
    import signal

    import orjson

    from flare.settings import Settings
    from producers.live import publish_events
    from producers.publisher import KafkaPublisher, PublishError, for_steps
    from schemas.topics import JOBS

    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    publisher = None
    summary = None
    try:
        settings = Settings()
        publisher = KafkaPublisher(settings.kafka_connection(bootstrap))
        console.print(f"publishing {sim.truth.job} to {bootstrap} (×{speed or 'max'} speed)")
        summary = publish_events(
            sim.events(), for_steps(publisher, shard_ranks=0, partitions=1,
                                    encoding=settings.steps_encoding),
            speed or None, should_stop=lambda: bool(stopping)
        )
    except KeyboardInterrupt:
        stopping.append(True)
    except PublishError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    try:
        if stopping and publisher is not None:
            # stopped early: the job ends here, as a real one that is cancelled does, so its
            # silence from now on is no hang
            last = (summary.last_ts_ns or 0) if summary is not None else 0
            publisher.publish(JOBS, sim.truth.job, orjson.dumps(
                {"v": 1, "job": sim.truth.job, "event": "end",
                 "ts_ns": (last or time.time_ns()) + 1}))
        if publisher is not None:
            publisher.flush(10.0)
    except KeyboardInterrupt:
        return
    except PublishError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"published {summary.events if summary else 'some'} messages"
                  + (", then the job's end" if stopping else ""))
