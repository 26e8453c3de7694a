"""Ray Jobs on a cluster: submit an lmforge command with a runtime environment, follow its logs, list and stop.

Whoever can reach a Ray dashboard can run arbitrary code through this API: keep it on 127.0.0.1 (or behind
TLS) and turn on token authentication (RAY_AUTH_MODE=token) on shared clusters.
"""

from __future__ import annotations

import os
import shlex
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from infra.errors import UserError

FORWARDED_ENV = (  # passed to the job by name, so secrets never appear in the command line
    "LMFORGE_TRACKING_URI",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
    "PREFECT_API_URL",
    "PREFECT_API_AUTH_STRING",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL",
    "AWS_DEFAULT_REGION",
    "MLFLOW_S3_ENDPOINT_URL",
    "LMFORGE_OUTPUT_DIR",  # stage outputs on the cluster's bucket (LMFORGE_CACHE stays each node's own)
)
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
API_SERVER = "RAY_API_SERVER_ADDRESS"
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
AGENT_WAIT_S = 60.0  # how long a submission waits for a freshly started head's job agent


def client(address: str) -> Any:
    """Ray's Jobs client for `address`, which wins here: Ray lets `RAY_API_SERVER_ADDRESS` / `RAY_ADDRESS` override the
    argument (an exported GCS address then made `--address` a dead letter and the client wait on the GCS)."""
    from ray.job_submission import JobSubmissionClient

    saved = os.environ.get(API_SERVER)
    os.environ[API_SERVER] = address
    try:
        return JobSubmissionClient(address)
    finally:
        if saved is None:
            os.environ.pop(API_SERVER)
        else:
            os.environ[API_SERVER] = saved


def jobs_address(given: str | None) -> str:
    """The Jobs API to talk to: `--address`, else the exported `RAY_API_SERVER_ADDRESS` (what `lmforge up` prints),
    else an http `RAY_ADDRESS`, else the local default."""
    exported = os.environ.get("RAY_ADDRESS", "")
    return given or os.environ.get(API_SERVER) or (exported if "://" in exported else "") or DEFAULT_ADDRESS


@contextmanager
def cluster_errors(address: str) -> Iterator[None]:
    """What a cluster answers instead of doing the request (no cluster at `address`, a refused token, a node whose
    job agent is not up yet) as one line naming the address and the fix: Ray's client raises them as
    ConnectionError, AuthenticationError and RuntimeError("Request failed with status code ...")."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except AuthenticationError as error:
        raise UserError(
            f"the Ray cluster at {address} refused the token ({str(error).splitlines()[0]}): set RAY_AUTH_TOKEN "
            "(or RAY_AUTH_TOKEN_PATH) to the cluster's token"
        ) from error
    except ConnectionError as error:
        raise UserError(
            f"no Ray cluster answers at {address}: start one (`lmforge up`, or `ray start --head` on a node) or "
            "pass its dashboard's address with --address"
        ) from error
    except RuntimeError as error:
        if str(error).startswith("Version check returned 404"):
            raise UserError(
                f"{address} is not a Ray dashboard (its /api/version is missing): pass the Ray dashboard's address "
                "(port 8265 by default) with --address"
            ) from error
        if not str(error).startswith("Request failed with status code"):
            raise
        raise UserError(
            f"the Ray cluster at {address} refused the request ({str(error).splitlines()[0]}); a cluster still "
            "starting takes a few seconds to accept jobs: retry"
        ) from error


def submit(
    address: str,
    args: list[str],
    working_dir: str | None = None,
    env: dict[str, str] | None = None,
    submission_id: str | None = None,
) -> str:
    """Submit `lmforge <args>` as a Ray job; returns the submission id."""
    env_vars = (
        {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
        | {"OMP_NUM_THREADS": "1"}
        | (env or {})
    )
    runtime_env: dict[str, Any] = {"env_vars": env_vars}
    if working_dir:
        runtime_env["working_dir"] = working_dir
        runtime_env["excludes"] = [".venv", "outputs", ".lmforge", "**/__pycache__"]
    jobs = client(address)
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return jobs.submit_job(
                entrypoint=shlex.join(["lmforge", *args]),
                runtime_env=runtime_env,
                submission_id=submission_id,
            )
        except RuntimeError as error:  # a head just started: its job agent registers a few seconds later
            if "No available agent" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(2)


def follow(address: str, job_id: str, poll: float = 1.0) -> Iterator[str]:
    """Yield new log text until the job ends."""
    jobs = client(address)
    seen = 0
    while True:
        logs = jobs.get_job_logs(job_id)
        if len(logs) > seen:
            yield logs[seen:]
            seen = len(logs)
        if str(jobs.get_job_status(job_id).value) in TERMINAL:
            logs = jobs.get_job_logs(job_id)
            if len(logs) > seen:
                yield logs[seen:]
            return
        time.sleep(poll)


def status(address: str, job_id: str) -> str:
    return str(client(address).get_job_status(job_id).value)


def list_jobs(address: str) -> list[dict[str, Any]]:
    return [
        {
            "id": j.submission_id,
            "status": str(j.status.value),
            "entrypoint": j.entrypoint,
            "start_time": j.start_time,
        }
        for j in client(address).list_jobs()
    ]


def stop(address: str, job_id: str) -> bool:
    return bool(client(address).stop_job(job_id))
