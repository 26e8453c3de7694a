"""Approach 3's starts: Variable Projection (a grid over α, β alone, E, A, B by NNLS per cell) against Hoffmann et
al.'s 4,500-point grid over all five parameters, on the same table in one run: seconds each, their ratio, and how
far apart the two optima are (goal: the same minimum, relative objective difference < 1e-9).

    .venv/bin/python benchmarks/law_fit.py [--table ../shared/anchors/chinchilla/svg_extracted_data.csv]
                                           [--drop-highest 5]

`--table` also takes a sweep's results.parquet (outputs/sweep/<key>/results.parquet).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from evaluation.chinchilla_fit import fit_law, grid_starts
from evaluation.scaling_data import load_points

SHARED = Path(os.environ.get("LMFORGE_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--table", default=str(SHARED / "anchors/chinchilla/svg_extracted_data.csv"))
    parser.add_argument("--drop-highest", type=int, default=5, help="Epoch's cut of the Chinchilla table")
    args = parser.parse_args()
    points = load_points(args.table, drop_highest=args.drop_highest)
    result = {"benchmark": "law_fit", "table": args.table, "points": len(points)}
    fits = {}
    for name, starts in (("grid", grid_starts()), ("projected", None)):
        t0 = time.perf_counter()
        fits[name] = fit_law(points, starts=starts)
        result[f"{name}_seconds"] = round(time.perf_counter() - t0, 3)
        result[f"{name}_starts"] = fits[name].n_starts
    result["speedup"] = round(result["grid_seconds"] / result["projected_seconds"], 1)
    result["objective_rel_diff"] = float(
        abs(fits["projected"].objective - fits["grid"].objective) / fits["grid"].objective
    )
    result["alpha"] = {k: round(f.law.alpha, 5) for k, f in fits.items()}
    result["beta"] = {k: round(f.law.beta, 5) for k, f in fits.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
