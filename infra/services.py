"""Local services for people who want the UIs: a Prefect server, an MLflow server and a Ray head, bound to
127.0.0.1, health-checked, recorded in `<state_dir>/services.json` and stopped by `lmforge down`.

Binding anything but loopback is refused unless authentication is configured for that service (see
`check_bind`): Prefect's API auth string, MLflow's basic-auth app with a non-default admin password, Ray's token
auth. Whoever reaches an unauthenticated port can run code on this machine.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import secrets
import shutil
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path

import psutil

from infra.errors import UserError
from infra.mlflow_template import seed_store

log = logging.getLogger(__name__)

STATE_FILE = "services.json"
DEFAULT_PORTS = {"prefect": 4200, "mlflow": 5000, "ray": 6379, "ray_dashboard": 8265}
AUTH_ENV = {
    "prefect": ("PREFECT_SERVER_API_AUTH_STRING",),
    "mlflow": ("MLFLOW_FLASK_SERVER_SECRET_KEY", "MLFLOW_AUTH_CONFIG_PATH"),
    "ray": ("RAY_AUTH_MODE",),
}


class ServiceError(UserError):
    """A service could not start or is configured unsafely; the message says how to fix it."""


@dataclass
class Running:
    """A service `up` started: `pid` leads its own process group, `started` is its create time and `since_boot`
    the same counted from the machine's boot (so a recycled PID is never signalled)."""

    name: str
    pid: int
    url: str
    log: str
    started: float = 0.0
    since_boot: float = 0.0

    @classmethod
    def of(cls, name: str, pid: int, url: str, log: str) -> Running:
        """The record of the process `pid`, just started."""
        proc = psutil.Process(pid)
        return cls(name, pid, url, log, proc.create_time(), _since_boot(proc))

    def is_process(self, proc: psutil.Process) -> bool:
        """Whether `proc` is the process recorded, not another one given its PID since: by its start counted from
        boot, which clock adjustments do not move. A create time in epoch seconds is boot time plus ticks, and the
        kernel's boot time moves with the clock (NTP; a VM catching up after a pause: 25 s within ten minutes on a
        CI host); matched to 1 ms, it took live services for recycled PIDs and `stop` left them running. Records
        without `since_boot` match on the epoch start, within a second."""
        if self.since_boot:
            return abs(_since_boot(proc) - self.since_boot) < 1.0
        return not self.started or abs(proc.create_time() - self.started) < 1.0


def _since_boot(proc: psutil.Process) -> float:
    """When `proc` started, in seconds after the machine's boot (its epoch create time less the boot time, both read
    now, so a clock adjustment between its start and now cancels)."""
    return proc.create_time() - psutil.boot_time()


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
        # `up` turns token auth on unless RAY_AUTH_MODE says otherwise
        configured = env.get("RAY_AUTH_MODE", "token").lower() == "token"
    if service == "mlflow" and configured:
        password = env.get("MLFLOW_AUTH_ADMIN_PASSWORD", "password1234")
        configured = password != "password1234"
    if not configured:
        needs = {
            "prefect": "set PREFECT_SERVER_API_AUTH_STRING (clients: PREFECT_API_AUTH_STRING)",
            "mlflow": "run the basic-auth app: set MLFLOW_FLASK_SERVER_SECRET_KEY, MLFLOW_AUTH_CONFIG_PATH and a "
            "non-default admin password (MLFLOW_AUTH_ADMIN_PASSWORD)",
            "ray": "unset RAY_AUTH_MODE (`up` runs Ray with token auth)",
        }[service]
        raise ServiceError(
            f"refusing to bind {service} to {host} without authentication: anyone who can reach it can run "
            f"code on this machine. Bind 127.0.0.1 (the default), or {needs}"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    url: str,
    proc: subprocess.Popen | None,
    log: Path,
    timeout: float = 120.0,
    headers: dict[str, str] | None = None,
) -> None:
    """Poll `url` (with `headers`) until it answers 200; fail early if `proc` (when given) exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServiceError(f"{url}: the process exited with {proc.returncode}; see {log}")
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, headers=headers or {}), timeout=2
            ) as response:
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
    """`prefect server start` with its database under `<state_dir>/prefect` (PREFECT_HOME). A new database starts
    as a copy of one this Prefect version already migrated (`prefect_template`): migrating a new one takes ~8 s of
    the server's ~14 s start."""
    check_bind("prefect", host)
    port = port or DEFAULT_PORTS["prefect"]
    home = Path(prefect_env(state_dir)["PREFECT_HOME"])
    template = prefect_template()
    fresh = not (home / PREFECT_DB).exists()
    if fresh and (template / PREFECT_DB).is_file():
        home.mkdir(parents=True, exist_ok=True)
        for name in (PREFECT_DB, PREFECT_MEMO):
            if (template / name).is_file():
                shutil.copyfile(template / name, home / name)
    api = f"http://{host}:{port}/api"  # the UI must call this server, not the default :4200
    env = {
        **os.environ,
        **prefect_env(state_dir),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": api,
        "PREFECT_SERVER_UI_API_URL": api,
    }
    env.pop("PREFECT_API_URL", None)
    running = _spawn(
        "prefect",
        [_bin("prefect"), "server", "start", "--host", host, "--port", str(port)],
        env,
        state_dir,
        f"http://{host}:{port}",
        "/api/health",
    )
    if fresh and not (template / PREFECT_DB).is_file():
        save_prefect_template(home, template)
    return running


