"""`lmforge <stage> RECIPE`: one command per stage of the registry, generated from its declaration: it builds the
stage and what it needs (cached, each with a progress bar), then prints the stage's report."""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

from flows.recipe import load_recipe
from flows.registry import STAGES, resolve, shares_toggle


def cmd_stage(name: str, args: argparse.Namespace) -> int:
    from flows.cli_progress import bar_runner

    stage = STAGES[name]
    # `--workers 0` is refused by the recipe's validation, not ignored
    workers = [f"parallel.world_size={args.workers}"] if args.workers is not None else []
    recipe = load_recipe(args.recipe, [*args.set, *workers])  # validated with the worker count it runs with
    given = stage.given_from(args, recipe.output_dir)
    with bar_runner() as run:
        made = resolve(name, recipe, run, given)
    reports = made.summary()["reports"]
    for shown in [n for n in reports if n == name or shares_toggle(n, name)]:
        print(reports[shown])
    return 0


def add_stage_commands(commands: Any, add_set_argument: Any) -> None:
    for stage in STAGES.values():
        if not stage.command:
            continue
        command = commands.add_parser(stage.cli, help=stage.help)
        command.add_argument("recipe", help="recipe path or name in configs/")
        if stage.given is not None:
            many = {"nargs": "+"} if stage.given.many else {}
            command.add_argument(f"--{stage.given.flag}", help=stage.given.help, **many)
        command.add_argument("--workers", type=int, help="Ray Train workers (default: parallel.world_size)")
        add_set_argument(command)
        command.set_defaults(handler=partial(cmd_stage, stage.name))
