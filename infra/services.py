"""Local services for people who want the UIs: a Prefect server, an MLflow server and a Ray head, bound to
127.0.0.1, health-checked, recorded in `<state_dir>/services.json` and stopped by `lmforge down`.

Binding anything but loopback is refused unless authentication is configured for that service (see
`check_bind`): Prefect's API auth string, MLflow's basic-auth app with a non-default admin password, Ray's token
auth. Whoever reaches an unauthenticated port can run code on this machine.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_FILE = "services.json"
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000, "ray": 6379, "ray_dashboard": 8265}
AUTH_ENV = {
    "prefect": ("PREFECT_SERVER_API_AUTH_STRING",),
    "mlflow": ("MLFLOW_FLASK_SERVER_SECRET_KEY", "MLFLOW_AUTH_CONFIG_PATH"),
    "ray": ("RAY_AUTH_MODE",),
}


class ServiceError(RuntimeError):
    """A service could not start or is configured unsafely; the message says how to fix it."""


@dataclass
class Running:
    name: str
    pid: int
    url: str
    log: str


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(service: str, host: str, env: dict[str, str] | None = None) -> None:
    """Refuse a non-loopback bind unless the service's authentication is configured in the environment."""
    env = dict(os.environ if env is None else env)
    if is_loopback(host):
        return
    configured = all(env.get(name) for name in AUTH_ENV[service])
    if service == "ray":
        configured = env.get("RAY_AUTH_MODE") == "token"
    if service == "mlflow" and configured:
        password = env.get("MLFLOW_AUTH_ADMIN_PASSWORD", "password1234")
        configured = password != "password1234"
    if not configured:
        needs = {
            "prefect": "set PREFECT_SERVER_API_AUTH_STRING (clients: PREFECT_API_AUTH_STRING)",
            "mlflow": "run the basic-auth app: set MLFLOW_FLASK_SERVER_SECRET_KEY, MLFLOW_AUTH_CONFIG_PATH and a "
            "non-default admin password (MLFLOW_AUTH_ADMIN_PASSWORD)",
            "ray": "set RAY_AUTH_MODE=token (and a token in RAY_AUTH_TOKEN or ~/.ray/auth_token)",
        }[service]
        raise ServiceError(
            f"refusing to bind {service} to {host} without authentication: anyone who can reach it can run "
            f"code on this machine. Bind 127.0.0.1 (the default), or {needs}"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None, log: Path, timeout: float = 120.0) -> None:
    """Poll `url` until it answers 200; fail early if `proc` (when given) exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServiceError(f"{url}: the process exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise ServiceError(f"{url} not healthy after {timeout:.0f} s; see {log}")


def _bin(name: str) -> str:
    candidate = Path(sys.executable).with_name(name)
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


def start_prefect(state_dir: Path, host: str = "127.0.0.1", port: int | None = None) -> Running:
    """`prefect server start` with its database under `<state_dir>/prefect` (PREFECT_HOME)."""
    check_bind("prefect", host)
    port = port or DEFAULT_PORTS["prefect"]
    api = f"http://{host}:{port}/api"  # the UI must call this server, not the default :4200
    env = {
        **os.environ,
        **prefect_env(state_dir),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": api,
        "PREFECT_SERVER_UI_API_URL": api,
    }
    env.pop("PREFECT_API_URL", None)
    return _spawn(
        "prefect",
        [_bin("prefect"), "server", "start", "--host", host, "--port", str(port)],
        env,
        state_dir,
        f"http://{host}:{port}",
        "/api/health",
    )


def prefect_env(state_dir: Path) -> dict[str, str]:
    return {"PREFECT_HOME": str((state_dir / "prefect").resolve())}


def start_mlflow(
    state_dir: Path, backend_uri: str, artifacts: Path, host: str = "127.0.0.1", port: int | None = None
) -> Running:
    """`mlflow server` over the project's store (sqlite by default), serving artifacts from `artifacts`."""
    check_bind("mlflow", host)
    port = port or DEFAULT_PORTS["mlflow"]
    cmd = [
        _bin("mlflow"),
        "server",
        "--backend-store-uri",
        backend_uri,
        "--artifacts-destination",
        str(artifacts.resolve()),
        "--host",
        host,
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    if not is_loopback(host):
        cmd += ["--app-name", "basic-auth"]
    return _spawn("mlflow", cmd, dict(os.environ), state_dir, f"http://{host}:{port}", "/health")


def start_ray(
    state_dir: Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    dashboard_port: int | None = None,
    num_cpus: int | None = None,
) -> Running:
    """`ray start --head` bound to `host`; the dashboard (Ray Jobs API) on `dashboard_port`."""
    check_bind("ray", host)
    port, dashboard_port = port or DEFAULT_PORTS["ray"], dashboard_port or DEFAULT_PORTS["ray_dashboard"]
    cmd = [
        _bin("ray"),
        "start",
        "--head",
        "--node-ip-address",
        host,
        "--port",
        str(port),
        "--dashboard-host",
        host,
        "--dashboard-port",
        str(dashboard_port),
        "--num-cpus",
        str(num_cpus or os.cpu_count() or 1),
        "--disable-usage-stats",
    ]
    log = state_dir / "ray.log"
    with open(log, "ab") as out:
        result = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ))
    if result.returncode:
        raise ServiceError(f"ray start failed ({result.returncode}); see {log}")
    url = f"http://{host}:{dashboard_port}"
    wait_healthy(url + "/api/version", None, log)  # `ray start` detaches the head
    return Running("ray", -1, url, str(log))


def _spawn(name: str, cmd: list[str], env: dict[str, str], state_dir: Path, url: str, health: str) -> Running:
    state_dir.mkdir(parents=True, exist_ok=True)
    log = state_dir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(url + health, proc, log)
    except ServiceError:
        os.killpg(proc.pid, signal.SIGTERM)
        raise
    return Running(name, proc.pid, url, str(log))


def stop(running: Running, timeout: float = 5.0) -> None:
    if running.name == "ray":
        subprocess.run([_bin("ray"), "stop", "--force"], capture_output=True)
        return
    try:
        os.killpg(running.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(running.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(running.pid, signal.SIGKILL)


def save_state(state_dir: Path, services: list[Running]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / STATE_FILE).write_text(json.dumps([asdict(s) for s in services], indent=2))


def load_state(state_dir: Path) -> list[Running]:
    path = state_dir / STATE_FILE
    return [Running(**s) for s in json.loads(path.read_text())] if path.is_file() else []
