"""Approach 2 of Hoffmann et al. (2022): per compute budget, a parabola of loss in log N through the IsoFLOP
runs; its minimum is that budget's optimal size. Power laws N_opt ∝ C^a and D_opt ∝ C^b through the minima.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from evaluation.scaling_data import ScalingDataError, ScalingPoints

MIN_SIZES = 3  # a parabola needs three distinct sizes


@dataclass(frozen=True)
class Parabola:
    """loss ≈ c2·x² + c1·x + c0 with x = log N, for one budget."""

    budget: float
    coeffs: tuple[float, float, float]
    n_opt: float
    d_opt: float
    loss_opt: float
    n_runs: int

    def loss(self, n: np.ndarray) -> np.ndarray:
        return np.polyval(self.coeffs, np.log(n))


@dataclass(frozen=True)
class PowerLaw:
    """y = k · C^exponent, fitted by least squares in log-log space."""

    exponent: float
    coefficient: float

    def __call__(self, c: np.ndarray | float) -> np.ndarray:
        return self.coefficient * np.power(np.asarray(c, dtype=float), self.exponent)


@dataclass(frozen=True)
class IsoFlopFit:
    parabolas: list[Parabola]
    n_opt: PowerLaw | None  # None with fewer than two usable budgets
    d_opt: PowerLaw | None
    skipped: list[str] = field(default_factory=list)  # one line per budget left out, with the reason


def fit_parabolas(points: ScalingPoints, rel_tol: float = 0.05) -> IsoFlopFit:
    """Fit one parabola per budget with at least three sizes; say why any budget was left out."""
    labels = points.budgets(rel_tol)
    parabolas, skipped = [], []
    for budget in np.unique(labels):
        group = labels == budget
        sizes = np.unique(points.n[group])
        if len(sizes) < MIN_SIZES:
            skipped.append(
                f"budget {budget:.3g} FLOPs: {len(sizes)} model size(s), a parabola needs {MIN_SIZES}"
            )
            continue
        x, y = np.log(points.n[group]), points.loss[group]
        coeffs = np.polyfit(x, y, 2)
        if coeffs[0] <= 0:
            skipped.append(f"budget {budget:.3g} FLOPs: loss is not convex in log N (no interior minimum)")
            continue
        x_opt = -coeffs[1] / (2 * coeffs[0])
        if not x.min() <= x_opt <= x.max():
            skipped.append(
                f"budget {budget:.3g} FLOPs: minimum at N={np.exp(x_opt):.3g} lies outside the sizes tried "
                f"({np.exp(x.min()):.3g}–{np.exp(x.max()):.3g}); add sizes on that side"
            )
            continue
        n_opt = float(np.exp(x_opt))
        parabolas.append(
            Parabola(
                float(budget),
                tuple(float(c) for c in coeffs),
                n_opt,
                float(budget / (6 * n_opt)),
                float(np.polyval(coeffs, x_opt)),
                int(group.sum()),
            )
        )
    if not parabolas:
        raise ScalingDataError(
            "Approach 2: no budget has a usable IsoFLOP parabola (" + "; ".join(skipped) + "); "
            f"train at least {MIN_SIZES} sizes per compute budget, bracketing the optimum"
        )
    n_law = d_law = None
    if len(parabolas) >= 2:
        c = np.array([p.budget for p in parabolas])
        n_law = _power_law(c, np.array([p.n_opt for p in parabolas]))
        d_law = _power_law(c, np.array([p.d_opt for p in parabolas]))
    return IsoFlopFit(parabolas, n_law, d_law, skipped)


def _power_law(c: np.ndarray, y: np.ndarray) -> PowerLaw:
    slope, intercept = np.polyfit(np.log(c), np.log(y), 1)
    return PowerLaw(float(slope), float(np.exp(intercept)))
