"""`lmforge up` on a default install: Prefect, MLflow and a token-authenticated Ray head come up healthy, every
socket their processes listen on is loopback, each UI answers, the exports it prints run a user's journey exactly as
shown (from a shell that activated nothing: `ray.init()` connects, `lmforge submit pretrain` succeeds with its
outputs where the user's output_dir says and its run in MLflow), and `lmforge down` ends exactly those processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from infra.services import free_port, load_state, members
from tests.pretrain_helpers import clean_env, lmforge_command, smoke_overrides, with_sets

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=10
        ) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, ""


def listening_sockets(running) -> list[tuple[str, str, int]]:
    """(process name, address, port) of a service's listening sockets; a member that ends while it is read (Ray
    starts and ends helper processes) has none."""
    out = []
    for proc in members(running):
        with contextlib.suppress(psutil.NoSuchProcess):
            sockets = [c for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
            out += [(proc.name(), c.laddr.ip, c.laddr.port) for c in sockets]
    return out


def status(proc: psutil.Process) -> str | None:
    """The process's status; None once it no longer exists."""
    try:
        return proc.status()
    except psutil.NoSuchProcess:
        return None


def printed_exports(stdout: str) -> dict[str, str]:
    """The variables of every `export A=1 B=2` line `lmforge up` printed."""
    lines = [
        line.strip().removeprefix("export ")
        for line in stdout.splitlines()
        if line.strip().startswith("export ")
    ]
    return dict(item.split("=", 1) for line in lines for item in line.split())


def journey(stdout: str, env: dict[str, str], home: Path) -> None:
    """What a user does next, in `home`, with only the printed exports: `ray.init()` connects (it waited forever on
    the host's outward address); `lmforge submit pretrain smoke` with a relative output_dir succeeds though `lmforge`
    is not on their PATH, its outputs land in `home/outputs` (not Ray's temporary copy), and its run is in MLflow."""
    import mlflow

    from training.stages.lifecycle import TrainedModel

    user = {**env, **printed_exports(stdout)}
    connect = "import ray; ray.init(); print('cpus', ray.cluster_resources()['CPU']); ray.shutdown()"
    connected = subprocess.run(
        [sys.executable, "-c", connect], capture_output=True, text=True, env=user, timeout=120
    )
    assert connected.returncode == 0 and "cpus" in connected.stdout, connected.stderr[-2000:]
    sets = with_sets(smoke_overrides("outputs", "train.max_steps=4", "train.eval_every=4"))
    submitted = subprocess.run(
        lmforge_command("submit", "pretrain", "smoke", *sets),
        capture_output=True,
        text=True,
        env=user,
        cwd=home,
    )
    assert submitted.returncode == 0 and "SUCCEEDED" in submitted.stdout, (
        submitted.stdout[-3000:] + submitted.stderr[-2000:]
    )
    (run_dir,) = (home / "outputs" / "pretrain").iterdir()
    run = TrainedModel.load(run_dir)
    tracked = mlflow.MlflowClient(user["LMFORGE_TRACKING_URI"]).get_run(run.mlflow_run_id)
    assert tracked.info.status == "FINISHED" and "browse it: http" in submitted.stdout


