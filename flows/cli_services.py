"""`lmforge pipeline | up | down | serve`: the whole DAG from the terminal, local services, UI deployments."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path
from typing import Any

STATE_DIR = Path(".lmforge")


@contextmanager
def prefect_api(state_dir: Path) -> Iterator[str]:
    """PREFECT_API_URL if set (a running server), else a temporary local server whose database persists in
    `<state_dir>/prefect`, so the Prefect UI can show the runs afterwards."""
    from infra.environment import environment
    from infra.services import free_port, prefect_env, start_prefect, stop

    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    running = start_prefect(state_dir, port=free_port())
    with environment(PREFECT_API_URL=f"{running.url}/api", **prefect_env(state_dir)):
        try:
            # a scheduler's SIGTERM still stops the server (it runs in its own session)
            with exit_on_sigterm():
                yield os.environ["PREFECT_API_URL"]
        finally:
            _drain_prefect_logs()  # send queued run logs while the server is still up
            stop(running)


@contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """Within the block, SIGTERM ends this process through SystemExit(143), so `finally` blocks run (by default it
    ends at once). Training's own handler (training/preemption.py) takes over while a loop runs; a child forked
    meanwhile keeps the default action; an ignored SIGTERM or another handler is left alone."""
    owner = os.getpid()

    def terminate(number: int, frame: object) -> None:
        if os.getpid() != owner:
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        raise SystemExit(128 + number)

    if (
        threading.current_thread() is not threading.main_thread()  # signals reach the main thread only
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # ignored, or someone else's handler
    ):
        yield
        return
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _drain_prefect_logs() -> None:
    try:
        from prefect.logging.handlers import APILogWorker

        APILogWorker.drain_all(timeout=10)
    except Exception:  # noqa: BLE001 - nothing was logged to the API
        pass


def pipeline_params(args: argparse.Namespace) -> Any:
    """The pipeline flow's parameters from `lmforge pipeline` flags (validated: the recipe loads). Imports
    Prefect: call it once the Prefect API is chosen."""
    from flows.pipeline import pipeline_params as params

    return params()(
        recipe=args.recipe,
        overrides=args.set,
        size=args.size,
        budget=args.budget,
        rung_multiple=args.rung_multiple,
        **switches(args),
    )


def switches(args: argparse.Namespace) -> dict[str, bool]:
    """Each optional stage's switch as the `lmforge pipeline` flags set it."""
    from flows.registry import toggles

    return {name: getattr(args, name) for name in toggles()}


def cmd_pipeline(args: argparse.Namespace) -> int:
    from flows.recipe import load_recipe
    from flows.registry import enable, pipeline_stages, preflight

    recipe = load_recipe(args.recipe, args.set)  # refuse bad input before starting anything
    preflight(recipe, enable(pipeline_stages(switches(args), args.size)))
    state = Path(recipe.output_dir) / "services"
    with prefect_api(state):  # Prefect reads its settings once, at import: import it inside
        from flows.pipeline import pipeline

        summary = pipeline(pipeline_params(args))
    print_summary(summary)
    print_review(recipe, state)
    return 0


def print_review(recipe: Any, state: Path) -> None:
    """Commands (absolute, so they work from any directory) that open the MLflow and Prefect UIs on this run."""
    import sys

    from infra.tracking import find_experiment, tracking_uri

    uri = tracking_uri(recipe.tracking, recipe.output_dir)
    bin_dir = Path(sys.executable).parent.resolve()
    experiment = find_experiment(uri, recipe.tracking.experiment)
    runs = f"#/experiments/{experiment}/runs" if experiment else ""
    print("\nReview the results:")
    if uri.startswith(("http://", "https://")):
        print(f"  MLflow:  {uri.rstrip('/')}/{runs}")
    else:
        print(
            f"  MLflow:  {bin_dir / 'mlflow'} ui --backend-store-uri {uri} --port 5000   # then http://127.0.0.1:5000/{runs}"
        )
    if os.environ.get("PREFECT_API_URL"):
        print(f"  Prefect: {os.environ['PREFECT_API_URL'].removesuffix('/api')}/runs")
    else:
        # the UI calls the API URL it was given (default :4200), so another port is changed in both places
        print(
            f"  Prefect: PREFECT_HOME={(state / 'prefect').resolve()} PREFECT_SERVER_ANALYTICS_ENABLED=false"
            f" PREFECT_UI_API_URL=http://127.0.0.1:4200/api {bin_dir / 'prefect'} server start --port 4200"
            "   # then http://127.0.0.1:4200/runs (another port: change all three 4200s)"
        )


