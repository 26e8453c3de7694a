"""`run_fit_scaling(table) -> ScalingFit`: Approach 3 with bootstrap intervals, Approach 2, the compute-optimal
size for a target budget, a held-out-budget check, plots and `fit.json`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from evaluation.chinchilla_fit import Law, bootstrap, fit_law
from evaluation.isoflop import IsoFlopFit, fit_parabolas
from evaluation.scaling_data import ScalingDataError, ScalingPoints, load_points
from infra.storage import atomic_write_json

FIT_FILE = "fit.json"
PLOTS = ("isoflop.png", "contours.png", "residuals.png")


class ComputeOptimal(BaseModel):
    budget: float
    n_opt: float
    d_opt: float
    tokens_per_param: float
    loss: float
    loss_interval: tuple[float, float]
    n_opt_interval: tuple[float, float]
    n_total_opt: float  # for MoE: total parameters at the optimal active size (median total/active ratio)


class ScalingFit(BaseModel):
    """Everything in fit.json; `law` is Approach 3's point estimate."""

    source: str
    n_points: int
    dropped: int
    law: dict[str, float]
    objective: float
    max_grad: float
    n_starts: int
    fit_seconds: float
    intervals: dict[str, tuple[float, float]]
    n_bootstrap: int
    n_bootstrap_diverged: int = 0
    approach2: dict[str, Any]
    optimal: ComputeOptimal
    holdout: dict[str, Any] | None
    moe: bool

    @classmethod
    def load(cls, out_dir: str | Path) -> ScalingFit:
        return cls.model_validate_json((Path(out_dir) / FIT_FILE).read_text())

    def to_law(self) -> Law:
        return Law(**{k: self.law[k] for k in ("E", "A", "B", "alpha", "beta")})


def compute_optimal(
    points: ScalingPoints, law: Law, samples: dict[str, np.ndarray], budget: float
) -> ComputeOptimal:
    n_opt, d_opt = float(law.optimal_n(budget)), float(law.optimal_d(budget))
    boot = [Law(*(samples[k][i] for k in ("E", "A", "B", "alpha", "beta"))) for i in range(len(samples["E"]))]
    boot_n = np.array([float(b.optimal_n(budget)) for b in boot])
    boot_loss = np.array([float(b.loss(b.optimal_n(budget), b.optimal_d(budget))) for b in boot])
    ratio = float(np.median(points.n_total / points.n))
    return ComputeOptimal(
        budget=budget,
        n_opt=n_opt,
        d_opt=d_opt,
        tokens_per_param=d_opt / n_opt,
        loss=float(law.loss(n_opt, d_opt)),
        # resamples whose law has no interior optimum (a negative exponent) give NaN and are left out
        loss_interval=tuple(float(v) for v in np.nanpercentile(boot_loss, [2.5, 97.5])),
        n_opt_interval=tuple(float(v) for v in np.nanpercentile(boot_n, [2.5, 97.5])),
        n_total_opt=n_opt * ratio,
    )


def holdout_check(points: ScalingPoints, starts: np.ndarray | None) -> dict[str, Any] | None:
    """Fit on all runs but those of the largest budget(s) and report the relative error predicting them.

    The held-out set is the largest budget, widened to the next budgets down until it holds at least
    max(3, 5 % of the runs), so a table with scattered budgets (like Chinchilla's) is still tested fairly.
    """
    labels = points.budgets()
    budgets = np.unique(labels)[::-1]
    if len(budgets) < 2:
        return None
    need = max(3, int(np.ceil(0.05 * len(points))))
    k = 1
    while k < len(budgets) - 1 and (labels >= budgets[k - 1]).sum() < need:
        k += 1
    held = labels >= budgets[k - 1]
    train, test = points.subset(~held), points.subset(held)
    try:
        law = fit_law(train, starts=starts).law
    except ScalingDataError as err:
        return {"skipped": str(err)}
    rel = np.abs(law.loss(test.n, test.d) - test.loss) / test.loss
    return {
        "min_budget": float(budgets[k - 1]),
        "n_train": len(train),
        "n_test": len(test),
        "mean_rel_error": float(rel.mean()),
        "max_rel_error": float(rel.max()),
        "law": law.as_dict(),
    }


