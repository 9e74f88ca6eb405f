"""`flare chaos`: one real fault on this node for a while, then undone, to check Flare live.

A drill (`flare drill`) proves Flare on a run's own hosts; on a real cluster an SRE wants to
slow one real rank or NIC for a minute and see the incident. Exactly one target must be named
(the command refuses to guess one), and the fault is undone when the duration ends, on
Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

from typing import NoReturn

import typer


def register(app: typer.Typer) -> None:
    @app.command("chaos")
    def chaos_cmd(
        duration: float = typer.Option(..., "--duration", help="seconds the fault lasts"),
        cpu_quota: int = typer.Option(
            None, "--cpu-quota", metavar="PID", help="hold this process to --cpus of a CPU"),
        cpus: float = typer.Option(0.2, help="with --cpu-quota: CPUs it may use"),
        rate_limit: str = typer.Option(
            None, "--rate-limit", metavar="IFACE", help="hold what this interface sends to "
            "--mbit (tbf)"),
        mbit: float = typer.Option(50.0, help="with --rate-limit: the rate, Mbit/s"),
        netns: str = typer.Option(None, help="with --rate-limit: the interface's namespace"),
        flap_s: float = typer.Option(
            0.0, help="with --rate-limit: switch the limit on and off every this many s"),
        freeze: int = typer.Option(None, "--freeze", metavar="PID", help="stop this process"),
        gpu_clock: int = typer.Option(
            None, "--gpu-clock", metavar="INDEX", help="lock this GPU's clock to --mhz "
            "(nvidia-smi -lgc; reset with -rgc)"),
        mhz: int = typer.Option(600, help="with --gpu-clock: the clock, MHz"),
    ) -> None:
        """Apply one fault (CPU quota, NIC rate limit, freeze or GPU clock lock) for
        --duration, then undo it."""
        import signal
        import time

        from flare.drill.faults import (
            CpuQuota,
            Fault,
            FaultError,
            Flapping,
            Freeze,
            GpuClockLock,
            Interface,
            RateLimit,
        )

        targets = [t for t in (cpu_quota, rate_limit, freeze, gpu_clock) if t is not None]
        if len(targets) != 1:
            _fail("name exactly one target: --cpu-quota PID, --rate-limit IFACE, --freeze PID "
                  "or --gpu-clock INDEX")
        if duration <= 0:
            _fail("--duration must be > 0 seconds")
        fault: Fault
        try:
            if cpu_quota is not None:
                fault, what = CpuQuota(cpu_quota, cpus, name=f"flare-chaos-{cpu_quota}"), (
                    f"CPU quota {cpus:g} on process {cpu_quota}")
            elif freeze is not None:
                fault, what = Freeze(freeze, name=f"flare-chaos-{freeze}"), (
                    f"freeze of process {freeze}")
            elif gpu_clock is not None:
                fault, what = GpuClockLock(gpu_clock, mhz), (
                    f"clock of GPU {gpu_clock} locked to {mhz} MHz")
            else:
                limit = RateLimit([Interface(rate_limit, netns)], mbit)
                fault = Flapping(limit, flap_s, flap_s) if flap_s > 0 else limit
                what = f"{mbit:g} Mbit/s on {rate_limit}" + (
                    f", flapping every {flap_s:g} s" if flap_s > 0 else "")
        except ValueError as exc:
            _fail(str(exc))

        def stop(_sig: int, _frame: object) -> None:
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, stop)
        started = time.monotonic()
        try:
            fault.apply()
        except FaultError as exc:
            _fail(str(exc))
        typer.echo(f"applied: {what} for {duration:g} s")
        try:
            time.sleep(duration)
        except KeyboardInterrupt:
            pass
        finally:
            fault.undo()
            typer.echo(f"undone: {what} after {time.monotonic() - started:.1f} s")


def _fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
