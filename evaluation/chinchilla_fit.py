"""Approach 3 of Hoffmann et al. (2022), as re-done by Besiroglu et al. (2024): fit L(N, D) = E + A/N^α + B/D^β.

The law is fitted in log-sum-exp form, log L = LSE(a − α log N, b − β log D, e) with A = e^a, B = e^b, E = e^e,
by minimising the sum of Huber losses (δ = 1e-3) of the log-loss residuals with L-BFGS-B. The starts come from
Variable Projection (`projected_starts`): for fixed (α, β) the law is linear in (E, A, B), so a grid over the two
exponents alone, each cell solved by non-negative least squares, finds the basin that Hoffmann et al.'s
4,500-point grid over all five parameters searched for. The objective is nearly an L1 loss, flat and kinked near
its optimum: loose tolerances stop early, so the solver runs with a tight gradient tolerance, on an objective
scaled by 1/δ, until it converges.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from scipy.optimize import minimize

from evaluation.scaling_data import ScalingPoints, check_design

HUBER_DELTA = 1e-3
# Hoffmann et al.'s initialisation grid: 5 α × 5 β × 5 e × 6 a × 6 b = 4500 starts.
GRID = {
    "a": np.arange(0, 30, 5.0),
    "b": np.arange(0, 30, 5.0),
    "e": np.arange(-1, 1.5, 0.5),
    "alpha": np.arange(0, 2.5, 0.5),
    "beta": np.arange(0, 2.5, 0.5),
}
HOFFMANN = {"E": 1.69, "A": 406.4, "B": 410.7, "alpha": 0.34, "beta": 0.28}  # their published Approach 3
PARAM_ORDER = ("a", "b", "e", "alpha", "beta")
EXPONENT_GRID = np.arange(0.02, 2.5, 0.02)  # α and β for Variable Projection: 124 x 124 cells
CELL_BLOCK = 2_000_000  # numbers per column of a block of cells solved at once (three columns: ~50 MB)


@dataclass(frozen=True)
class Law:
    """L(N, D) = E + A / N^alpha + B / D^beta."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    @classmethod
    def from_theta(cls, theta: np.ndarray) -> Law:
        a, b, e, alpha, beta = (float(x) for x in theta)
        with np.errstate(over="ignore"):
            return cls(E=float(np.exp(e)), A=float(np.exp(a)), B=float(np.exp(b)), alpha=alpha, beta=beta)

    def theta(self) -> np.ndarray:
        return np.array([math.log(self.A), math.log(self.B), math.log(self.E), self.alpha, self.beta])

    def loss(self, n: np.ndarray | float, d: np.ndarray | float) -> np.ndarray:
        return self.E + self.A / np.power(n, self.alpha) + self.B / np.power(d, self.beta)

    @property
    def a(self) -> float:
        """Exponent of N*(C) ∝ C^a."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """Exponent of D*(C) ∝ C^b."""
        return self.alpha / (self.alpha + self.beta)

    def optimal_n(self, c: np.ndarray | float) -> np.ndarray:
        """Compute-optimal parameters for budget C = 6·N·D (minimises L along the IsoFLOP curve)."""
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))
        return g * np.power(np.asarray(c, dtype=float) / 6.0, self.a)

    def optimal_d(self, c: np.ndarray | float) -> np.ndarray:
        return np.asarray(c, dtype=float) / (6.0 * self.optimal_n(c))

    def as_dict(self) -> dict[str, float]:
        return asdict(self) | {"a": self.a, "b": self.b}


@dataclass(frozen=True)
class FitResult:
    law: Law
    objective: float  # Huber sum at the optimum (in loss units, not scaled by 1/δ)
    max_grad: float  # max |gradient| of the 1/δ-scaled objective at the optimum (0 at a smooth minimum)
    n_starts: int
    n_points: int


def batched_objective(
    theta: np.ndarray,
    log_n: np.ndarray,
    log_d: np.ndarray,
    log_l: np.ndarray,
    weights: np.ndarray,
    delta: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Weighted Huber sums of log-loss residuals divided by δ for K parameter vectors, and their gradients.

    theta is (K, 5) in (a, b, e, α, β); weights is (P,) or (K, P) (bootstrap multiplicities). Returns (K,), (K, 5).
    """
    a, b, e, alpha, beta = (theta[:, i : i + 1] for i in range(5))
    t1, t2 = a - alpha * log_n, b - beta * log_d
    t3 = np.broadcast_to(e, t1.shape)
    m = np.maximum(np.maximum(t1, t2), t3)
    e1, e2, e3 = np.exp(t1 - m), np.exp(t2 - m), np.exp(t3 - m)
    total = e1 + e2 + e3
    r = m + np.log(total) - log_l
    abs_r = np.abs(r)
    huber = np.where(abs_r <= delta, 0.5 * r * r, delta * (abs_r - 0.5 * delta))
    value = (weights * huber).sum(axis=1) / delta
    dr = weights * np.clip(r, -delta, delta) / (delta * total)
    g1, g2 = dr * e1, dr * e2
    grad = np.stack(
        [g1.sum(1), g2.sum(1), (dr * e3).sum(1), -(g1 * log_n).sum(1), -(g2 * log_d).sum(1)], axis=1
    )
    return value, grad


