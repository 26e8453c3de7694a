"""Kaplan et al.'s (2020) joint law with an irreducible term, L(N, D) = E + ((N_c/N)^(α_N/α_D) + D_c/D)^α_D: the
second form fitted beside Chinchilla's, so the rung is predicted two ways before it trains and both are checked
after. On lmforge's small sweeps Chinchilla's form (fitted over a 4x range of compute) flattened too early: the
10x rung came in 4.5% below its prediction and 0.9% above this form's (README, `benchmarks/law_forms.py`).

Fitted in log loss with a robust soft-L1 loss (2%: residuals beyond count linearly), from a fixed start and
perturbations of it; the lowest objective wins. Its intervals (`kaplan_intervals`) come from the same parametric
bootstrap as Chinchilla's, so the spread between the two forms can be read beside the spread within each; the form
with the smaller error on the held-out budget sizes the rung (`evaluation.law_form`).
"""

from __future__ import annotations

import logging
import math
import pickle
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import OptimizeResult, least_squares

from evaluation.law_noise import NoiseModel, residual_noise
from evaluation.scaling_data import ScalingPoints
from infra.cores import one_thread_env

ROBUST_SCALE = 0.02
N_STARTS = 60
START = np.array([math.log(1e4), math.log(1e6), 0.7, 0.5, 0.5])  # log N_c, log D_c, α_N, α_D, log E
LOG_LIMIT = 700.0  # |log| of N_c, D_c and E: e^700 is a float, e^710 is not
EXPONENTS = ("alpha_n", "alpha_d")  # the size's and the data's, as Chinchilla's alpha and beta
# a fresh interpreter's share of the bootstrap, this file's package first on its path: pickled (points, log
# losses, theta) in, pickled laws out
_REFIT_ELSEWHERE = (
    "import pickle, sys; sys.path.insert(0, sys.argv[1]); from evaluation.kaplan_fit import _refit_rows; "
    "sys.stdout.buffer.write(pickle.dumps(_refit_rows(*pickle.load(sys.stdin.buffer))))"
)
ROWS_PER_PROCESS = 50  # the fewest resamples worth a helper interpreter (~1 s to start; a refit ~20-80 ms)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KaplanLaw:
    """L(N, D) = E + ((n_c / N)^(alpha_n / alpha_d) + d_c / D)^alpha_d."""

    n_c: float
    d_c: float
    alpha_n: float
    alpha_d: float
    E: float

    @classmethod
    def from_theta(cls, theta: np.ndarray) -> KaplanLaw:
        """The law of a parameter vector, its logs held to ±700 so that N_c, D_c and E stay positive finite floats
        (a bootstrap refit driving E to 0 passed e^-745, and a law with E = 0.0 has no log: its `loss` raised)."""
        log_nc, log_dc, alpha_n, alpha_d, log_e = (float(x) for x in theta)
        nc, dc, e = (math.exp(min(max(x, -LOG_LIMIT), LOG_LIMIT)) for x in (log_nc, log_dc, log_e))
        return cls(nc, dc, alpha_n, alpha_d, e)

    def loss(self, n: np.ndarray | float, d: np.ndarray | float) -> np.ndarray:
        return np.exp(_log_loss(self.theta(), np.asarray(n, dtype=float), np.asarray(d, dtype=float)))

    def optimal_n(self, c: np.ndarray | float) -> np.ndarray:
        """Compute-optimal parameters for budget C = 6·N·D: with p = α_N/α_D, the minimum of (n_c/N)^p + 6·d_c·N/C
        is at N* = (p · n_c^p · C / (6 · d_c))^(1 / (p + 1)) (E does not move it)."""
        p = self.alpha_n / self.alpha_d
        with np.errstate(all="ignore"):  # in logs: a resampled law's n_c^p can pass a float's range
            log_n = np.log(p) + p * np.log(self.n_c) + np.log(np.asarray(c, dtype=float) / (6.0 * self.d_c))
            return np.exp(log_n / (p + 1.0))

    def theta(self) -> np.ndarray:
        return np.array(
            [math.log(self.n_c), math.log(self.d_c), self.alpha_n, self.alpha_d, math.log(self.E)]
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def _log_loss(theta: np.ndarray, n: np.ndarray, d: np.ndarray) -> np.ndarray:
    log_nc, log_dc, alpha_n, alpha_d, log_e = theta
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        inner = np.exp(alpha_n / alpha_d * (log_nc - np.log(n))) + np.exp(log_dc - np.log(d))
        return np.log(np.exp(log_e) + inner**alpha_d)


def _log_jacobian(theta: np.ndarray, n: np.ndarray, d: np.ndarray) -> np.ndarray:
    """(P, 5) derivatives of the log law in its parameters (log N_c, log D_c, α_N, α_D, log E): with
    u = (N_c/N)^(α_N/α_D), v = D_c/D, s = u + v and T = s^α_D, the law is log(E + T)."""
    log_nc, log_dc, alpha_n, alpha_d, log_e = theta
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        log_ratio = log_nc - np.log(n)
        u, v = np.exp(alpha_n / alpha_d * log_ratio), np.exp(log_dc - np.log(d))
        s = u + v
        t = s**alpha_d
        e = math.exp(log_e)
        share, fu = t / (e + t), u / s
        return np.stack(
            [
                share * alpha_n * fu,
                share * alpha_d * v / s,
                share * fu * log_ratio,
                share * (np.log(s) - alpha_n / alpha_d * fu * log_ratio),
                e / (e + t),
            ],
            axis=1,
        )


def _solve(points: ScalingPoints, y: np.ndarray, start: np.ndarray, max_nfev: int) -> OptimizeResult | None:
    """One robust least-squares fit of the log law to log losses `y` from `start` (scipy's result), None when it
    runs off (a loss or derivative that is not finite)."""
    try:
        with np.errstate(all="ignore"):
            sol = least_squares(
                lambda t: _log_loss(t, points.n, points.d) - y,
                start,
                jac=lambda t: _log_jacobian(t, points.n, points.d),
                loss="soft_l1",
                f_scale=ROBUST_SCALE,
                max_nfev=max_nfev,
            )
    except (ValueError, OverflowError):
        return None
    return sol if np.all(np.isfinite(sol.fun)) else None


def fit_kaplan(
    points: ScalingPoints, starts: int = N_STARTS, seed: int = 0, start: KaplanLaw | None = None
) -> KaplanLaw:
    """The lowest robust fit from `start` (default `START`) and `starts − 1` random perturbations of it
    (deterministic per seed)."""
    y = np.log(points.loss)
    rng = np.random.default_rng(seed)
    base = START if start is None else start.theta()
    best = None
    for i in range(starts):
        sol = _solve(points, y, base + (rng.normal(0.0, 0.5, base.size) if i else 0.0), 20000)
        if sol is not None and (best is None or sol.cost < best.cost):
            best = sol
    if best is None:
        raise ValueError("Kaplan's form did not converge from any start")
    return KaplanLaw.from_theta(best.x)


@dataclass(frozen=True)
class KaplanIntervals:
    """`level` intervals of Kaplan's form: its loss at one (N, D) (the law's), where one new run there lands, its
    compute-optimal N at a budget and its exponents; from `n` resampled fits (`n_failed` more did not converge)."""

    loss: tuple[float, float]
    run: tuple[float, float]
    n_opt: tuple[float, float]
    exponents: dict[str, tuple[float, float]]  # alpha_n, alpha_d
    n: int
    n_failed: int


def kaplan_intervals(
    points: ScalingPoints,
    law: KaplanLaw,
    n: float,
    d: float,
    budget: float,
    n_resamples: int = 500,
    level: float = 0.95,
    seed: int = 0,
    processes: int = 1,
) -> KaplanIntervals:
    """The parametric bootstrap Chinchilla's fit uses (`law_noise`): the shape, cell, run and point noise its
    residuals show (what the five parameters absorb taken out), sweeps redrawn from the law and that noise on the
    same design, each refitted as the law was (`_refit`, over `processes`: the same intervals for any number); a
    new run adds its own misfits, offset and noise to each resample's loss."""
    theta = law.theta()
    noise = kaplan_noise(points, law)
    rng = np.random.default_rng(seed)
    redrawn = _log_loss(theta, points.n, points.d)[None] + noise.draw(rng, n_resamples, points)
    fitted = [
        f
        for f in _refits(points, redrawn, theta, processes)
        if f is not None and np.isfinite(f.optimal_n(budget))
    ]
    loss = np.array([f.loss(n, d) for f in fitted], dtype=float)
    run = loss * np.exp(noise.draw(rng, len(loss))[:, 0])
    n_opt = np.array([f.optimal_n(budget) for f in fitted], dtype=float)
    q = [50 * (1 - level), 50 * (1 + level)]

    def interval(x: np.ndarray) -> tuple[float, float]:
        lo, hi = np.nanpercentile(x, q) if len(x) else (math.nan, math.nan)
        return float(lo), float(hi)

    exponents = {k: interval(np.array([getattr(f, k) for f in fitted])) for k in EXPONENTS}
    return KaplanIntervals(
        interval(loss), interval(run), interval(n_opt), exponents, len(fitted), n_resamples - len(fitted)
    )


def _refits(
    points: ScalingPoints, ys: np.ndarray, theta: np.ndarray, processes: int
) -> list[KaplanLaw | None]:
    """`_refit` of each row of `ys`, in order, split over `processes`: this one and fresh interpreters (no fork of
    a process holding torch's and Ray's threads). Each refit is deterministic, so the laws do not depend on the
    split (the demo's 500: ~40 s in one process on an AMD EPYC, ~20 s over its two cores)."""
    chunks = np.array_split(ys, max(1, min(processes, len(ys) // ROWS_PER_PROCESS)))
    if len(chunks) == 1:
        return _refit_rows(points, ys, theta)
    with ThreadPoolExecutor(len(chunks) - 1) as threads:
        others = [threads.submit(_refit_elsewhere, points, chunk, theta) for chunk in chunks[1:]]
        mine = _refit_rows(points, chunks[0], theta)
        return mine + [law for other in others for law in other.result()]


def _refit_rows(points: ScalingPoints, ys: np.ndarray, theta: np.ndarray) -> list[KaplanLaw | None]:
    return [_refit(points, y, theta) for y in ys]


def _refit_elsewhere(points: ScalingPoints, ys: np.ndarray, theta: np.ndarray) -> list[KaplanLaw | None]:
    """`_refit_rows` in a fresh one-thread interpreter; in this one where that fails (it only costs time)."""
    root = str(Path(__file__).resolve().parents[1])
    try:
        done = subprocess.run(
            [sys.executable, "-c", _REFIT_ELSEWHERE, root],
            input=pickle.dumps((points, ys, theta)),
            capture_output=True,
            env=one_thread_env(),
            check=True,
        )
        return pickle.loads(done.stdout)
    except (OSError, subprocess.CalledProcessError, pickle.UnpicklingError, EOFError) as error:
        detail = getattr(error, "stderr", b"") or b""
        log.warning("Kaplan bootstrap: a helper process failed (%s %s); refitting here", error, detail[-300:])
        return _refit_rows(points, ys, theta)


def _refit(points: ScalingPoints, y: np.ndarray, theta: np.ndarray) -> KaplanLaw | None:
    """The law fitted to log losses `y` at the points' (N, D), the best of a few starts: the law `theta` the
    sweep gave, the same with E at a quarter, half and three quarters of the lowest loss, and `START`; None when
    every start runs off. From `theta` alone a refit keeps its E: at E → 0 (the demo's sweeps) the gradient in
    log E vanishes, and the exponents' intervals came out ~8x too narrow (α_N width 0.034, where refits that may
    move E give ~0.26); these starts reach what 40 random ones reach (60 of the demo's resamples, to 1e-8)."""
    low = float(np.exp(y).min())
    starts = [theta, *(np.r_[theta[:4], math.log(f * low)] for f in (0.25, 0.5, 0.75)), START]
    best = None
    for start in starts:
        sol = _solve(points, y, start, 2000)
        if sol is not None and sol.success and (best is None or sol.cost < best.cost):
            best = sol
    try:
        return None if best is None else KaplanLaw.from_theta(best.x)
    except OverflowError:  # a law whose N_c or D_c passes a float's range
        return None


def kaplan_noise(points: ScalingPoints, law: KaplanLaw) -> NoiseModel:
    """The shape, cell, run and point noise of `points` around the law (`residual_noise`: what its five
    parameters absorb taken out)."""
    theta = law.theta()
    residual = np.log(points.loss) - _log_loss(theta, points.n, points.d)
    return residual_noise(points, residual, _log_jacobian(theta, points.n, points.d))