PREFECT_DB = "prefect.db"
PREFECT_MEMO = "memo_store.toml"  # the record of the block types registered in the database


def prefect_template() -> Path:
    """Where this Prefect version's migrated, empty database is kept (in lmforge's cache)."""
    from infra.mirror import cache_root  # (object storage's imports, not needed by `lmforge up` otherwise)

    return cache_root() / "prefect-db" / version("prefect")


def save_prefect_template(home: Path, template: Path) -> None:
    """Keep a consistent copy of a just-migrated database (SQLite's backup, safe while the server writes) as the
    template; best effort: without it the next server migrates its own."""
    staging = template.with_name(f".{template.name}-{os.getpid()}")
    try:
        staging.mkdir(parents=True, exist_ok=True)
        with (
            contextlib.closing(sqlite3.connect(home / PREFECT_DB)) as source,
            contextlib.closing(sqlite3.connect(staging / PREFECT_DB)) as copy,
        ):
            source.backup(copy)
        if (home / PREFECT_MEMO).is_file():
            shutil.copyfile(home / PREFECT_MEMO, staging / PREFECT_MEMO)
        staging.rename(template)  # whole, or not at all (another process may have won: then its copy stays)
    except (OSError, sqlite3.Error) as error:
        log.debug("no Prefect database template kept: %s", error)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def prefect_env(state_dir: Path) -> dict[str, str]:
    return {"PREFECT_HOME": str((state_dir / "prefect").resolve())}


def start_mlflow(
    state_dir: Path, backend_uri: str, artifacts: Path, host: str = "127.0.0.1", port: int | None = None
) -> Running:
    """`mlflow server` over the project's store (sqlite by default; a new one starts as a copy of a migrated empty
    one), serving artifacts from `artifacts`, without MLflow's job runner unless the environment asks for it."""
    check_bind("mlflow", host)
    seed_store(backend_uri)
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
    # MLflow's job runner (GenAI judges, prompt optimisation: nothing lmforge uses) is eight more Python processes
    # importing MLflow beside the server; it stays off unless the environment turns it on
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ}
    return _spawn("mlflow", cmd, env, state_dir, f"http://{host}:{port}", "/health")


def ray_token(state_dir: Path) -> tuple[str, Path]:
    """The Ray auth token and the file holding it: `RAY_AUTH_TOKEN_PATH` or `RAY_AUTH_TOKEN` when the user gave
    one, else `<state_dir>/ray_auth_token`, created once (mode 0600)."""
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser()
        if not path.is_file():
            raise ServiceError(f"RAY_AUTH_TOKEN_PATH={path} does not exist: create it or unset the variable")
        return path.read_text().strip(), path.resolve()
    path = (state_dir / "ray_auth_token").resolve()
    if os.environ.get("RAY_AUTH_TOKEN"):
        token = os.environ["RAY_AUTH_TOKEN"]
    elif path.is_file():
        token = path.read_text().strip()
    else:
        token = secrets.token_hex(32)
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(token)
    return token, path


def ray_env(state_dir: Path, host: str) -> tuple[dict[str, str], str]:
    """The environment a Ray node of `lmforge up` runs with, and its token: token auth on, deliberately (Ray
    2.60 turns it on by default and a health check without the token gets 401), on loopback a node address
    that stays loopback (`ray start` otherwise swaps 127.0.0.1 for the host's outward address), and this
    environment's `bin/` first on the PATH, so a submitted job finds `lmforge` though no one activated it."""
    token, path = ray_token(state_dir)
    path_dirs = [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(path),
        "PATH": os.pathsep.join(d for d in path_dirs if d),
    }
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    if is_loopback(host):
        env.update(LOOPBACK_RAY)
    return env, token


# a Ray process whose node address stays loopback (ray/_private/services.py `get_node_ip_address`): the head of
# `lmforge up --host 127.0.0.1`, and any driver that connects to it (`ray.init()` otherwise waits on the host's
# outward address, where the head does not listen)
LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


RAY_WORKER_PORTS = range(10002, 20000)  # `ray start`'s default --min-worker-port..--max-worker-port


def check_ports(ports: dict[str, int]) -> None:
    """Refuse, before anything starts, a port no service can listen on (outside 1-65535) or one given to two of them
    (`--ray-port 70000` used to print an address nothing listened on)."""
    for flag, port in ports.items():
        if not 1 <= port <= 65535:
            raise ServiceError(f"{flag} {port} is not a port (1-65535); pick one in that range")
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port in seen:
            raise ServiceError(
                f"{flag} and {seen[port]} are both {port}; give each service a port of its own"
            )
        seen[port] = flag