def batched_lbfgs(
    fun: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    x0: np.ndarray,
    max_iter: int = 1000,
    gtol: float = 1e-8,
    memory: int = 10,
    max_backtracks: int = 20,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """L-BFGS with a backtracking (Armijo) line search, run on K independent problems at once.

    `fun(x, rows)` maps points x (len(rows), p) of problems `rows` to values and gradients.
    Returns the final points, values and a per-row convergence flag (max |gradient| ≤ gtol).
    """
    x = np.array(x0, dtype=float)
    k, p = x.shape
    f, g = fun(x, np.arange(k))
    s_mem, y_mem = np.zeros((k, memory, p)), np.zeros((k, memory, p))
    rho = np.zeros((k, memory))  # 0 marks an empty slot; slot 0 is the newest pair
    done = np.abs(g).max(1) <= gtol
    for _ in range(max_iter):
        act = np.flatnonzero(~done & np.isfinite(f))
        if act.size == 0:
            break
        s_act, y_act, rho_act = s_mem[act], y_mem[act], rho[act]  # gathered once: (k, memory, p)
        q, alphas = g[act].copy(), np.zeros((act.size, memory))
        for i in range(memory):
            alphas[:, i] = rho_act[:, i] * np.einsum("kp,kp->k", s_act[:, i], q)
            q -= alphas[:, i, None] * y_act[:, i]
        sy = np.einsum("kp,kp->k", s_act[:, 0], y_act[:, 0])
        yy = np.einsum("kp,kp->k", y_act[:, 0], y_act[:, 0])
        gamma = np.where(
            rho_act[:, 0] > 0, sy / np.maximum(yy, 1e-300), 1.0 / np.maximum(np.abs(g[act]).max(1), 1.0)
        )
        r = gamma[:, None] * q
        for i in reversed(range(memory)):
            beta = rho_act[:, i] * np.einsum("kp,kp->k", y_act[:, i], r)
            r += s_act[:, i] * (alphas[:, i] - beta)[:, None]
        direction = -r
        slope = np.einsum("kp,kp->k", direction, g[act])
        bad = ~(slope < 0)  # not a descent direction: forget the memory, go downhill
        direction[bad] = -g[act][bad]
        slope[bad] = -np.einsum("kp,kp->k", g[act][bad], g[act][bad])
        rho[act[bad]] = 0.0
        step = np.ones(act.size)
        new_x, new_f, new_g = x[act].copy(), f[act].copy(), g[act].copy()
        pending = np.arange(act.size)
        for _ in range(max_backtracks):
            trial = x[act[pending]] + step[pending, None] * direction[pending]
            tf, tg = fun(trial, act[pending])
            ok = np.isfinite(tf) & (tf <= f[act[pending]] + 1e-4 * step[pending] * slope[pending])
            new_x[pending[ok]], new_f[pending[ok]], new_g[pending[ok]] = trial[ok], tf[ok], tg[ok]
            pending = pending[~ok]
            if pending.size == 0:
                break
            step[pending] *= 0.5
        moved = np.setdiff1d(np.arange(act.size), pending)
        s, y = new_x - x[act], new_g - g[act]
        sy = np.einsum("kp,kp->k", s, y)
        store = act[moved[sy[moved] > 1e-12 * np.maximum(1.0, np.abs(new_f[moved]))]]
        loc = np.searchsorted(act, store)
        s_mem[store], y_mem[store], rho[store] = (
            np.roll(s_mem[store], 1, axis=1),
            np.roll(y_mem[store], 1, axis=1),
            np.roll(rho[store], 1, axis=1),
        )
        s_mem[store, 0], y_mem[store, 0], rho[store, 0] = s[loc], y[loc], 1.0 / sy[loc]
        x[act], f[act], g[act] = new_x, new_f, new_g
        done[act[pending]] = True  # no decrease found along a descent direction: at the solver's precision
        done |= np.abs(g).max(1) <= gtol
    return x, f, np.abs(g).max(1) <= gtol


def grid_starts() -> np.ndarray:
    return np.array(list(itertools.product(*(GRID[k] for k in PARAM_ORDER))))


def projected_starts(
    points: ScalingPoints, keep: int = 32, exponents: np.ndarray = EXPONENT_GRID
) -> np.ndarray:
    """Variable Projection: for every (α, β) on the grid, the E, A, B ≥ 0 that minimise the squared relative
    residuals (E + A/N^α + B/D^β − L) / L (the log residuals to first order) (`cell_nnls`, all cells at once); the
    `keep` best cells as starts (rows of `PARAM_ORDER`). A coefficient at its bound 0 starts at 1e-9 of the loss
    scale."""
    loss = np.asarray(points.loss, dtype=float)
    n_pow = np.power(np.asarray(points.n, dtype=float)[None, :], -exponents[:, None]) / loss  # (G, P)
    d_pow = np.power(np.asarray(points.d, dtype=float)[None, :], -exponents[:, None]) / loss
    g, p = len(exponents), len(loss)
    rows = max(1, CELL_BLOCK // (g * p))  # α values a block: its cells' columns stay ~CELL_BLOCK numbers each
    blocks = [
        cell_nnls(
            np.stack(
                [
                    np.broadcast_to(1.0 / loss, (len(n_block), g, p)),
                    *np.broadcast_arrays(n_block[:, None], d_pow[None]),
                ],
                axis=-1,
            ).reshape(-1, p, 3),  # cell (i, j) has α = exponents[i], β = exponents[j]
            np.ones_like(loss),
        )
        for n_block in np.array_split(n_pow, range(rows, g, rows))
    ]
    coef, residual = np.concatenate([c for c, _ in blocks]), np.concatenate([r for _, r in blocks])
    best = np.argsort(residual, kind="stable")[:keep]
    floor = 1e-9 * float(np.median(loss))
    e, a, b = np.log(np.maximum(coef[best], floor)).T
    return np.stack([a, b, e, exponents[best // g], exponents[best % g]], axis=1)


def cell_nnls(columns: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative least squares of `target` (P,) on each of K small column sets (K, P, M), all at once: the
    least-squares solution on every subset of the columns, the best whose coefficients are all ≥ 0 (the NNLS
    optimum is the unconstrained one on its own support). Returns the coefficients (K, M) and residual norms (K,)."""
    k, _, m = columns.shape
    scale = np.maximum(np.linalg.norm(columns, axis=1), 1e-300)  # (K, M): unit columns, for conditioning
    unit = columns / scale[:, None, :]
    gram, rhs = np.matmul(unit.transpose(0, 2, 1), unit), unit.transpose(0, 2, 1) @ target
    best_coef, best_res = np.zeros((k, m)), np.full(k, float(np.linalg.norm(target)))
    for r in range(1, m + 1):
        for support in itertools.combinations(range(m), r):
            idx = np.array(support)
            gram_s, rhs_s = gram[:, idx[:, None], idx], rhs[:, idx, None]
            with np.errstate(all="ignore"):
                try:
                    sol = np.linalg.solve(gram_s, rhs_s)[..., 0]
                except np.linalg.LinAlgError:  # a cell whose columns are dependent
                    sol = (np.linalg.pinv(gram_s) @ rhs_s)[..., 0]
                res = np.linalg.norm(target - (unit[:, :, idx] @ sol[..., None])[..., 0], axis=1)
            better = np.all(sol >= 0, axis=1) & (res < best_res)
            best_coef[better] = 0.0
            best_coef[np.ix_(better, idx)] = sol[better] / scale[better][:, idx]
            best_res[better] = res[better]
    return best_coef, best_res


def _data(points: ScalingPoints) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.log(points.n), np.log(points.d), np.log(points.loss)


def polish(
    theta: np.ndarray, points: ScalingPoints, delta: float = HUBER_DELTA
) -> tuple[np.ndarray, float, float]:
    """Run scipy's L-BFGS-B from `theta` to a tight tolerance, restarting (which resets its curvature memory)
    until the objective stops improving. Returns the point, the objective (scaled by 1/δ) and max |gradient|."""
    log_n, log_d, log_l = _data(points)
    ones = np.ones_like(log_l)

    def fun(t: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = batched_objective(t[None], log_n, log_d, log_l, ones, delta)
        return float(value[0]), grad[0]

    opts = {"gtol": 1e-10, "ftol": 1e-15, "maxiter": 20000, "maxcor": 20}
    res = minimize(fun, theta, jac=True, method="L-BFGS-B", options=opts)
    for _ in range(10):
        again = minimize(fun, res.x, jac=True, method="L-BFGS-B", options=opts)
        if again.fun >= res.fun - 1e-12 * max(1.0, abs(res.fun)):
            break
        res = again
    return res.x, float(res.fun), float(np.abs(fun(res.x)[1]).max())


def fit_law(
    points: ScalingPoints,
    starts: np.ndarray | None = None,
    delta: float = HUBER_DELTA,
    screen_iters: int = 80,
    n_polish: int = 5,
) -> FitResult:
    """Fit Approach 3 from every start (default: `projected_starts`) and keep the lowest objective.

    All starts run `screen_iters` iterations together through a vectorised L-BFGS (seconds for 4500 starts,
    where one scipy call per start takes minutes); the `n_polish` best are then run to convergence with
    scipy's L-BFGS-B and the lowest objective wins.
    """
    check_design(points, n_params=5)
    log_n, log_d, log_l = _data(points)
    starts = projected_starts(points) if starts is None else np.atleast_2d(np.asarray(starts, dtype=float))
    ones = np.ones_like(log_l)
    with np.errstate(over="ignore", invalid="ignore"):
        x, f, _ = batched_lbfgs(
            lambda t, _: batched_objective(t, log_n, log_d, log_l, ones, delta), starts, max_iter=screen_iters
        )
    order = np.argsort(np.where(np.isfinite(f), f, np.inf))[:n_polish]
    theta, value, max_grad = min((polish(x[i], points, delta) for i in order), key=lambda r: r[1])
    return FitResult(Law.from_theta(theta), value * delta, max_grad, len(starts), len(points))


def hoffmann_start() -> np.ndarray:
    return Law(**HOFFMANN).theta()


@dataclass(frozen=True)
class Bootstrap:
    """Percentile intervals over `n` resample fits, each started from the full-data optimum."""

    samples: dict[str, np.ndarray]  # parameter name -> (n,) fitted values
    n: int
    level: float
    n_diverged: int = 0  # resamples whose fit ran off to infinity (left out of the intervals)

    def interval(self, name: str) -> tuple[float, float]:
        """The percentile interval; NaN when no resample's fit stayed finite (a degenerate law: see `n_diverged`)."""
        if self.n == 0:
            return math.nan, math.nan
        lo, hi = np.percentile(self.samples[name], [50 * (1 - self.level), 50 * (1 + self.level)])
        return float(lo), float(hi)

    def intervals(self) -> dict[str, tuple[float, float]]:
        return {k: self.interval(k) for k in self.samples}


def bootstrap(
    points: ScalingPoints,
    law: Law,
    n_resamples: int = 4000,
    level: float = 0.95,
    seed: int = 0,
    delta: float = HUBER_DELTA,
    max_iter: int = 300,
) -> Bootstrap:
    """Refit on `n_resamples` resamples of the runs (drawn with replacement, each with all its points: the
    horizons of one run share its noise) and collect every parameter. With one point per run (a plain table)
    this is Epoch's bootstrap of the points.

    Resamples enter as multiplicity weights, so all refits run in one vectorised L-BFGS.
    """
    log_n, log_d, log_l = _data(points)
    runs = points.runs
    n_runs = int(runs.max()) + 1
    rng = np.random.default_rng(seed)
    weights = rng.multinomial(n_runs, np.full(n_runs, 1.0 / n_runs), size=n_resamples).astype(float)[:, runs]
    return refit(
        law,
        lambda t, rows: batched_objective(t, log_n, log_d, log_l, weights[rows], delta),
        n_resamples,
        level,
        max_iter,
    )


def refit(
    law: Law,
    fun: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
    n_resamples: int,
    level: float,
    max_iter: int,
) -> Bootstrap:
    """Run `n_resamples` refits (`fun(theta, rows)`: the resampled objectives) from `law` together; keep the
    finite ones."""
    start = np.tile(law.theta(), (n_resamples, 1))
    with np.errstate(over="ignore", invalid="ignore"):
        x, _, _ = batched_lbfgs(fun, start, max_iter=max_iter, gtol=1e-6)
    # a resample of a small table can lose a whole size or budget and run off to infinity: keep finite fits
    finite = np.all(np.isfinite(x), axis=1) & np.all(np.abs(x) < 100, axis=1)
    a, b, e, alpha, beta = x[finite].T
    with np.errstate(over="ignore"):
        samples = {"E": np.exp(e), "A": np.exp(a), "B": np.exp(b), "alpha": alpha, "beta": beta}
    samples |= {"a": beta / (alpha + beta), "b": alpha / (alpha + beta)}  # as `Law.a`, `Law.b`
    return Bootstrap(samples, len(alpha), level, n_resamples - len(alpha))
