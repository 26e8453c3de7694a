"""`lmforge eval`: evaluate finished runs side by side, optionally registering the last one in MLflow."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flows.recipe import load_recipe


def cmd_eval(args: argparse.Namespace) -> int:
    from evaluation.gates import describe_gates
    from evaluation.report import run_eval
    from flows.registration import register_final
    from flows.stages.runs import load_model

    recipe = load_recipe(args.recipe, args.set)
    refs = [load_model(run, recipe.output_dir) for run in args.runs]
    names = args.names.split(",") if args.names else None
    report = run_eval(recipe.eval_spec(), refs, names, sft_heldout=args.sft_heldout)
    print((Path(report.path) / "report.md").read_text().split("\n## Models")[0])
    print(f"report    {report.path}/report.md (mlflow run {report.mlflow_run_id})")
    if args.register:
        model_names = list(report.models)
        version = register_final(recipe, refs[-1], report, model_names[0] if len(model_names) > 1 else None)
        print(
            f"registered {version.name} v{version.version}; gates {describe_gates(version.gates, version.skipped)}; "
            f"alias {version.alias or '(not set: a gate failed)'}"
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