def ray_ports(port: int | None, dashboard_port: int | None) -> tuple[int, int]:
    """The head and dashboard ports (defaults for None); one inside the range Ray hands its workers is refused
    (the head starts, then fails to come up after a long wait)."""
    port, dashboard_port = port or DEFAULT_PORTS["ray"], dashboard_port or DEFAULT_PORTS["ray_dashboard"]
    for flag, value in (("--ray-port", port), ("--ray-dashboard-port", dashboard_port)):
        if value in RAY_WORKER_PORTS:
            raise ServiceError(
                f"{flag} {value} lies in Ray's worker-port range {RAY_WORKER_PORTS.start}-{RAY_WORKER_PORTS.stop - 1}; "
                "pick a port outside it"
            )
    return port, dashboard_port


def start_ray(
    state_dir: Path,
    host: str = "127.0.0.1",
    port: int | None = None,
    dashboard_port: int | None = None,
    num_cpus: int | None = None,
) -> Running:
    """A Ray head (`ray start --head --block`, so it is one process group that `stop` ends) bound to `host`,
    with token auth; the dashboard (Ray Jobs API) on `dashboard_port`."""
    check_bind("ray", host)
    port, dashboard_port = ray_ports(port, dashboard_port)
    env, token = ray_env(state_dir, host)
    cmd = [
        _bin("ray"),
        "start",
        "--head",
        "--block",
        "--node-ip-address",
        host,
        "--port",
        str(port),
        "--dashboard-host",
        host,
        "--dashboard-port",
        str(dashboard_port),
        "--ray-client-server-port",
        str(free_port()),
        "--num-cpus",
        str(num_cpus or os.cpu_count() or 1),
        "--disable-usage-stats",
    ]
    headers = {"Authorization": f"Bearer {token}"}
    return _spawn("ray", cmd, env, state_dir, f"http://{host}:{dashboard_port}", "/api/version", headers)


def _spawn(
    name: str,
    cmd: list[str],
    env: dict[str, str],
    state_dir: Path,
    url: str,
    health: str,
    headers: dict[str, str] | None = None,
) -> Running:
    """Start `cmd` as the leader of a new process group, wait until `url + health` answers, record it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    log = state_dir / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    running = Running.of(name, proc.pid, url, str(log))
    try:
        wait_healthy(url + health, proc, log, headers=headers)
    except BaseException:
        stop(running)
        raise
    return running


def members(running: Running) -> list[psutil.Process]:
    """The live processes of `running`'s process group, if its leader is still the process we started (a
    recycled PID is left alone)."""
    try:
        if not running.is_process(psutil.Process(running.pid)):
            return []
    except psutil.NoSuchProcess:
        pass  # the leader may exit before its group: the group id stays ours while members live
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == running.pid:
                found.append(proc)
        except (ProcessLookupError, psutil.Error):
            continue
    return found


def stop(running: Running, timeout: float = 10.0) -> None:
    """Stop the process group `running` started (its leader's PID): SIGTERM, then SIGKILL to what is left after
    `timeout` seconds. Nothing else on the host is touched."""
    stop_all([running], timeout)


def stop_all(services: Sequence[Running], timeout: float = 10.0) -> None:
    """`stop` for several services at once, waited for together (one grace period, not one per service).

    SIGTERM goes to each group's leader first, which stops its own children in the order it needs (`ray start
    --block` ends its raylet before the GCS; a raylet whose GCS died first waited out the whole grace period);
    members still alive once their leader is gone get SIGTERM in turn. The groups are read again while waiting, so
    a process started during the shutdown is not missed by the final SIGKILL."""
    signalled: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        groups = [(running, _live(running)) for running in services]
        alive = [proc for _, procs in groups for proc in procs]
        if not alive:
            return
        if time.monotonic() > deadline:
            for proc in alive:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(alive, timeout=5)
            return
        for running, procs in groups:
            leader_alive = any(proc.pid == running.pid for proc in procs)
            for proc in procs:
                if proc.pid not in signalled and (proc.pid == running.pid or not leader_alive):
                    with contextlib.suppress(psutil.Error):
                        proc.terminate()
                    signalled.add(proc.pid)
        psutil.wait_procs(alive, timeout=0.2)  # also reaps those that are this process's children


def _live(running: Running) -> list[psutil.Process]:
    """`running`'s group members that have not exited (a zombie is one whose parent has not yet reaped it)."""
    live = []
    for proc in members(running):
        with contextlib.suppress(psutil.Error):
            if proc.status() != psutil.STATUS_ZOMBIE:
                live.append(proc)
    return live


def is_running(running: Running) -> bool:
    return bool(members(running))


def save_state(state_dir: Path, services: list[Running]) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / f".{STATE_FILE}.tmp"
    tmp.write_text(json.dumps([asdict(s) for s in services], indent=2))
    tmp.replace(state_dir / STATE_FILE)


def load_state(state_dir: Path) -> list[Running]:
    path = state_dir / STATE_FILE
    if not path.is_file():
        return []
    try:
        return [Running(**s) for s in json.loads(path.read_text())]
    except (ValueError, TypeError) as error:
        raise ServiceError(
            f"{path}: unreadable ({error}); it records the processes `lmforge up` started: stop any still running "
            "(`ps -ef | grep -E 'mlflow|prefect|ray'`), then delete the file"
        ) from None
