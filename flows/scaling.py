"""The scaling stages as the CLI and the pipeline run them: sweep (Ray Tune) then fit, logged to MLflow.

The fit of a sweep lives in `<sweep dir>/fit/` (so it is content-addressed by the sweep) and is attached to
the sweep's MLflow run: fit.json, the plots and the law's numbers as metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from evaluation.scaling_data import ScalingPoints, points_from_table
from evaluation.scaling_report import FIT_FILE, PLOTS, ScalingFit, run_fit_scaling
from infra.tracking import make_tracker
from training.sweep import SweepResult


def sweep_points(results: str | Path) -> ScalingPoints:
    """Completed trials of a sweep table; with a learning-rate grid, the best rate per (N, D)."""
    table = pq.read_table(results)
    rows = [r for r in table.to_pylist() if r["status"] == "completed" and r["loss"] is not None]
    best: dict[tuple[int, int], dict[str, Any]] = {}
    for row in rows:
        key = (row["N"], row["D"])
        if key not in best or row["loss"] < best[key]["loss"]:
            best[key] = row
    chosen = pa.Table.from_pylist(list(best.values())) if best else table.slice(0, 0)
    points = points_from_table(chosen.select(["N", "N_total", "D", "C", "loss"]), source=str(results))
    return ScalingPoints(
        points.n, points.d, points.loss, points.c, points.n_total, len(table) - len(best), points.source
    )


def fit_sweep(recipe: Any, sweep: SweepResult, n_bootstrap: int = 2000) -> ScalingFit:
    """Fit the sweep's results (cached in `<sweep dir>/fit/`) and log the fit to the sweep's MLflow run."""
    out = Path(sweep.sweep_dir) / "fit"
    if (out / FIT_FILE).is_file():
        return ScalingFit.load(out)
    budget = recipe.sweep.target_budget or float(np.max(recipe.sweep.budgets))
    fit = run_fit_scaling(sweep_points(sweep.results), out, target_budget=budget, n_bootstrap=n_bootstrap)
    tracker = make_tracker(recipe.tracking, recipe.output_dir, sweep.mlflow_run_id, rank=0)
    tracker.log_metrics({f"fit/{k}": v for k, v in fit.law.items()}, step=0)
    tracker.log_metrics({"fit/n_opt": fit.optimal.n_opt, "fit/d_opt": fit.optimal.d_opt}, step=0)
    for name in (FIT_FILE, *PLOTS):
        tracker.log_artifact(out / name, "fit")
    return fit
