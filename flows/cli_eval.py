"""`lmforge eval`: evaluate finished runs side by side, optionally registering the last one in MLflow."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flows.recipe import load_recipe


def cmd_eval(args: argparse.Namespace) -> int:
    from evaluation.gates import gate_results
    from evaluation.report import run_eval
    from infra.registry import register
    from training.pretrain import CheckpointRef

    recipe = load_recipe(args.recipe, args.set)
    refs = [CheckpointRef.load(run) for run in args.runs]
    names = args.names.split(",") if args.names else None
    report = run_eval(recipe, refs, names, args.sft_heldout)
    print((Path(report.out_dir) / "report.md").read_text().split("\n## Models")[0])
    print(f"report    {report.out_dir}/report.md (mlflow run {report.mlflow_run_id})")
    if args.register:
        model_names = list(report.models)
        gates = gate_results(report, model_names[-1], model_names[0], refs[-1], recipe.eval)
        name = recipe.eval.register_name or f"lmforge-{recipe.name}"
        version = register(
            recipe.tracking, recipe.output_dir, refs[-1], name, recipe.eval.alias, gates, report.out_dir
        )
        print(
            f"registered {name} v{version.version}; gates {gates}; alias {version.alias or '(not set: a gate failed)'}"
        )
    return 0


def add_eval_command(commands: Any, add_set_argument: Any) -> None:
    ev = commands.add_parser(
        "eval", help="stage 5: evaluate runs side by side (loss, bits/byte, tasks, samples)"
    )
    ev.add_argument("recipe", help="recipe path or name in configs/ (its eval: and data: sections)")
    ev.add_argument(
        "runs", nargs="+", help="finished run directories (pretrain or sft), compared in this order"
    )
    ev.add_argument("--names", help="comma-separated column names (default: pretrain / lora / sft-full)")
    ev.add_argument(
        "--sft-heldout", help="held-out SFT conversations (heldout.jsonl of an sft_data directory)"
    )
    ev.add_argument(
        "--register", action="store_true", help="register the last run; alias it if the gates pass"
    )
    add_set_argument(ev)
    ev.set_defaults(handler=cmd_eval)