def approach2_summary(iso: IsoFlopFit | None, error: str | None) -> dict[str, Any]:
    if iso is None:
        return {"skipped": error}
    return {
        "parabolas": [p.__dict__ for p in iso.parabolas],
        "n_opt": iso.n_opt.__dict__ if iso.n_opt else None,
        "d_opt": iso.d_opt.__dict__ if iso.d_opt else None,
        "skipped_budgets": iso.skipped,
    }


def run_fit_scaling(
    table: str | Path | ScalingPoints,
    out_dir: str | Path,
    target_budget: float | None = None,
    n_bootstrap: int = 4000,
    drop_highest: int = 0,
    starts: np.ndarray | None = None,
    plots: bool = True,
) -> ScalingFit:
    """Fit a results table (Parquet/CSV path or points) and write fit.json and the plots into `out_dir`."""
    points = table if isinstance(table, ScalingPoints) else load_points(table, drop_highest)
    t0 = time.perf_counter()
    result = fit_law(points, starts=starts)
    fit_seconds = time.perf_counter() - t0
    boot = bootstrap(points, result.law, n_resamples=n_bootstrap)
    try:
        iso, iso_error = fit_parabolas(points), None
    except ScalingDataError as err:
        iso, iso_error = None, str(err)
    budget = float(target_budget or points.c.max())
    fit = ScalingFit(
        source=points.source,
        n_points=len(points),
        dropped=points.dropped,
        law=result.law.as_dict(),
        objective=result.objective,
        max_grad=result.max_grad,
        n_starts=result.n_starts,
        fit_seconds=fit_seconds,
        intervals=boot.intervals(),
        n_bootstrap=boot.n,
        n_bootstrap_diverged=boot.n_diverged,
        approach2=approach2_summary(iso, iso_error),
        optimal=compute_optimal(points, result.law, boot.samples, budget),
        holdout=holdout_check(points, starts),
        moe=bool(np.any(points.n_total > points.n * 1.0001)),
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        from evaluation.scaling_plots import write_plots

        write_plots(points, result.law, iso, fit.optimal, out)
    atomic_write_json(out / FIT_FILE, fit.model_dump(mode="json"))
    return fit


def headline(fit: ScalingFit) -> str:
    """A few lines for the terminal: the law with intervals and the compute-optimal size."""
    law, ci, opt = fit.law, fit.intervals, fit.optimal

    def fmt(k: str, digits: int = 4) -> str:
        return f"{k}={law[k]:.{digits}g} [{ci[k][0]:.{digits}g}, {ci[k][1]:.{digits}g}]"

    lines = [
        f"L(N, D) = E + A/N^alpha + B/D^beta fitted on {fit.n_points} runs ({fit.dropped} dropped), "
        f"{fit.n_starts} starts, {fit.fit_seconds:.1f} s; 95% bootstrap intervals ({fit.n_bootstrap} resamples):",
        "  " + ", ".join(fmt(k) for k in ("E", "A", "B", "alpha", "beta")),
        f"  N* ∝ C^{law['a']:.3f}, D* ∝ C^{law['b']:.3f}",
        f"At C={opt.budget:.3g} FLOPs: N*={opt.n_opt:.4g} (95% {opt.n_opt_interval[0]:.3g}–{opt.n_opt_interval[1]:.3g}), "
        f"D*={opt.d_opt:.4g}, {opt.tokens_per_param:.1f} tokens/param, loss {opt.loss:.4f} "
        f"[{opt.loss_interval[0]:.4f}, {opt.loss_interval[1]:.4f}]",
    ]
    if fit.moe:
        lines.append(f"  (MoE: N counts active parameters; total at the optimum ≈ {opt.n_total_opt:.4g})")
    if fit.holdout and "mean_rel_error" in fit.holdout:
        h = fit.holdout
        lines.append(
            f"Held out the {h['n_test']} runs at C ≥ {h['min_budget']:.3g} FLOPs, fitted on {h['n_train']}: "
            f"mean relative error {h['mean_rel_error']:.2%}, max {h['max_rel_error']:.2%}"
        )
    a2 = fit.approach2
    if a2.get("n_opt"):
        lines.append(
            f"Approach 2 ({len(a2['parabolas'])} IsoFLOP parabolas): N_opt ∝ C^{a2['n_opt']['exponent']:.3f}, "
            f"D_opt ∝ C^{a2['d_opt']['exponent']:.3f}"
        )
    elif a2.get("skipped"):
        lines.append(f"Approach 2 skipped: {a2['skipped']}")
    return "\n".join(lines)
