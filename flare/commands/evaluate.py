"""`flare eval`: accuracy of the detectors over a matrix of simulated scenarios."""

from __future__ import annotations

from pathlib import Path

import typer


def _parse_gpus(text: str) -> list[int]:
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--gpus takes comma-separated integers, not {text!r}") from None
    if not gpus or any(g < 8 for g in gpus):
        raise typer.BadParameter("--gpus needs at least one size, each ≥ 8")
    return gpus


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_cmd(
        gpus: str = typer.Option("256,1024", envvar="FLARE_EVAL_GPUS", help="layout sizes"),
        seeds: int = typer.Option(1, min=1, envvar="FLARE_EVAL_SEEDS", help="seeds per cell"),
        clean_steps: int = typer.Option(10_000, min=0, help="clean steps in total"),
        jobs: int = typer.Option(2, min=1, help="worker processes"),
        families: str = typer.Option("", help="only these fault families (comma-separated)"),
        json_out: Path | None = typer.Option(None, "--json", help="write results as JSON"),
    ) -> None:
        """Run every fault family × severity × layout plus clean runs; print the scores."""
        import orjson
        from rich.console import Console
        from rich.progress import Progress
        from rich.table import Table

        from flare.evaluation import clean_scenarios, fault_scenarios, run_all, summarize_results

        sizes = _parse_gpus(gpus)
        scen = fault_scenarios(sizes, seeds)
        if families:
            wanted = {f.strip() for f in families.split(",")}
            scen = [s for s in scen if s.fault and s.fault.family in wanted]
        scen += clean_scenarios(sizes, clean_steps) if clean_steps else []
        console = Console(stderr=True)
        with Progress(console=console) as bar:
            task = bar.add_task("scenarios", total=len(scen))
            results = run_all(scen, jobs=jobs, progress=lambda _r: bar.advance(task))
        doc = summarize_results(results, sizes, seeds)
        table = Table(title=f"flare eval --gpus {gpus} --seeds {seeds}")
        cols = (
            "scenarios",
            "top1",
            "top3",
            "kind",
            "false_per_10k_clean_steps",
            "latency_steps_median",
            "latency_s_median",
            "repeats_per_fault_run",
        )
        heads = ("runs", "top1", "top3", "kind", "false/10k clean", "latency steps", "latency s",
                 "repeats/run")
        table.add_column("family")
        for h in heads:
            table.add_column(h, justify="right")

        def fmt(v: object) -> str:
            return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))

        for fam, m in doc["families"].items():
            table.add_row(fam, *(fmt(m[c]) for c in cols))
        for g, m in doc["by_gpus"].items():
            table.add_row(f"all at {g} GPUs", *(fmt(m[c]) for c in cols), style="italic")
        table.add_row("overall", *(fmt(doc["overall"][c]) for c in cols), style="bold")
        Console(width=max(Console().width, 125)).print(table)
        if json_out:
            json_out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
