"""Scale-out on a real two-node Ray cluster on this host (`ray start --head` plus a second `ray start
--address`): a 2-worker pretraining job submitted through the Ray Jobs API runs one worker per node, logs to
an MLflow server, survives a killed worker (FailureConfig) and ends with the undisturbed run's loss. Its outputs
live on an S3-protocol server and each node has a cache of its own, as nodes on different machines would: shards,
checkpoints and the run's files reach the other node only through the store."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlflow
import psutil
import pytest

from infra import ray_jobs
from infra.object_store import Store, open_store
from infra.services import Running, free_port, start_mlflow, stop_all
from tests.pretrain_helpers import (
    GOLDEN,
    clean_env,
    cli,
    lmforge_command,
    logged_once,
    losses,
    smoke_overrides,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]
RAY = str(Path(os.sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory, s3):
    token = secrets.token_hex(32)  # token authentication, as every shared cluster should run
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
    os.environ.update(
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token
    )  # for this process's Jobs client (set first)
    import ray

    ray.shutdown()
    env = {k: v for k, v in clean_env().items() if k != "RAY_ADDRESS"}
    env["PATH"] = (
        f"{Path(RAY).parent}:{env['PATH']}"  # as on a cluster image: `lmforge` is on the nodes' PATH
    )
    port, dashboard = free_port(), free_port()
    failed_before = request.session.testsfailed
    temp = tempfile.mkdtemp(prefix="lmray", dir="/tmp")  # short: Ray's socket paths have a length limit
    common = ["--disable-usage-stats", "--node-ip-address", "127.0.0.1"]
    # two nodes on one host: each dashboard agent needs an HTTP port of its own (Ray's default, 52365, for both made
    # the agent that bound second fail; when that was the head's, every job submission got "No available agent")
    agent_ports = [["--dashboard-agent-listen-port", str(free_port())] for _ in range(2)]
    head = [
        RAY,
        "start",
        "--head",
        "--block",
        "--port",
        str(port),
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(dashboard),
        "--num-cpus",
        "2",
        "--resources",
        '{"head_node": 1}',
        "--temp-dir",
        temp,
        *common,
        *agent_ports[0],
    ]
    second = [
        RAY,
        "start",
        "--block",
        "--address",
        f"127.0.0.1:{port}",
        "--num-cpus",
        "1",
        "--resources",
        '{"second_node": 1}',
        *common,
        *agent_ports[1],
    ]
    state = tmp_path_factory.mktemp("mlflow")
    nodes: list[Running] = []  # appended as each starts: stopped also when the cluster fails to come up
    ml: Running | None = None
    try:
        with ThreadPoolExecutor(1) as pool:  # the MLflow server starts while the nodes do
            starting = pool.submit(
                start_mlflow, state, f"sqlite:///{state / 'mlflow.db'}", state / "artifacts", port=free_port()
            )
            try:
                _start_nodes(head, second, env, temp, dashboard, nodes)
            finally:
                ml = starting.result()
        address = f"http://127.0.0.1:{dashboard}"
        yield address, ml, {node.pid for node in nodes}
    finally:
        # by process group (other Ray processes on the host are left alone), together: a disposable cluster needs
        # no graceful exit, nor one grace period per process
        stop_all([*([ml] if ml else []), *nodes], timeout=2)
        ray.shutdown()
        if request.session.testsfailed == failed_before:  # the nodes' logs stay for a failure's inspection
            shutil.rmtree(temp, ignore_errors=True)
        for key, value in saved.items():  # a failed start left the token in the environment of later tests
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_nodes(
    head: list[str], second: list[str], env: dict[str, str], temp: str, dashboard: int, nodes: list[Running]
) -> None:
    """The head, then the second node once the head is up, appended to `nodes` as they start; both alive."""
    address = f"http://127.0.0.1:{dashboard}"
    nodes.append(_start(head, {**env, "LMFORGE_CACHE": f"{temp}/cache-head"}, temp, "head"))
    deadline = time.monotonic() + 180
    while not _alive_nodes(address):
        assert time.monotonic() < deadline, "the head did not come up; see " + nodes[0].log
        time.sleep(0.2)
    nodes.append(_start(second, {**env, "LMFORGE_CACHE": f"{temp}/cache-second"}, temp, "second"))
    while len(_alive_nodes(address)) < 2:
        assert time.monotonic() < deadline, "the second node did not join; see " + nodes[1].log
        time.sleep(0.2)


def _start(cmd: list[str], env: dict[str, str], temp: str, name: str) -> Running:
    """`ray start --block` as the leader of its own process group, which `stop` ends."""
    log = Path(temp) / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Running.of(name, proc.pid, "", str(log))


def _alive_nodes(address: str) -> list[dict]:
    from ray.util.state import list_nodes

    try:
        return [n for n in list_nodes(address=address) if n.state == "ALIVE"]
    except Exception:  # noqa: BLE001 - the dashboard is still starting
        return []


def _job_args(out: str) -> list[str]:
    """The golden smoke run (20 steps, fp32) on 2 workers, one per node, with ZeRO-2 (optimiser state and
    gradients partitioned over the two), checkpointing every 5 steps."""
    sets = smoke_overrides(
        out,
        "train.checkpoint_every=5",
        "parallel.zero_stage=2",
        "parallel.placement=strict_spread",
        "parallel.max_failures=1",
        "parallel.threads_per_worker=1",
    )
    return ["pretrain", "smoke", "--workers", "2", *[x for s in sets for x in ("--set", s)]]


def _wait(address: str, job_id: str, timeout: float = 900) -> str:
    deadline = time.monotonic() + timeout
    while (status := ray_jobs.status(address, job_id)) not in ray_jobs.TERMINAL:
        assert time.monotonic() < deadline, f"job {job_id} still {status}"
        time.sleep(0.2)
    return status


def _complete_steps(store: Store) -> list[int]:
    return sorted(int(k.split("/")[3][5:]) for k in store.listing() if k.endswith("/COMPLETE"))


def _finished_run(store: Store, local: Path) -> tuple[dict, dict]:
    """The finished pretraining run's manifest and its export's record; its metrics.jsonl copied to `local`."""
    (manifest,) = [k for k in store.listing() if k.startswith("pretrain/") and k.endswith("/manifest.json")]
    local.mkdir(parents=True)
    (local / "metrics.jsonl").write_bytes(
        store.read_bytes(manifest.replace("manifest.json", "metrics.jsonl"))
    )
    export = json.loads(store.read_bytes(manifest.replace("manifest.json", "hf/export.json")))
    return json.loads(store.read_bytes(manifest)), export


def test_two_worker_job_survives_a_killed_worker(cluster, tmp_path):
    address, ml, groups = cluster
    env = {"LMFORGE_TRACKING_URI": ml.url}
    killed = open_store("s3://lmforge/cluster-killed")
    job = ray_jobs.submit(address, _job_args(killed.uri), env=env)
    deadline = time.monotonic() + 600
    while not _complete_steps(killed):
        assert ray_jobs.status(address, job) not in ray_jobs.TERMINAL, ray_jobs.client(address).get_job_logs(
            job
        )[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    workers = [  # this cluster's training workers only: members of its nodes' sessions
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "ray::RayTrainWorker" in " ".join(p.info["cmdline"] or ()) and os.getsid(p.pid) in groups
    ]
    assert len(workers) == 2, workers
    resumed_from = _complete_steps(killed)[-1]
    os.kill(int(workers[0]), signal.SIGKILL)
    logs = ray_jobs.client(address).get_job_logs
    assert _wait(address, job) == "SUCCEEDED", logs(job)[-4000:]

    # The undisturbed run is the golden curve: 2 workers x 1 micro-batch sum what 1 worker x 2 does in another
    # order (~1e-6 relative), ZeRO-2 or not; a resume from the wrong data position or without the optimiser's
    # state moves the loss by ~1e-2.
    a, export = _finished_run(killed, tmp_path / "killed")
    assert a["step"] == 20
    assert a["export_valid"] and export["engine_rel_diff"] <= 1e-5  # the gathered weights are the engine's
    la, golden = losses(tmp_path / "killed"), json.loads(GOLDEN.read_text())["losses"]
    assert [la[s] for s in sorted(la)] == pytest.approx(golden, rel=1e-5)  # including the steps redone
    assert logged_once(tmp_path / "killed", resumed_from), "the restarted workers trained from scratch"

    # the workers ran one per node
    from ray.util.state import list_actors

    actors = list_actors(
        address=address, filters=[("class_name", "=", "RayTrainWorker")], limit=100, detail=True
    )
    by_job: dict[str, list[str]] = {}
    for actor in actors:
        by_job.setdefault(actor.job_id, []).append(actor.node_id)
    assert by_job and all(len(set(nodes)) == 2 for nodes in by_job.values()), by_job
    # a restart happened: the killed job's worker group was replaced (2 + 2 workers)
    assert [len(nodes) for nodes in by_job.values()] == [4], by_job

    # the run is in MLflow through the server
    client = mlflow.MlflowClient(ml.url)
    run = client.get_run(a["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) >= 20


def test_jobs_api_refuses_requests_without_the_token(cluster):
    import urllib.error
    import urllib.request

    address, *_ = cluster
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{address}/api/jobs/", timeout=10)
    assert refused.value.code in (401, 403)
    # `lmforge jobs` without the token: one line, not Ray's traceback
    env = {k: v for k, v in clean_env().items() if k != "RAY_AUTH_TOKEN"}
    listed = subprocess.run(
        lmforge_command("jobs", "list", "--address", address), capture_output=True, text=True, env=env
    )
    assert listed.returncode == 2 and "Traceback" not in listed.stderr, listed.stderr[-3000:]
    (line,) = listed.stderr.splitlines()
    assert line.startswith(f"lmforge: error: the Ray cluster at {address} refused the token"), line
    assert "RAY_AUTH_TOKEN" in line  # the fix


def test_submit_and_jobs_commands(cluster, tmp_path):
    """`lmforge submit` runs a stage on the cluster and follows its log to the end; `lmforge jobs` lists,
    shows and stops jobs."""
    address, *_ = cluster
    sets = [x for s in smoke_overrides(tmp_path, "data.sft.max_examples=50") for x in ("--set", s)]
    submitted = cli("submit", "tokenize", "smoke", "--address", address, "--submission-id", "tok-1", *sets)
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    assert (
        "job tok-1: SUCCEEDED" in submitted.stdout and "dataset   " in submitted.stdout
    )  # the stage's own output
    assert list(tmp_path.glob("tokenize/*/manifest.json"))  # the job wrote the dataset (same file system)
    listed = cli("jobs", "list", "--address", address)
    assert listed.returncode == 0 and "tok-1" in {j["id"] for j in json.loads(listed.stdout)}
    logs = cli("jobs", "logs", "tok-1", "--address", address)
    assert logs.returncode == 0 and logs.stdout == ray_jobs.client(address).get_job_logs("tok-1")
    sleeper = ray_jobs.client(address).submit_job(entrypoint="sleep 600")
    stopped = cli("jobs", "stop", sleeper, "--address", address)
    assert stopped.returncode == 0 and f"stop {sleeper}: True" in stopped.stdout
    assert _wait(address, sleeper, 120) == "STOPPED"
    refused = cli("submit", "tokenize", "smoke", "--address", address, "--set", "train.max_stepz=3")
    assert refused.returncode == 2 and "did you mean" in refused.stderr  # refused here, not on the cluster