def test_up_binds_loopback_and_down_stops_exactly_its_processes(tmp_path):
    env = {
        k: v for k, v in clean_env().items() if not k.startswith(("RAY_", "LMFORGE_", "MLFLOW_", "PREFECT_"))
    }
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(
        d for d in env["PATH"].split(os.pathsep) if d != venv_bin
    )  # nothing activated
    state = tmp_path / "state"
    ports = [str(free_port()) for _ in range(4)]
    up = subprocess.run(
        lmforge_command(
            "up",
            "--state-dir",
            str(state),
            "--outputs",
            str(tmp_path / "outputs"),
            *("--prefect-port", ports[0], "--mlflow-port", ports[1]),
            *("--ray-port", ports[2], "--ray-dashboard-port", ports[3]),
        ),
        capture_output=True,
        text=True,
        env=env,
        timeout=400,
    )
    services = {r.name: r for r in load_state(state)}
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-3000:]
        assert set(services) == {"prefect", "mlflow", "ray"}
        token = (state / "ray_auth_token").read_text().strip()
        assert oct((state / "ray_auth_token").stat().st_mode & 0o777) == "0o600"
        assert f"RAY_AUTH_TOKEN_PATH={state / 'ray_auth_token'}" in up.stdout

        listening = [
            (running.name, *socket) for running in services.values() for socket in listening_sockets(running)
        ]
        assert {name for name, *_ in listening} == {"prefect", "mlflow", "ray"}
        exposed = [s for s in listening if s[2] not in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
        assert not exposed, exposed

        assert _get(f"{services['prefect'].url}/api/health")[0] == 200
        code, page = _get(f"{services['prefect'].url}/")
        assert code == 200 and "<html" in page.lower()
        code, page = _get(f"{services['mlflow'].url}/")
        assert code == 200 and "<html" in page.lower()
        commands = [" ".join(p.cmdline()) for p in members(services["mlflow"]) if status(p) is not None]
        assert commands and not [c for c in commands if "mlflow.server.jobs" in c], commands  # no job runner
        assert _get(f"{services['ray'].url}/api/version")[0] in (401, 403)  # token auth is on
        code, version = _get(f"{services['ray'].url}/api/version", {"Authorization": f"Bearer {token}"})
        assert code == 200 and json.loads(version)["ray_version"]
        (tmp_path / "user").mkdir()
        journey(up.stdout, env, tmp_path / "user")

        again = subprocess.run(
            lmforge_command("up", "--state-dir", str(state)), capture_output=True, text=True, env=env
        )
        assert again.returncode == 2 and "lmforge down" in again.stderr, again.stderr
        assert len(again.stderr.strip().splitlines()) == 1
    finally:
        down = subprocess.run(
            lmforge_command("down", "--state-dir", str(state)), capture_output=True, text=True, env=env
        )
    assert down.returncode == 0, down.stderr
    assert not [
        p for r in services.values() for p in members(r) if status(p) not in (psutil.STATUS_ZOMBIE, None)
    ]
    assert load_state(state) == []


def test_up_refuses_a_public_bind_without_auth(tmp_path):
    env = {k: v for k, v in clean_env().items() if "AUTH" not in k}
    result = subprocess.run(
        lmforge_command("up", "--state-dir", str(tmp_path), "--host", "0.0.0.0"),
        capture_output=True,
        text=True,
        env=env,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "refusing to bind prefect to 0.0.0.0" in result.stderr
    assert load_state(tmp_path) == []


def test_sigterm_stops_the_temporary_prefect_server(tmp_path):
    """`lmforge pipeline` without PREFECT_API_URL starts a Prefect server in its own session; a scheduler's
    SIGTERM to the command must not leave that server running (it did: SIGTERM ended the command at once). Its
    freshly migrated database becomes the template of the next new one."""
    script = (
        "import sys, time\nfrom pathlib import Path\nfrom flows.cli_services import prefect_api\n"
        "with prefect_api(Path(sys.argv[1])) as url:\n    print(url, flush=True)\n    time.sleep(300)\n"
    )
    env = {k: v for k, v in clean_env().items() if not k.startswith("PREFECT_")}
    env["LMFORGE_CACHE"] = str(tmp_path / "cache")  # no database template yet: this server migrates its own
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "state")], stdout=subprocess.PIPE, text=True, env=env
    )
    url = proc.stdout.readline().strip()
    port = url.rsplit(":", 1)[1].split("/")[0]
    (server,) = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "server" in (p.info["cmdline"] or ()) and port in (p.info["cmdline"] or ())
    ]
    try:
        assert _get(f"{url}/health")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
        # the migrated database was kept as the template the next new database starts from (~8 s less)
        (template,) = (tmp_path / "cache" / "prefect-db").iterdir()
        with contextlib.closing(sqlite3.connect(template / "prefect.db")) as db:
            (migrated,) = db.execute("SELECT version_num FROM alembic_version").fetchone()
        with contextlib.closing(sqlite3.connect(tmp_path / "state" / "prefect" / "prefect.db")) as db:
            assert db.execute("SELECT version_num FROM alembic_version").fetchone() == (migrated,)
    finally:  # a failed check leaves nothing behind
        for leftover in (proc, server):
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                leftover.kill()
