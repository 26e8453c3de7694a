"""Compute multiplier between two design choices, from one scaling law fitted to each one's IsoFLOP ladder.

Each variant's law (Approach 3, `evaluation/chinchilla_fit.py`) gives its compute-optimal loss
L*(C) = L(N*(C), D*(C)). At a reference budget C_ref, variant B reaches L*_B(C_ref); the compute variant A needs
for the same loss, C_A with L*_A(C_A) = L*_B(C_ref), over C_ref is the multiplier (as OLMo-core's and Marin's
ablations report it): 2.0 means A needs twice B's compute for B's loss (B is the better choice), 0.5 that A
needs half. The interval pairs the two laws' bootstrap resamples (runs drawn with replacement, each refitted);
a resample whose law cannot reach the target loss (it lies below its E) counts as an infinite multiplier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from evaluation.chinchilla_fit import Bootstrap, Law
from evaluation.law_noise import calibrated_fit
from evaluation.scaling_data import ScalingDataError, ScalingPoints

LAW_KEYS = ("E", "A", "B", "alpha", "beta")
# a term of the law that moves the loss by less than this share of it anywhere on a ladder was fitted to nothing
NEGLIGIBLE = 1e-6


def has_frontier(law: Law) -> bool:
    """Positive finite exponents and coefficients: only then does L*(C) exist and fall with C."""
    values = (law.A, law.B, law.alpha, law.beta, law.E)
    return all(math.isfinite(v) for v in values) and min(law.A, law.B, law.alpha, law.beta) > 0


def determines_frontier(law: Law, points: ScalingPoints) -> bool:
    """`has_frontier`, with both terms moving the loss on the ladder's points: a size (or data) term fitted to
    ~0 (A = 3e-9 where bigger models were worse at every budget) makes a frontier that no point measured, its N*
    set by the optimiser's last steps (which differ between machines)."""
    if not has_frontier(law):
        return False
    size = law.A * float(points.n.min()) ** -law.alpha
    data = law.B * float(points.d.min()) ** -law.beta
    return min(size, data) > NEGLIGIBLE * float(points.loss.min())


def optimal_loss(law: Law, c: float | np.ndarray) -> np.ndarray:
    """L*(C): the law's loss at its compute-optimal (N, D) for budget C = 6·N·D."""
    return law.loss(law.optimal_n(c), law.optimal_d(c))


def compute_for_loss(law: Law, loss: float, lo: float = 1e3, hi: float = 1e40) -> float:
    """The budget C with L*(C) = loss (inf when the law never gets there: loss ≤ E)."""
    if loss <= law.E:
        return math.inf
    f = lambda log_c: float(optimal_loss(law, math.exp(log_c))) - loss  # noqa: E731 - decreasing in C
    if f(math.log(lo)) < 0:
        return lo
    if f(math.log(hi)) > 0:
        return math.inf
    return math.exp(brentq(f, math.log(lo), math.log(hi), xtol=1e-10))


def multiplier(law_a: Law, law_b: Law, c_ref: float) -> float:
    """C_A / C_ref where L*_A(C_A) = L*_B(C_ref); NaN when either law has no compute-optimal frontier."""
    if not (has_frontier(law_a) and has_frontier(law_b)):
        return math.nan
    return compute_for_loss(law_a, float(optimal_loss(law_b, c_ref))) / c_ref


@dataclass(frozen=True)
class Comparison:
    """Both laws, their bootstrap resamples, and the multiplier at `c_ref` with its interval."""

    law_a: Law
    law_b: Law
    boot_a: Bootstrap
    boot_b: Bootstrap
    c_ref: float
    multiplier: float
    interval: tuple[float, float]
    n_pairs: int
    level: float

    def as_dict(self) -> dict:
        return {
            "law_a": self.law_a.as_dict(),
            "law_b": self.law_b.as_dict(),
            "c_ref": self.c_ref,
            "loss_a_at_c_ref": float(optimal_loss(self.law_a, self.c_ref)),
            "loss_b_at_c_ref": float(optimal_loss(self.law_b, self.c_ref)),
            "multiplier": self.multiplier,
            "interval": list(self.interval),
            "level": self.level,
            "bootstrap_pairs": self.n_pairs,
        }


def resampled_laws(boot: Bootstrap) -> list[Law]:
    laws = [Law(**{k: float(boot.samples[k][i]) for k in LAW_KEYS}) for i in range(boot.n)]
    return [law for law in laws if has_frontier(law)]


def compare_points(
    points_a: ScalingPoints,
    points_b: ScalingPoints,
    c_ref: float,
    n_bootstrap: int = 1000,
    level: float = 0.95,
) -> Comparison:
    """Fit both ladders as `lmforge fit` does (`calibrated_fit`), then the multiplier of A relative to B at `c_ref`
    with a paired-bootstrap interval (each ladder's resamples drawn from its own noise model)."""
    fit_a = calibrated_fit(points_a, n_resamples=n_bootstrap, seed=0, level=level)
    fit_b = calibrated_fit(points_b, n_resamples=n_bootstrap, seed=1, level=level)
    law_a, law_b = fit_a.fit.law, fit_b.fit.law
    for which, law, points in (("A", law_a, points_a), ("B", law_b, points_b)):
        if not determines_frontier(law, points):
            raise ScalingDataError(
                f"{points.source or which}: the law fitted to variant {which}'s ladder has no compute-optimal "
                f"frontier (A={law.A:.3g}, B={law.B:.3g}, α={law.alpha:.3g}, β={law.beta:.3g}); add sizes or budgets"
            )
    boot_a, boot_b = fit_a.boot, fit_b.boot
    pairs = [
        multiplier(a, b, c_ref) for a, b in zip(resampled_laws(boot_a), resampled_laws(boot_b), strict=False)
    ]
    # nearest-rank percentiles: an infinite multiplier stays infinite instead of poisoning an interpolation
    q = [50 * (1 - level), 50 * (1 + level)]
    lo, hi = np.percentile(np.array(pairs), q, method="nearest") if pairs else (math.nan, math.nan)
    return Comparison(
        law_a,
        law_b,
        boot_a,
        boot_b,
        c_ref,
        multiplier(law_a, law_b, c_ref),
        (float(lo), float(hi)),
        len(pairs),
        level,
    )
