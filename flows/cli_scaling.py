"""`lmforge fit-scaling` and `lmforge compare`: scaling-law tools over any results table and over two ladders
(the sweep, fit and rung stages have their generated commands)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from flows.recipe import load_recipe


def cmd_fit_scaling(args: argparse.Namespace) -> int:
    """Fit any table with N, D (or C) and loss columns; write fit.json and plots; print the headline."""
    from evaluation.scaling_report import headline, run_fit_scaling

    table = Path(args.table)
    out = Path(args.out) if args.out else table.with_name(f"{table.stem}-fit")
    fit = run_fit_scaling(
        table,
        out,
        target_budget=args.budget,
        n_bootstrap=args.bootstrap,
        drop_highest=args.drop_highest,
        method=args.intervals,
    )
    print(json.dumps(fit.model_dump(mode="json"), indent=2) if args.json else headline(fit))
    plots = ", ".join(p.name for p in sorted(out.glob("*.png")))
    print(f"wrote {out / 'fit.json'} and plots {plots}", file=sys.stderr if args.json else sys.stdout)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    """Sweep two variants' ladders (cached), fit a law to each, print the compute multiplier with its interval."""
    from flows.cli_progress import bar_runner
    from flows.compare import run_compare

    a = load_recipe(args.recipe_a, [*args.set, *args.set_a])
    b = load_recipe(args.recipe_b, [*args.set, *args.set_b])
    names = tuple(args.names.split(",")) if args.names else (a.name, b.name)
    if len(names) != 2 or names[0] == names[1] or not all(names):
        raise ValueError(
            f"--names {args.names or ','.join(names)}: give two different names, A,B (e.g. --names adamw,muon)"
        )
    with bar_runner() as run:
        summary = run_compare(a, b, names, run, args.budget, args.bootstrap)
    low, high = summary["interval"]
    print(
        f"multiplier {summary['multiplier']:.3f} [{low:.3f}, {high:.3f}]: {names[0]} needs that times the compute "
        f"of {names[1]} for {names[1]}'s loss at C = {summary['c_ref']:.3g} FLOPs"
    )
    print(
        f"loss at C  {names[0]} {summary['loss_a_at_c_ref']:.4f}, {names[1]} {summary['loss_b_at_c_ref']:.4f}"
    )
    print(f"report     {summary['path']}/comparison.md and compare.png")
    for warning in summary["warnings"]:
        print(f"warning    {warning}", file=sys.stderr)
    return 0


def add_scaling_commands(commands: Any, add_set_argument: Any) -> None:
    fit = commands.add_parser("fit-scaling", help="fit L(N, D) = E + A/N^alpha + B/D^beta to a results table")
    fit.add_argument(
        "table", help="results.parquet from `lmforge sweep`, or any CSV/Parquet with N, D (or C), loss"
    )
    fit.add_argument("--out", help="output directory (default: <table>-fit next to the table)")
    fit.add_argument("--budget", type=float, help="compute budget (FLOPs) for the compute-optimal size")
    fit.add_argument("--bootstrap", type=int, default=4000, help="bootstrap resamples for the intervals")
    fit.add_argument("--drop-highest", type=int, default=0, help="drop the K highest-loss runs (Epoch: 5)")
    fit.add_argument(
        "--intervals",
        choices=["noise", "runs", "points"],
        default="noise",
        help="bootstrap: redraw from the fitted noise model (default, calibrated by benchmarks/"
        "scaling_calibration.py), resample whole runs, or resample points (Epoch's, for one-point-per-run tables)",
    )
    fit.add_argument("--json", action="store_true", help="print fit.json instead of the headline")
    fit.set_defaults(handler=cmd_fit_scaling)

    compare = commands.add_parser(
        "compare",
        help="compute multiplier of variant A vs B: the same IsoFLOP ladder for both, a law each, bootstrap interval",
    )
    compare.add_argument("recipe_a", help="variant A: recipe path or name in configs/")
    compare.add_argument("recipe_b", help="variant B: recipe path or name (the same one with --set-b, say)")
    compare.add_argument(
        "--set-a", action="append", default=[], metavar="A.B=VALUE", help="override for A only"
    )
    compare.add_argument(
        "--set-b", action="append", default=[], metavar="A.B=VALUE", help="override for B only"
    )
    compare.add_argument("--names", help="the variants' names, A,B (default: the recipe names)")
    compare.add_argument(
        "--budget", type=float, help="reference budget in FLOPs (default: largest both swept)"
    )
    compare.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples per law")
    add_set_argument(compare)
    compare.set_defaults(handler=cmd_compare)
