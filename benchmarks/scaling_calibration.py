"""Do the scaling fit's 95% intervals hold the truth 95% of the time? Simulated sweeps of lmforge's own design.

The design is a recipe's sweep plan (its sizes, budgets and multi-horizon runs); the truth is a law and a noise
model (a run offset shared by a run's horizons plus noise per point), by default the demo's measured ones, or
those fitted to a sweep's results table (`--results`). Each simulated sweep is fitted as `lmforge fit` fits
(`calibrated_fit`) and its intervals are checked: α, β, N* at the target budget, and the rung's loss at the fitted
optimum (the law's value, for the confidence interval; a new run's loss, for the prediction interval). Goal:
93-97% coverage for the default method; `truth_below` says on which side the misses fell (all on one side: the
estimate is biased, and a wider interval would not be the fix). Also: Approach 2's and Approach 3's N* error on
noise-free data. With `--form kaplan` the same for Kaplan's form (`evaluation/kaplan_fit.py`), its law and noise
fitted to `--results`. With `--results`, `design_seconds` prices the design (`--recipe`, `--set`) at that sweep's
measured time per run of each size: what a design would cost and how narrow its intervals would be, before it
trains. `--column task_loss`: the same for the probe's task law (the rung's HumanEval bits per byte), fitted to
that column of `--results`.

    .venv/bin/python benchmarks/scaling_calibration.py [--sweeps 200] [--results outputs/sweep/.../results.parquet]
        [--form kaplan] [--column task_loss]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

import numpy as np
import pyarrow.parquet as pq

from evaluation.chinchilla_fit import Law
from evaluation.isoflop import fit_parabolas
from evaluation.kaplan_fit import KaplanLaw, fit_kaplan, kaplan_noise
from evaluation.law_noise import NoiseModel, calibrated_fit
from evaluation.synthetic_ladder import Design, run_kaplan_trial, run_trial, simulate
from flows.recipe import load_recipe
from flows.scaling import target_budget
from training.stages.sweep import plan_trials

# The demo's sweep as `make demo` measured it from a fresh clone at 4a96403 (2026-12-02): the law `lmforge fit` now
# fits to its 21 points, and the noise model estimated from them.
DEMO_LAW = Law(E=1.4847, A=516.56, B=2129.0, alpha=0.6252, beta=0.5548)
DEMO_NOISE = NoiseModel(run_sd=0.0351, point_sd=0.0245)
QUANTITIES = ("alpha", "beta", "n_opt", "rung_law", "rung_run")


def design_of(recipe_name: str, overrides: list[str]) -> tuple[Design, float]:
    """The (N, D, run) of every point the recipe's sweep trains, and the rung's budget (the demo's: 3x 8e11)."""
    recipe = load_recipe(recipe_name, overrides)
    plans, _ = plan_trials(recipe.sweep_spec())
    n = np.array([p.n_active for p in plans for _ in p.steps], dtype=float)
    d = np.array([s * p.tokens_per_step for p in plans for s in p.steps], dtype=float)
    run = np.repeat(np.arange(len(plans)), [len(p.steps) for p in plans])
    return Design(n, d, run), target_budget(recipe)


def as_truth(noise: NoiseModel) -> NoiseModel:
    """A noise model fitted to a sweep as a simulation's truth: the same variances, known exactly."""
    return NoiseModel(noise.run_sd, noise.point_sd, cell_sd=noise.cell_sd, shape_sd=noise.shape_sd)


def noise_json(noise: NoiseModel) -> dict[str, float]:
    """The truth's standard deviations, as the JSON line reports them."""
    return {k: round(getattr(noise, k), 4) for k in ("shape_sd", "cell_sd", "run_sd", "point_sd")}


def design_seconds(design: Design, results: str | None) -> float | None:
    """What the design's runs would take to train, each priced at the median wall time of the same size's runs in
    `results` (a run's time is its steps, which the size and the budgets fix); None without a table or where it
    lacks a size."""
    if not results:
        return None
    table = pq.read_table(results, columns=["N", "wall_seconds", "status"]).to_pylist()
    walls: dict[float, list[float]] = {}
    for row in table:
        if row["status"] == "completed" and row["wall_seconds"]:
            walls.setdefault(float(row["N"]), []).append(row["wall_seconds"])
    first = np.unique(design.run, return_index=True)[1]
    sizes = design.n[first]
    if any(float(n) not in walls for n in sizes):
        return None
    return round(sum(float(np.median(walls[float(n)])) for n in sizes), 1)


def _chunk(args: tuple) -> list[dict]:
    truth, design, noise, budget, method, seed, count, resamples = args
    rng = np.random.default_rng(seed)
    if method == "kaplan":
        return [asdict(run_kaplan_trial(truth, design, noise, budget, rng, resamples)) for _ in range(count)]
    return [asdict(run_trial(truth, design, noise, budget, method, rng, resamples)) for _ in range(count)]


def simulated(
    pool: ProcessPoolExecutor,
    args: argparse.Namespace,
    truth: Law | KaplanLaw,
    design: Design,
    noise: NoiseModel,
    budget: float,
    method: str,
) -> list[dict]:
    """`--sweeps` trials of `method` (an interval method, or `kaplan`), spread over the workers, each its own seed."""
    per_worker = -(-args.sweeps // args.workers)
    jobs = [
        (truth, design, noise, budget, method, 1000 * w + 1, per_worker, args.resamples)
        for w in range(args.workers)
    ]
    return [t for chunk in pool.map(_chunk, jobs) for t in chunk][: args.sweeps]


def summary(
    trials: list[dict], keys: Sequence[str]
) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """How often each quantity's interval held the truth over the trials, how often the truth lay below it (the
    rest of the misses lay above: misses on one side are a biased estimate, not a narrow interval) and its
    median width."""
    coverage, below = (
        {k: round(float(np.mean([t[side][k] for t in trials])), 3) for k in keys}
        for side in ("covered", "below")
    )
    width = {k: round(float(np.nanmedian([t["width"][k] for t in trials])), 4) for k in keys}
    return coverage, below, width


def kaplan_main(args: argparse.Namespace, design: Design, budget: float, t0: float) -> None:
    """Kaplan's form (`--form kaplan`): the law and noise fitted to `--results` as the truth, its own bootstrap's
    intervals checked (the exponents α_N and α_D, N*, the rung's loss) on `--sweeps` simulated sweeps."""
    from flows.scaling import sweep_points

    points = sweep_points(args.results, args.column)
    truth = fit_kaplan(points)
    noise = as_truth(kaplan_noise(points, truth))
    with ProcessPoolExecutor(args.workers) as pool:
        trials = simulated(pool, args, truth, design, noise, budget, "kaplan")
    coverage, below, width = summary(trials, list(trials[0]["covered"]))
    print(
        json.dumps(
            {
                "benchmark": "scaling_calibration",
                "form": "kaplan",
                "column": args.column,
                "recipe": args.recipe,
                "points": len(design.n),
                "runs": int(design.run.max()) + 1,
                "design_seconds": design_seconds(design, args.results),
                "truth": {k: float(f"{v:.4g}") for k, v in truth.as_dict().items()},
                "noise": noise_json(noise),
                "sweeps": len(trials),
                "coverage": coverage,
                "truth_below": below,
                "goal": [0.93, 0.97],
                "median_width": width,
                "n_opt_error_median_abs": round(
                    float(np.median(np.abs([t["n_opt_error"] for t in trials]))), 4
                ),
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--set", nargs="*", default=[], help="recipe overrides (key=value)")
    parser.add_argument("--results", help="a sweep's results.parquet: fit its law and noise as the truth")
    parser.add_argument(
        "--column",
        choices=["loss", "task_loss"],
        default="loss",
        help="which of its columns the law describes",
    )
    parser.add_argument("--sweeps", type=int, default=200)
    parser.add_argument("--resamples", type=int, default=500)
    parser.add_argument("--methods", nargs="+", default=["noise", "runs", "points"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--form", choices=["chinchilla", "kaplan"], default="chinchilla", help="kaplan: needs --results"
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    design, budget = design_of(args.recipe, args.set)
    if args.form == "kaplan":
        if not args.results:
            parser.error("--form kaplan takes its truth from a sweep: give --results <results.parquet>")
        return kaplan_main(args, design, budget, t0)
    truth, noise = DEMO_LAW, DEMO_NOISE
    if args.results:
        from flows.scaling import sweep_points

        fitted = calibrated_fit(sweep_points(args.results, args.column), n_resamples=10)
        truth, noise = fitted.fit.law, as_truth(fitted.noise)
    coverage, below, width, failed = {}, {}, {}, {}
    with ProcessPoolExecutor(args.workers) as pool:
        for method in args.methods:
            trials = simulated(pool, args, truth, design, noise, budget, method)
            coverage[method], below[method], width[method] = summary(trials, QUANTITIES)
            # a sweep whose every refit ran off has no interval: it counts as a miss
            failed[method] = sum(not np.isfinite(t["width"]["alpha"]) for t in trials)
            if method == args.methods[0]:
                noisy_a3 = float(np.median(np.abs([t["n_opt_error"] for t in trials])))
                a2 = [abs(t["approach2_error"]) for t in trials if t["approach2_error"] is not None]
    clean = simulate(truth, design, NoiseModel(0.0, 0.0), np.random.default_rng(0))
    n_true = float(truth.optimal_n(budget))
    a3_clean = float(calibrated_fit(clean, n_resamples=10).fit.law.optimal_n(budget)) / n_true - 1
    iso = fit_parabolas(clean)
    a2_clean = float(iso.n_opt(budget)) / n_true - 1 if iso.n_opt else None
    print(
        json.dumps(
            {
                "benchmark": "scaling_calibration",
                "column": args.column,
                "recipe": args.recipe,
                "points": len(design.n),
                "runs": int(design.run.max()) + 1,
                "design_seconds": design_seconds(design, args.results),
                "truth": {k: round(v, 4) for k, v in truth.as_dict().items()},
                "noise": noise_json(noise),
                "sweeps": args.sweeps,
                "coverage": coverage,
                "truth_below": below,
                "goal": [0.93, 0.97],
                "median_width": width,
                "no_interval": failed,
                "n_opt_error": {
                    "noise_free_approach3": round(a3_clean, 4),
                    "noise_free_approach2": None if a2_clean is None else round(a2_clean, 4),
                    "noisy_median_abs_approach3": round(noisy_a3, 4),
                    "noisy_median_abs_approach2": round(float(np.median(a2)), 4) if a2 else None,
                },
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
