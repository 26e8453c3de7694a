"""How runs scatter around a fitted law, and intervals that respect it.

In log loss, a point is the law plus the law's misfit at its shape (shared by every budget's and seed's runs of that
depth and width: the law sees only N), plus its misfit at the (shape, budget) cell (shared by every seed's run there),
plus a run's own offset (shared by every horizon of a multi-horizon run: its seed, its stable phase) plus independent
noise per point. More seeds average away neither misfit. The variances are estimated by the method of moments on
the fit's residuals, with what the fit itself absorbs taken out (the residuals of a 5-parameter fit to 21 points
are smaller than the noise). The parametric bootstrap then redraws whole sweeps from that model around the fit and
refits each: its spread of laws is the confidence interval of the law; a new run at a new shape or budget adds its
own misfits, offset and noise on top (the prediction interval).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from scipy.optimize import nnls

from evaluation.chinchilla_fit import (
    HUBER_DELTA,
    Bootstrap,
    FitResult,
    Law,
    batched_objective,
    bootstrap,
    fit_law,
    refit,
)
from evaluation.scaling_data import ScalingPoints

# Huber's constant: 95% of least squares' efficiency on Gaussian noise, still robust to outliers
HUBER_TUNING = 1.345
# how the bootstrap resamples: redraw from the noise model, resample whole runs, resample points (Epoch's)
IntervalMethod = Literal["noise", "runs", "points"]


@dataclass(frozen=True)
class NoiseModel:
    """log L = log L_law(N, D) + s_shape + c_cell + u_run + e_point, each term normal with its own variance.

    An estimated model also carries each variance's degrees of freedom (Satterthwaite): seven runs pin the run
    variance about as well as four, and intervals that took it as exact would be too narrow (as z-intervals are
    where t-intervals belong), so the bootstrap draws each resample's variances from their uncertainty. The cell
    variance is told apart only where a (shape, budget) has runs of two seeds (otherwise it is in the point noise),
    the shape variance only where a shape has runs of two seeds and points at two budgets (otherwise it is in the
    run's or the cell's)."""

    run_sd: float
    point_sd: float
    run_df: float = math.inf
    point_df: float = math.inf
    cell_sd: float = 0.0
    cell_df: float = math.inf
    shape_sd: float = 0.0
    shape_df: float = math.inf

    @property
    def total_sd(self) -> float:
        """The scatter of one new run's loss around the law, at a shape and budget of its own."""
        return float(np.sqrt(self.run_sd**2 + self.point_sd**2 + self.cell_sd**2 + self.shape_sd**2))

    def draw(self, rng: np.random.Generator, size: int, design: ScalingPoints | None = None) -> np.ndarray:
        """(size, P) log-loss noise for the points of `design` (default: one new run's one point, at a shape and
        budget of its own): one misfit per shape and per cell, one offset per run, one per point; with finite
        degrees of freedom, each row's standard deviations are drawn first (scaled inverse χ²)."""
        one = np.zeros(1, int)
        runs, cells, shapes = (
            (one, one, one) if design is None else (design.runs, design.cells, design.shapes)
        )
        run_sd = self.run_sd * _sd_factor(rng, self.run_df, size)
        point_sd = self.point_sd * _sd_factor(rng, self.point_df, size)
        noise = run_sd * rng.normal(0.0, 1.0, (size, int(runs.max()) + 1))[:, runs] + point_sd * rng.normal(
            0.0, 1.0, (size, len(runs))
        )
        # drawn after: a model without a cell (shape) variance draws what the two-part (three-part) model drew
        for sd, df, labels in ((self.cell_sd, self.cell_df, cells), (self.shape_sd, self.shape_df, shapes)):
            if sd > 0:
                noise += self._term(rng, size, sd, df, labels)
        return noise

    @staticmethod
    def _term(rng: np.random.Generator, size: int, sd: float, df: float, labels: np.ndarray) -> np.ndarray:
        """(size, P) draws of one term: its sd scaled by its uncertainty, one normal per group of `labels`."""
        scale = sd * _sd_factor(rng, df, size)
        return scale * rng.normal(0.0, 1.0, (size, int(labels.max()) + 1))[:, labels]


