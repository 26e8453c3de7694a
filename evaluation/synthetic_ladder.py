"""Sweeps drawn from a known law, to measure whether the fit's intervals cover the truth as often as they say.

A design is a sweep's (N, D) points and which run each belongs to (lmforge's multi-horizon runs give one point per
budget); a simulated sweep is the law at every point times the noise model's misfits, run offsets and point noise.
For each simulated sweep the fit, its intervals and the rung's prediction are checked against the law that made it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from evaluation.chinchilla_fit import Law
from evaluation.isoflop import fit_parabolas
from evaluation.kaplan_fit import KaplanLaw, fit_kaplan, kaplan_intervals
from evaluation.law_noise import IntervalMethod, NoiseModel, calibrated_fit, prediction_interval
from evaluation.loss_curve import PointLaw
from evaluation.scaling_data import ScalingDataError, ScalingPoints
from evaluation.scaling_report import compute_optimal, intervals_at


@dataclass(frozen=True)
class Design:
    """The (N, D) of every point of a sweep and the run it comes from."""

    n: np.ndarray
    d: np.ndarray
    run: np.ndarray

    def points(self, loss: np.ndarray) -> ScalingPoints:
        c = 6.0 * self.n * self.d
        return ScalingPoints(self.n, self.d, loss, c, self.n.copy(), source="synthetic", run=self.run)


def simulate(law: PointLaw, design: Design, noise: NoiseModel, rng: np.random.Generator) -> ScalingPoints:
    """One sweep: the law at every point with a misfit shared by each shape's runs, one by each (shape, budget)
    cell's runs, an offset shared by each run's points and noise per point."""
    exact = design.points(law.loss(design.n, design.d))
    return replace(exact, loss=exact.loss * np.exp(noise.draw(rng, 1, exact)[0]))


@dataclass(frozen=True)
class Trial:
    """One simulated sweep's fit against the truth: for each quantity, whether its 95% interval held the truth
    and whether the truth lay below it, and the fit's N* error (Approach 3 and Approach 2) against the analytic
    optimum."""

    covered: dict[str, bool]
    # the truth below the interval: misses all on one side say the estimate is biased, not the interval narrow
    below: dict[str, bool]
    width: dict[
        str, float
    ]  # relative widths (hi / lo for N*, hi − lo for exponents, (hi − lo) / truth for losses)
    n_opt_error: float  # Approach 3's N*(target) / truth − 1
    approach2_error: float | None  # Approach 2's, when every budget gave a parabola


def run_trial(
    truth: Law,
    design: Design,
    noise: NoiseModel,
    budget: float,
    method: IntervalMethod,
    rng: np.random.Generator,
    n_resamples: int = 1000,
) -> Trial:
    """Simulate one sweep, fit it as lmforge does (`calibrated_fit`), and check α, β, N*(budget) and the rung's
    loss at the fitted optimum (the law's, for the confidence interval; a new run's, for the prediction
    interval) against the truth."""
    points = simulate(truth, design, noise, rng)
    fitted = calibrated_fit(points, None, n_resamples, method, seed=int(rng.integers(2**31)))
    law, boot = fitted.fit.law, fitted.boot
    est = boot.samples
    n_true = float(truth.optimal_n(budget))
    n_rung = float(law.optimal_n(budget))
    d_rung = budget / (6.0 * n_rung)
    law_loss = float(truth.loss(n_rung, d_rung))
    run_loss = law_loss * float(np.exp(noise.draw(rng, 1)[0, 0]))
    lo_c, hi_c = (float(v[0]) for v in intervals_at(est, n_rung, d_rung))
    lo_p, hi_p = prediction_interval(est, fitted.noise, n_rung, d_rung, seed=int(rng.integers(2**31)))
    bounds = {
        "alpha": boot.interval("alpha"),
        "beta": boot.interval("beta"),
        "n_opt": compute_optimal(points, law, est, budget).n_opt_interval,
        "rung_law": (lo_c, hi_c),
        "rung_run": (lo_p, hi_p),
    }
    values = {
        "alpha": truth.alpha,
        "beta": truth.beta,
        "n_opt": n_true,
        "rung_law": law_loss,
        "rung_run": run_loss,
    }
    covered, below, width = scored(bounds, values, law_loss)
    try:
        iso = fit_parabolas(points)
        a2 = float(iso.n_opt(budget)) / n_true - 1 if iso.n_opt and not iso.skipped else None
    except ScalingDataError:
        a2 = None
    return Trial(covered, below, width, n_rung / n_true - 1, a2)


def run_kaplan_trial(
    truth: KaplanLaw,
    design: Design,
    noise: NoiseModel,
    budget: float,
    rng: np.random.Generator,
    n_resamples: int = 500,
) -> Trial:
    """`run_trial` for Kaplan's form: simulate a sweep from a Kaplan law, fit it as lmforge does (`fit_kaplan`,
    `kaplan_intervals`) and check its exponents, N*(budget) and the rung's loss at the fitted optimum."""
    points = simulate(truth, design, noise, rng)
    law = fit_kaplan(points)
    n_true = float(truth.optimal_n(budget))
    n_rung = float(law.optimal_n(budget))
    d_rung = budget / (6.0 * n_rung)
    got = kaplan_intervals(points, law, n_rung, d_rung, budget, n_resamples, seed=int(rng.integers(2**31)))
    law_loss = float(truth.loss(n_rung, d_rung))
    run_loss = law_loss * float(np.exp(noise.draw(rng, 1)[0, 0]))
    bounds = {**got.exponents, "n_opt": got.n_opt, "rung_law": got.loss, "rung_run": got.run}
    values = {**{k: getattr(truth, k) for k in got.exponents}, "n_opt": n_true, "rung_law": law_loss}
    values["rung_run"] = run_loss
    return Trial(*scored(bounds, values, law_loss), n_rung / n_true - 1, None)


def scored(
    bounds: dict[str, tuple[float, float]], values: dict[str, float], law_loss: float
) -> tuple[dict[str, bool], dict[str, bool], dict[str, float]]:
    """Whether each 95% interval holds its true value, whether the value lies below it, and its width: high / low
    for N*, relative to the law's loss at the rung for the rung's losses (`rung_law`, `rung_run`), high − low for
    an exponent."""
    covered = {k: bool(lo <= values[k] <= hi) for k, (lo, hi) in bounds.items()}
    below = {k: bool(values[k] < lo) for k, (lo, _) in bounds.items()}
    width = {
        k: hi / lo if k == "n_opt" else (hi - lo) / law_loss if k.startswith("rung_") else hi - lo
        for k, (lo, hi) in bounds.items()
    }
    return covered, below, width