def print_summary(summary: dict[str, Any]) -> None:
    """Each stage's report in DAG order, the outputs, the stage times."""
    for report in summary["reports"].values():
        print(f"\n{report}")
    if summary.get("outputs"):
        print("\nOutputs:")
        for what, where in summary["outputs"].items():
            print(f"  {what:<20} {where}")
    seconds = summary["stage_seconds"]
    print(
        "\nStage times: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in seconds.items())
        + f"; total {summary['wall_seconds']:.0f} s, orchestration overhead {summary['orchestration_overhead']:.1%}"
    )


def cmd_up(args: argparse.Namespace) -> int:
    """Start Prefect, MLflow and (unless --no-ray) a Ray head side by side; each is recorded as soon as it is
    healthy, and a failure stops every one that started."""
    from infra.services import (
        LOOPBACK_RAY,
        ServiceError,
        check_bind,
        check_ports,
        is_loopback,
        is_running,
        load_state,
        ray_ports,
        save_state,
        start_mlflow,
        start_prefect,
        start_ray,
        stop_all,
    )

    state = Path(args.state_dir).resolve()
    if alive := [r.name for r in load_state(state) if is_running(r)]:
        raise ServiceError(
            f"{', '.join(alive)} from an earlier `lmforge up` still run ({state}): `lmforge down` first"
        )
    for service in ("prefect", "mlflow", *(() if args.no_ray else ("ray",))):
        check_bind(service, args.host)  # refuse before starting anything
    ports = {"--prefect-port": args.prefect_port, "--mlflow-port": args.mlflow_port}
    if not args.no_ray:
        ports |= {"--ray-port": args.ray_port, "--ray-dashboard-port": args.ray_dashboard_port}
    check_ports(ports)
    if not args.no_ray:
        ray_ports(args.ray_port, args.ray_dashboard_port)
    outputs = Path(args.outputs).resolve()
    outputs.mkdir(parents=True, exist_ok=True)
    starters = [
        lambda: start_prefect(state, args.host, args.prefect_port),
        lambda: start_mlflow(
            state, f"sqlite:///{outputs / 'mlflow.db'}", outputs / "mlartifacts", args.host, args.mlflow_port
        ),
    ]
    if not args.no_ray:
        starters.append(lambda: start_ray(state, args.host, args.ray_port, args.ray_dashboard_port))
    running: list[Any] = []
    with ThreadPoolExecutor(len(starters)) as pool:  # they start side by side, each recorded once healthy
        futures = [pool.submit(start) for start in starters]
        try:
            for future in as_completed(futures):
                running.append(future.result())
                save_state(state, running)
        except BaseException:
            for future in futures:  # let the others finish starting, then stop every one that did
                with contextlib.suppress(BaseException):
                    if (started := future.result()) not in running:
                        running.append(started)
            stop_all(running)
            save_state(state, [])
            raise
    urls = {r.name: r.url for r in running}
    print(json.dumps(urls, indent=2))
    print("\nPoint lmforge at them (then `lmforge serve` to get the Run buttons):")
    print(f"  export PREFECT_API_URL={urls['prefect']}/api LMFORGE_TRACKING_URI={urls['mlflow']}")
    if "ray" in urls:
        token = state / "ray_auth_token"
        token_path = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(token)
        loopback = (
            " ".join(f"{k}={v}" for k, v in LOOPBACK_RAY.items()) + " " if is_loopback(args.host) else ""
        )
        print(
            f"  export RAY_ADDRESS={args.host}:{args.ray_port} RAY_API_SERVER_ADDRESS={urls['ray']} {loopback}"
            f"RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={token_path}"
        )
        print(
            f"  Ray dashboard and Jobs API: {urls['ray']} (the dashboard asks for the token in {token_path})"
        )
    print(f"Logs in {state}; stop them with `lmforge down --state-dir {state}`.")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """Stop exactly the process groups `up` recorded, by PID."""
    from infra.services import load_state, save_state, stop_all

    state = Path(args.state_dir)
    services = load_state(state)
    if not services:
        print(f"nothing recorded in {state.resolve()}: no services to stop")
    stop_all(services)  # side by side: one grace period for all of them
    for running in services:
        print(f"stopped {running.name} ({running.url}, process group {running.pid})")
    save_state(state, [])
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve every flow as a deployment so the Prefect UI's Run button works (blocks; Ctrl-C stops)."""
    from infra.services import load_state

    if not os.environ.get("PREFECT_API_URL"):
        prefect = next((r for r in load_state(Path(args.state_dir)) if r.name == "prefect"), None)
        if prefect is None:
            raise ValueError("no Prefect server: run `lmforge up` first, or set PREFECT_API_URL")
        os.environ["PREFECT_API_URL"] = f"{prefect.url}/api"
    # a Run button's flow run starts within ~2 s (Prefect's runner looks for scheduled runs every 10 s by default)
    os.environ.setdefault("PREFECT_RUNNER_POLL_FREQUENCY", "2")
    from prefect import serve

    from flows.pipeline import FLOWS

    serve(
        *(f.to_deployment(name="lmforge", tags=["lmforge"]) for f in FLOWS.values()), pause_on_shutdown=False
    )
    return 0


