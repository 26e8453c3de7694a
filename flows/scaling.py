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
from flows.recipe import Recipe
from infra.tracking import existing_run
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


def target_budget(recipe: Recipe) -> float:
    """The compute budget the final model is sized for: `sweep.target_budget`, else the largest swept budget."""
    return float(recipe.sweep.target_budget or max(recipe.sweep.budgets))


def fit_sweep(recipe: Recipe, sweep: SweepResult, n_bootstrap: int = 2000) -> ScalingFit:
    """Fit the sweep's results (cached in `<sweep dir>/fit/`) and log the fit to the sweep's MLflow run."""
    out = Path(sweep.sweep_dir) / "fit"
    if (out / FIT_FILE).is_file():
        return ScalingFit.load(out)
    fit = run_fit_scaling(
        sweep_points(sweep.results), out, target_budget=target_budget(recipe), n_bootstrap=n_bootstrap
    )
    tracker = existing_run(recipe.tracking, recipe.output_dir, sweep.mlflow_run_id).tracker()
    tracker.log_metrics({f"fit/{k}": v for k, v in fit.law.items()}, step=0)
    tracker.log_metrics({"fit/n_opt": fit.optimal.n_opt, "fit/d_opt": fit.optimal.d_opt}, step=0)
    for name in (FIT_FILE, *PLOTS):
        tracker.log_artifact(out / name, "fit")
    return fit


def size_for_budget(
    recipe: Recipe, n_opt: float, budget: float, swept: tuple[float, float] | None = None, max_depth: int = 16
) -> tuple[Recipe, str]:
    """The recipe at the depth whose active parameter count is nearest N* (in log space), trained for
    D = C / (6·N) tokens; returns it and a one-line explanation (which flags an N* outside the `swept` sizes)."""
    from training.accounting import count_parameters
    from training.sweep import sized_model

    candidates = []
    for depth in range(1, max_depth + 1):
        model = sized_model(recipe.model, depth)
        candidates.append((abs(np.log(count_parameters(model).matmul_active / n_opt)), depth, model))
    _, depth, model = min(candidates, key=lambda c: c[0])
    n = count_parameters(model).matmul_active
    tokens_per_step = recipe.train.global_batch(recipe.parallel.world_size) * recipe.train.seq_len
    steps = max(1, round(budget / (6.0 * n) / tokens_per_step))
    every = max(1, steps // 3)
    sized = recipe.override(
        {
            "model": model.model_dump(mode="json"),
            "train.max_steps": steps,
            "train.eval_every": every,
            "train.checkpoint_every": every,
            "optim.warmup_steps": min(recipe.optim.warmup_steps, max(1, steps // 10)),
        }
    )
    note = (
        f"C={budget:.3g} FLOPs: fitted N*={n_opt:.3g}; nearest size depth {depth} (N={n:,}), "
        f"D={steps * tokens_per_step:,} tokens ({steps} steps, {steps * tokens_per_step / n:.1f} tokens/param)"
    )
    if swept and not swept[0] <= n_opt <= swept[1]:
        note += f"; N* lies outside the swept sizes ({swept[0]:,.0f}–{swept[1]:,.0f}): an extrapolation, widen the sweep"
    return sized, note
