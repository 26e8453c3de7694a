"""`lmforge sweep` and `lmforge fit-scaling`: the scaling-law commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from flows.recipe import load_recipe


def cmd_sweep(args: argparse.Namespace) -> int:
    """Tokenize (cached), run the recipe's sweep as Ray Tune trials with live progress, then fit the results."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from data_pipeline.tokenize import run_tokenize
    from evaluation.scaling_report import headline
    from flows.scaling import fit_sweep
    from training.sweep import plan_trials, run_sweep

    recipe = load_recipe(args.recipe, args.set)
    plans, skipped = plan_trials(recipe)
    for line in skipped:
        print(f"left out: {line}")
    data = run_tokenize(recipe.data, recipe.output_dir)
    columns = (
        TextColumn("trials"),
        MofNCompleteColumn(),
        BarColumn(),
        TextColumn("{task.fields[last]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns) as bar:
        task = bar.add_task("trials", total=len(plans), last="")

        def report(done: int, total: int, row: dict[str, Any]) -> None:
            last = f"depth {row.get('depth')} C={row.get('budget', 0):.2g}: {row.get('status')}"
            if row.get("loss") is not None:
                last += f", val loss {row['loss']:.4f}"
            bar.update(task, completed=done, last=last)

        result = run_sweep(recipe, data, progress=report)
    print(f"results   {result.results} ({result.n_completed} completed, {result.n_stopped} stopped early)")
    if result.overhead:
        print(
            f"overhead  Tune wall {result.wall_seconds:.1f} s / trials {result.trial_seconds:.1f} s = {result.overhead:.3f}"
        )
    print(f"mlflow    run {result.mlflow_run_id}")
    if result.n_completed >= 6 and not args.no_fit:
        fit = fit_sweep(recipe, result)
        print(headline(fit))
        print(f"fit       {Path(result.sweep_dir) / 'fit'}")
    return 0


def cmd_fit_scaling(args: argparse.Namespace) -> int:
    """Fit any table with N, D (or C) and loss columns; write fit.json and plots; print the headline."""
    from evaluation.scaling_report import headline, run_fit_scaling

    table = Path(args.table)
    out = Path(args.out) if args.out else table.with_name(f"{table.stem}-fit")
    fit = run_fit_scaling(
        table, out, target_budget=args.budget, n_bootstrap=args.bootstrap, drop_highest=args.drop_highest
    )
    print(json.dumps(fit.model_dump(mode="json"), indent=2) if args.json else headline(fit))
    print(f"wrote {out / 'fit.json'} and plots {', '.join(p.name for p in sorted(out.glob('*.png')))}")
    return 0


def add_scaling_commands(commands: Any, add_set_argument: Any) -> None:
    sweep = commands.add_parser(
        "sweep", help="scaling sweep: Ray Tune trials over (budget, size), then the fit"
    )
    sweep.add_argument("recipe", help="recipe path or name in configs/ (its sweep: section)")
    sweep.add_argument("--no-fit", action="store_true", help="only run the trials")
    add_set_argument(sweep)
    sweep.set_defaults(handler=cmd_sweep)

    fit = commands.add_parser("fit-scaling", help="fit L(N, D) = E + A/N^alpha + B/D^beta to a results table")
    fit.add_argument(
        "table", help="results.parquet from `lmforge sweep`, or any CSV/Parquet with N, D (or C), loss"
    )
    fit.add_argument("--out", help="output directory (default: <table>-fit next to the table)")
    fit.add_argument("--budget", type=float, help="compute budget (FLOPs) for the compute-optimal size")
    fit.add_argument("--bootstrap", type=int, default=4000, help="bootstrap resamples for the intervals")
    fit.add_argument("--drop-highest", type=int, default=0, help="drop the K highest-loss runs (Epoch: 5)")
    fit.add_argument("--json", action="store_true", help="print fit.json instead of the headline")
    fit.set_defaults(handler=cmd_fit_scaling)