def add_service_commands(commands: Any, add_set_argument: Any) -> None:
    pipe = commands.add_parser(
        "pipeline", help="the whole DAG: tokenize, sweep, fit, pretrain, rung, SFT, evaluate, register"
    )
    pipe.add_argument("recipe", help="recipe path or name in configs/")
    pipe.add_argument(
        "--size",
        choices=["fit", "recipe"],
        default="fit",
        help="model size from the scaling fit (default) or the recipe",
    )
    pipe.add_argument(
        "--budget",
        type=float,
        help="compute budget in FLOPs for the final model (default: sweep.target_budget)",
    )
    pipe.add_argument(
        "--rung-multiple",
        type=float,
        help="size the final model for this multiple of the largest swept budget (sweep.rung_multiple, default 3)",
    )
    from flows.registry import toggles

    for name, toggle in toggles().items():  # one switch per optional stage
        action = "store_false" if toggle.default else "store_true"
        pipe.add_argument(
            toggle.cli_flag, dest=name, action=action, help=f"{toggle.title}: {toggle.description}"
        )
    add_set_argument(pipe)
    pipe.set_defaults(handler=cmd_pipeline)

    for name, handler, text in (
        ("up", cmd_up, "start Prefect, MLflow and a Ray head on 127.0.0.1"),
        ("down", cmd_down, "stop what `up` started"),
        ("serve", cmd_serve, "serve the flows as deployments (Prefect UI Run button)"),
    ):
        sub = commands.add_parser(name, help=text)
        sub.add_argument("--state-dir", default=str(STATE_DIR), help="where service logs and state live")
        if name == "up":
            sub.add_argument(
                "--host", default="127.0.0.1", help="bind address (non-loopback needs authentication)"
            )
            sub.add_argument(
                "--outputs", default="outputs", help="MLflow store: <outputs>/mlflow.db and mlartifacts/"
            )
            sub.add_argument("--prefect-port", type=int, default=4200)
            sub.add_argument("--mlflow-port", type=int, default=5000)
            sub.add_argument("--ray-port", type=int, default=6379)
            sub.add_argument("--ray-dashboard-port", type=int, default=8265)
            sub.add_argument("--no-ray", action="store_true")
        sub.set_defaults(handler=handler)
