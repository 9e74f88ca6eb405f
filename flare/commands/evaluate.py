"""`flare eval`: accuracy of the detectors over a matrix of simulated scenarios."""

from __future__ import annotations

from pathlib import Path

import typer

_CONDITIONS_HELP = (
    "real-training conditions to score, comma-separated, or 'all': base (~2 s steps, all "
    "traced), step05 / step30 / step60 (0.5 / 30 / 60 s steps), tp0 (one rank per TP group "
    "traced), half (a random half traced), node_dark (one node's agent down), comm_only (no "
    "compute ops), seq (sequence-length imbalance), stage (last pipeline stage 1.4×), "
    "two_faults (a second fault, a slow GPU ×1.5 in another group; no clean runs), 1f1b "
    "(1F1B pipeline schedule, dp reduce_scatter overlapped with backward), bursts (a "
    "flapping NIC's bursts over parts of steps, at a period of its own; flapping_nic runs "
    "only), oneway (a NIC slow only sending; nic and flapping_nic runs only), cpu_sends (a "
    "slow or stalled rank's cross-node transfers slow with it; rank fault runs only); "
    "combine with + (step30+tp0). Each condition runs every fault family (straggler "
    "and flapping_nic included) and the clean runs, heartbeats on; prints a row per "
    "condition"
)


def _parse_gpus(text: str) -> list[int]:
    try:
        gpus = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"--gpus takes comma-separated integers, not {text!r}") from None
    if not gpus or any(g < 8 or g & (g - 1) for g in gpus):
        raise typer.BadParameter(
            f"--gpus takes powers of two ≥ 8 (8, 16, …, 1024, 8192), not {text!r}")
    return gpus


COLS = (
    "scenarios",
    "top1",
    "top3",
    "kind",
    "false_per_10k_clean_steps",
    "latency_steps_median",
    "latency_s_median",
    "repeats_per_fault_run",
    "cost_err_median",
    "cost_err_p90",
    "cost_material_p90",
    "cost_runs",
)
HEADS = ("runs", "top1", "top3", "kind", "false/10k clean", "latency steps", "latency s",
         "repeats/run", "cost err med", "cost err p90", "p90 ≥1% of job", "cost runs")  # fmt: skip


def _fmt(v: object) -> str:
    return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))


def _cells(m: dict, cols: tuple[str, ...] = COLS) -> list[str]:
    """A row's cells; cost columns read n/a for hangs (their cost is the stopped job's GPU
    time by definition, not an estimate to check)."""
    return ["n/a" if m.get("cost_na") and c.startswith("cost_") else _fmt(m[c]) for c in cols]