def _sd_factor(rng: np.random.Generator, df: float, size: int) -> np.ndarray:
    """(size, 1) factors by which a standard deviation estimated with `df` degrees of freedom may differ from
    the true one: sqrt(df / χ²_df), 1 when it is known."""
    if not math.isfinite(df):
        return np.ones((size, 1))
    return np.sqrt(df / rng.chisquare(max(df, 0.5), (size, 1)))


def log_jacobian(law: Law, n: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(P, 5) derivatives of log L(N, D) with respect to (log A, log B, log E, α, β)."""
    t_n, t_d = law.A * np.power(n, -law.alpha), law.B * np.power(d, -law.beta)
    total = t_n + t_d + law.E
    return (
        np.stack([t_n, t_d, np.full_like(t_n, law.E), -t_n * np.log(n), -t_d * np.log(d)], axis=1)
        / total[:, None]
    )


def estimate_noise(points: ScalingPoints, law: Law) -> NoiseModel:
    """The shape, cell, run and point variances around Chinchilla's law (`residual_noise` of its residuals)."""
    residual = np.log(points.loss) - np.log(law.loss(points.n, points.d))
    return residual_noise(points, residual, log_jacobian(law, points.n, points.d))


# each grouping and the finer ones the design must tell it from
FINER = {"shape": ("cell", "run"), "cell": ("run",), "run": ()}


def residual_noise(points: ScalingPoints, residual: np.ndarray, jac: np.ndarray) -> NoiseModel:
    """Method-of-moments estimates of the variances from a fit's log-loss residuals r = (I − H)·noise, where H
    projects onto what the fit absorbs (the column space of `jac`, its log law's derivatives in its parameters):
    the sums of squares between shapes, between cells, between runs and within all three have expectations linear
    in the variances; solve (non-negative least squares). A grouping counts only where the design tells it from
    the finer ones — a shape with two seeds' runs and two budgets' cells, a (shape, budget) cell with two seeds'
    runs, a run with two horizons — else its scatter is theirs (one point per run: all of it the point's)."""
    keep = np.eye(len(points)) - jac @ np.linalg.pinv(jac)
    labels = {"shape": points.shapes, "cell": points.cells, "run": points.runs}
    point = np.arange(len(points))
    groupings = {
        name: _one_hot(group)
        for name, group in labels.items()
        if _holds_two(group, point) and all(_holds_two(group, labels[f]) for f in FINER[name])
    }
    within = np.eye(len(points))
    if groupings:
        within -= _projection(np.hstack(list(groupings.values())))
    forms = {**{name: _projection(z) for name, z in groupings.items()}, "point": within}
    # the covariance each unit of a variance gives the residuals
    covariance = {**{name: keep @ z @ z.T @ keep for name, z in groupings.items()}, "point": keep}
    coef = np.array([[np.trace(q @ c) for c in covariance.values()] for q in forms.values()])
    sums = np.array([residual @ q @ residual for q in forms.values()])
    var = dict(zip(forms, nnls(coef, sums)[0], strict=True))
    # each variance's degrees of freedom are those of the sum of squares that mostly measures it (between shapes,
    # cells, runs, within all): Satterthwaite's ν = tr(QΣ)² / tr(QΣQΣ)
    sigma = sum(var[name] * covariance[name] for name in forms)
    df = {name: _satterthwaite(forms[name] @ sigma) if var[name] > 0 else math.inf for name in forms}
    return NoiseModel(
        float(np.sqrt(var.get("run", 0.0))),
        float(np.sqrt(var["point"])),
        run_df=df.get("run", math.inf),
        point_df=df["point"],
        cell_sd=float(np.sqrt(var.get("cell", 0.0))),
        cell_df=df.get("cell", math.inf),
        shape_sd=float(np.sqrt(var.get("shape", 0.0))),
        shape_df=df.get("shape", math.inf),
    )


def _one_hot(labels: np.ndarray) -> np.ndarray:
    """(P, G) membership of each point in its group (labels 0..G-1)."""
    return np.eye(int(labels.max()) + 1)[labels]


def _projection(z: np.ndarray) -> np.ndarray:
    """The orthogonal projection onto the column space of z (onto the group means, for a membership matrix)."""
    return z @ np.linalg.pinv(z)


def _holds_two(outer: np.ndarray, inner: np.ndarray) -> bool:
    """Whether some group of `outer` holds points of two groups of `inner` (labels per point)."""
    return len(np.unique(np.stack([outer, inner], axis=1), axis=0)) > len(np.unique(outer))


def _satterthwaite(q_sigma: np.ndarray) -> float:
    """Degrees of freedom of the sum of squares rᵀQr of Gaussian residuals of covariance Σ, given QΣ."""
    square = float(np.trace(q_sigma @ q_sigma))
    return float(np.trace(q_sigma) ** 2 / square) if square > 0 else math.inf  # no scatter: nothing to draw


def noise_bootstrap(
    points: ScalingPoints,
    law: Law,
    noise: NoiseModel,
    n_resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
    delta: float = HUBER_DELTA,
    max_iter: int = 300,
) -> Bootstrap:
    """Refit `n_resamples` sweeps redrawn from the fitted law and the noise model (same design: every size and
    horizon kept, run offsets shared by a run's points, misfits by a cell's seeds and a shape's runs)."""
    log_n, log_d = np.log(points.n), np.log(points.d)
    rng = np.random.default_rng(seed)
    log_l = np.log(law.loss(points.n, points.d))[None] + noise.draw(rng, n_resamples, points)
    ones = np.ones(len(points))
    return refit(
        law,
        lambda t, rows: batched_objective(t, log_n, log_d, log_l[rows], ones, delta),
        n_resamples,
        level,
        max_iter,
    )


def prediction_interval(
    samples: dict[str, np.ndarray], noise: NoiseModel, n: float, d: float, level: float = 0.95, seed: int = 0
) -> tuple[float, float]:
    """Where a new run at (N, D) lands with probability `level`: each bootstrap law's loss there times a new
    run's own scatter (its shape's and its cell's misfits, its offset and point noise, with their uncertainty): a
    shape of its own. NaN without bootstrap laws."""
    if len(samples["E"]) == 0:
        return np.nan, np.nan
    law = Law(**{k: samples[k] for k in ("E", "A", "B", "alpha", "beta")})
    rng = np.random.default_rng(seed)
    with np.errstate(over="ignore", invalid="ignore"):  # a wild resample's law overflows: inf, ranked last
        loss = law.loss(n, d) * np.exp(noise.draw(rng, len(samples["E"]))[:, 0])
    lo, hi = np.nanpercentile(loss, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


@dataclass(frozen=True)
class CalibratedFit:
    """Approach 3 with its noise model and bootstrap: `fit.law` is the point estimate, `boot` the resampled laws
    (the law's confidence interval), `noise` the scatter a new run adds (its prediction interval)."""

    fit: FitResult
    noise: NoiseModel
    delta: float  # the Huber threshold the fit used, in log loss
    boot: Bootstrap
    method: str


def calibrated_fit(
    points: ScalingPoints,
    starts: np.ndarray | None = None,
    n_resamples: int = 2000,
    method: IntervalMethod = "noise",
    seed: int = 0,
    level: float = 0.95,
) -> CalibratedFit:
    """Fit with Hoffmann's δ = 1e-3 (an L1 fit: robust, but inefficient when runs scatter by percents), estimate
    the noise, refit with Huber's threshold scaled to it (δ = 1.345·σ), then bootstrap by `method`."""
    first = fit_law(points, starts=starts)
    delta = max(HUBER_DELTA, HUBER_TUNING * estimate_noise(points, first.law).total_sd)
    fit = fit_law(points, starts=first.law.theta(), delta=delta) if delta > HUBER_DELTA else first
    noise = estimate_noise(points, fit.law)
    if method == "noise":
        boot = noise_bootstrap(points, fit.law, noise, n_resamples, level, seed, delta)
    elif method in ("runs", "points"):
        table = points if method == "runs" else replace(points, run=None)
        boot = bootstrap(table, fit.law, n_resamples, level, seed, delta)
    else:
        raise ValueError(f"interval method {method!r}: choose noise, runs or points")
    return CalibratedFit(fit, noise, delta, boot, method)
