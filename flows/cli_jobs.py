"""`lmforge submit` and `lmforge jobs`: run stages on a Ray cluster through the Ray Jobs API."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)
ADDRESS_HELP = (
    "Ray dashboard / Jobs API address (default: $RAY_API_SERVER_ADDRESS, as `lmforge up` exports it, else "
    "http://127.0.0.1:8265)"
)


def where_outputs_go(output_dir: str, address: str) -> list[str]:
    """`--set output_dir=...` that keeps a relative output directory where the user means it: a job runs in a
    directory of Ray's own (a temporary copy with --working-dir), so on a cluster on this machine (a loopback
    address) it becomes absolute here; for another machine a warning says where it would land."""
    from infra.object_store import is_remote
    from infra.services import is_loopback

    if is_remote(output_dir) or Path(output_dir).is_absolute():
        return []
    if is_loopback(urlparse(address).hostname or ""):
        return ["--set", f"output_dir={Path(output_dir).resolve()}"]
    log.warning(
        "output_dir=%s is relative: on the cluster it lands in the job's working directory, which Ray deletes; set "
        "output_dir to a path every node shares, or an object-store URI",
        output_dir,
    )
    return []


def cmd_submit(args: argparse.Namespace) -> int:
    from flows.recipe import load_recipe
    from infra import ray_jobs

    recipe = load_recipe(args.recipe, args.set)  # refuse a bad recipe here, not on the cluster
    address = ray_jobs.jobs_address(args.address)
    command = [
        args.stage,
        args.recipe,
        *args.extra,
        *[item for s in args.set for item in ("--set", s)],
        *where_outputs_go(recipe.output_dir, address),
    ]
    with ray_jobs.cluster_errors(address):
        job_id = ray_jobs.submit(address, command, args.working_dir, submission_id=args.submission_id)
        print(f"submitted {job_id} to {address}: lmforge {' '.join(command)}")
        if args.no_follow:
            return 0
        for text in ray_jobs.follow(address, job_id):
            sys.stdout.write(text)
        final = ray_jobs.status(address, job_id)
    print(f"job {job_id}: {final}")
    return 0 if final == "SUCCEEDED" else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    from infra import ray_jobs

    address = ray_jobs.jobs_address(args.address)
    with ray_jobs.cluster_errors(address):
        if args.action == "list":
            print(json.dumps(ray_jobs.list_jobs(address), indent=2, default=str))
        elif args.action == "stop":
            print(f"stop {args.job_id}: {ray_jobs.stop(address, args.job_id)}")
        elif args.action == "logs":
            for text in ray_jobs.follow(address, args.job_id):
                sys.stdout.write(text)
    return 0


def add_job_commands(commands: Any, add_set_argument: Any) -> None:
    submit = commands.add_parser("submit", help="run a stage or the pipeline as a Ray job on a cluster")
    from flows.registry import STAGES

    commands_run = ["pipeline", *(stage.cli for stage in STAGES.values() if stage.command), "eval"]
    submit.add_argument("stage", choices=commands_run)
    submit.add_argument("recipe", help="recipe name in configs/ or a path inside the working directory")
    submit.add_argument("--address", help=ADDRESS_HELP)
    submit.add_argument(
        "--working-dir", help="upload this directory as the job's working dir (default: the image's)"
    )
    submit.add_argument("--submission-id", help="a stable id (resubmitting the same id is refused by Ray)")
    submit.add_argument("--no-follow", action="store_true", help="print the id and return")
    submit.add_argument("extra", nargs="*", help="more arguments for the stage command (after --)")
    add_set_argument(submit)
    submit.set_defaults(handler=cmd_submit)

    jobs = commands.add_parser("jobs", help="list, follow or stop Ray jobs")
    jobs.add_argument("action", choices=["list", "logs", "stop"])
    jobs.add_argument("job_id", nargs="?")
    jobs.add_argument("--address", help=ADDRESS_HELP)
    jobs.set_defaults(handler=cmd_jobs)