def register(app: typer.Typer) -> None:
    @app.command("eval")
    def eval_cmd(
        gpus: str = typer.Option("256,1024", envvar="FLARE_EVAL_GPUS", help="layout sizes"),
        seeds: int = typer.Option(1, min=1, envvar="FLARE_EVAL_SEEDS", help="seeds per cell"),
        clean_steps: int = typer.Option(10_000, min=0, help="clean steps in total"),
        jobs: int = typer.Option(2, min=1, help="worker processes"),
        families: str = typer.Option("", help="only these fault families (comma-separated)"),
        as_json: bool = typer.Option(
            False, "--json", help="print the results as JSON (the document --out writes) "
            "instead of the tables"),
        out: Path | None = typer.Option(None, "--out", dir_okay=False,
                                        help="also write the results as JSON to this file"),
        conditions: str = typer.Option("", help=_CONDITIONS_HELP),
        heartbeats: str | None = typer.Option(
            None,
            help="'all': heartbeats in every run (false hangs show); 'hang': in hang runs "
            "only. Default: all with --conditions, hang without",
        ),  # fmt: skip
    ) -> None:
        """Run every fault family × severity × layout plus clean runs; print the scores."""
        import orjson
        from rich.console import Console

        from flare.eval_conditions import condition_scenarios, parse_conditions
        from flare.evaluation import clean_scenarios, fault_scenarios, summarize_results
        from producers.simulator import FAMILIES

        sizes = _parse_gpus(gpus)
        if heartbeats not in (None, "all", "hang"):
            raise typer.BadParameter("--heartbeats takes 'all' or 'hang'")
        wanted = [f.strip() for f in families.split(",") if f.strip()]
        unknown = [f for f in wanted if f not in FAMILIES]
        if unknown:
            raise typer.BadParameter(f"--families: {unknown[0]!r} is not one of "
                                     f"{', '.join(FAMILIES)}")  # fmt: skip
        names: list[str] | None = None  # the condition of each scenario
        cond_names: list[str] | None = None
        if conditions:
            try:
                conds = parse_conditions(conditions)
            except ValueError as exc:
                raise typer.BadParameter(str(exc)) from None
            pairs = condition_scenarios(conds, sizes, seeds, clean_steps, wanted or FAMILIES)
            if heartbeats == "hang":
                from dataclasses import replace

                hang = ("hang_rank", "comm_hang")
                pairs = [(c, replace(sc, heartbeats=any(f is not None and f.family in hang
                                                        for f in (sc.fault, sc.fault2))))
                         for c, sc in pairs]  # fmt: skip
            scen = [sc for _, sc in pairs]
            names = [c for c, _ in pairs]
            cond_names = [c.name for c in conds]
        else:
            every = heartbeats == "all"
            if wanted:
                scen = fault_scenarios(sizes, seeds, wanted, all_heartbeats=every)
            else:
                scen = fault_scenarios(sizes, seeds, all_heartbeats=every)
            scen += clean_scenarios(sizes, clean_steps, every) if clean_steps else []
        results = _run(scen, jobs, names)
        doc = summarize_results(results, sizes, seeds, cond_names)
        title = f"flare eval --gpus {gpus} --seeds {seeds}"
        width = max(Console().width, 150)  # every column unclipped, cost ones included
        if as_json:
            typer.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
        elif cond_names:
            _print_conditions(doc, title + f" --conditions {conditions}", width)
        else:
            _print_families(doc, title, width)
        if doc["errors"]:
            Console(stderr=True).print(
                f"[red]{len(doc['errors'])} run(s) crashed[/red] (scored up to the crash), "
                f"first: {doc['errors'][0]['name']}: {doc['errors'][0]['error']}"
            )
        if out:
            try:
                out.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
            except OSError as exc:
                typer.echo(f"error: cannot write {out}: {exc.strerror}", err=True)
                raise typer.Exit(2) from None


def _run(scen: list, jobs: int, names: list[str] | None) -> list:
    from rich.console import Console
    from rich.progress import Progress

    from flare.evaluation import run_all

    with Progress(console=Console(stderr=True)) as bar:
        task = bar.add_task("scenarios", total=len(scen))
        return run_all(scen, jobs=jobs, progress=lambda _r: bar.advance(task), conditions=names)


def _table(title: str, first: str):  # noqa: ANN202
    from rich.table import Table

    table = Table(title=title)
    table.add_column(first)
    for h in HEADS:
        table.add_column(h, justify="right")
    return table


def _print_families(doc: dict, title: str, width: int) -> None:
    """The table of old: a row per family, per layout size, and overall."""
    from rich.console import Console

    table = _table(title, "family")
    for fam, m in doc["families"].items():
        table.add_row(fam, *_cells(m))
    for g, m in doc["by_gpus"].items():
        table.add_row(f"all at {g} GPUs", *_cells(m), style="italic")
    table.add_row("overall", *_cells(doc["overall"]), style="bold")
    Console(width=width).print(table)


def _print_conditions(doc: dict, title: str, width: int) -> None:
    """A row per condition, then top-1 / kind of every family under every condition (the
    clean row: false device incidents per 10,000 clean steps)."""
    from rich.console import Console
    from rich.table import Table

    conds = list(doc["by_condition"])
    console = Console(width=max(width, 17 + sum(max(len(c), 7) + 3 for c in conds)))
    table = _table(title, "condition")
    table.add_column("both found", justify="right")  # two simultaneous faults
    for cond, part in doc["by_condition"].items():
        m = part["overall"]
        table.add_row(cond, *_cells(m, (*COLS, "found_all")))
    table.add_row("overall", *_cells(doc["overall"], (*COLS, "found_all")), style="bold")
    console.print(table)
    fams = sorted({f for part in doc["by_condition"].values() for f in part["families"]})
    grid = Table(title="top-1 % / kind % per family and condition (clean: false per 10k steps)")
    grid.add_column("family")
    for c in conds:
        grid.add_column(c, justify="right")
    for fam in fams:
        cells = []
        for c in conds:
            m = doc["by_condition"][c]["families"].get(fam)
            if m is None:
                cells.append("")
            elif fam == "clean":
                cells.append(f"{m['false_per_10k_clean_steps']:.1f}")
            else:
                cells.append(f"{100 * m['top1']:.0f}/{100 * m['kind']:.0f}")
        grid.add_row(fam, *cells)
    console.print(grid)
