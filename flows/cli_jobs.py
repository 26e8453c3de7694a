"""`lmforge submit` and `lmforge jobs`: run stages on a Ray cluster through the Ray Jobs API."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DEFAULT_ADDRESS = "http://127.0.0.1:8265"


def cmd_submit(args: argparse.Namespace) -> int:
    from flows.recipe import load_recipe
    from infra import ray_jobs

    load_recipe(args.recipe, args.set)  # refuse a bad recipe here, not on the cluster
    command = [args.stage, args.recipe, *args.extra, *[item for s in args.set for item in ("--set", s)]]
    with ray_jobs.cluster_errors(args.address):
        job_id = ray_jobs.submit(args.address, command, args.working_dir, submission_id=args.submission_id)
        print(f"submitted {job_id} to {args.address}: lmforge {' '.join(command)}")
        if args.no_follow:
            return 0
        for text in ray_jobs.follow(args.address, job_id):
            sys.stdout.write(text)
        final = ray_jobs.status(args.address, job_id)
    print(f"job {job_id}: {final}")
    return 0 if final == "SUCCEEDED" else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    from infra import ray_jobs

    with ray_jobs.cluster_errors(args.address):
        if args.action == "list":
            print(json.dumps(ray_jobs.list_jobs(args.address), indent=2, default=str))
        elif args.action == "stop":
            print(f"stop {args.job_id}: {ray_jobs.stop(args.address, args.job_id)}")
        elif args.action == "logs":
            for text in ray_jobs.follow(args.address, args.job_id):
                sys.stdout.write(text)
    return 0


def add_job_commands(commands: Any, add_set_argument: Any) -> None:
    submit = commands.add_parser("submit", help="run a stage or the pipeline as a Ray job on a cluster")
    from flows.registry import STAGES

    commands_run = ["pipeline", *(stage.cli for stage in STAGES.values() if stage.command), "eval"]
    submit.add_argument("stage", choices=commands_run)
    submit.add_argument("recipe", help="recipe name in configs/ or a path inside the working directory")
    submit.add_argument("--address", default=DEFAULT_ADDRESS, help="Ray dashboard / Jobs API address")
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
    jobs.add_argument("--address", default=DEFAULT_ADDRESS)
    jobs.set_defaults(handler=cmd_jobs)
