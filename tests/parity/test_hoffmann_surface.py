"""Both fitting approaches on losses drawn from Hoffmann et al.'s published Approach-3 surface (Chinchilla,
Table A3: E 1.69, A 406.4, B 410.7, α 0.34, β 0.28) on an IsoFLOP grid: Approach 2 finds the analytic
compute-optimal size per budget and Approach 3 recovers the surface."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.chinchilla_fit import HOFFMANN, Law, bootstrap, fit_law
from evaluation.isoflop import fit_parabolas
from evaluation.scaling_data import ScalingPoints

pytestmark = pytest.mark.parity

SURFACE = Law(**HOFFMANN)
BUDGETS = (6e18, 3e19, 1e20, 3e20, 1e21)  # the IsoFLOP budgets of Hoffmann et al.'s Figure 3 range


def hoffmann_grid(sizes: int = 9, span: float = 10.0, noise: float = 0.0, seed: int = 0) -> ScalingPoints:
    """Per budget, `sizes` model sizes from N_opt/span to N_opt·span; losses from the surface (× lognormal noise)."""
    rng = np.random.default_rng(seed)
    n = np.concatenate([SURFACE.optimal_n(c) * np.geomspace(1 / span, span, sizes) for c in BUDGETS])
    c = np.repeat(BUDGETS, sizes).astype(float)
    d = c / (6 * n)
    loss = SURFACE.loss(n, d) * np.exp(rng.normal(0.0, noise, len(n)))
    return ScalingPoints(n, d, loss, c, n.copy(), source="hoffmann-surface")


def test_approach2_recovers_the_analytic_optimum_per_budget() -> None:
    iso = fit_parabolas(hoffmann_grid())
    assert len(iso.parabolas) == len(BUDGETS) and not iso.skipped
    for parabola in iso.parabolas:
        assert parabola.n_opt == pytest.approx(float(SURFACE.optimal_n(parabola.budget)), rel=0.05)
    assert iso.n_opt.exponent == pytest.approx(SURFACE.a, abs=1e-3)


def test_approach3_recovers_the_surface() -> None:
    fit = fit_law(hoffmann_grid())
    for name, value in HOFFMANN.items():
        assert fit.law.as_dict()[name] == pytest.approx(value, rel=1e-3), name


def test_approach3_intervals_cover_the_surface_under_noise() -> None:
    """With 1% lognormal noise on every loss, the 95% bootstrap intervals of α, β and N*(10x the largest
    budget) contain the published values."""
    points = hoffmann_grid(noise=0.01, seed=4)
    fit = fit_law(points)
    boot = bootstrap(points, fit.law, n_resamples=400)
    for name in ("alpha", "beta"):
        lo, hi = boot.interval(name)
        assert lo < HOFFMANN[name] < hi, (name, lo, hi)
    target = 10 * max(BUDGETS)
    laws = Law(**{k: boot.samples[k] for k in ("E", "A", "B", "alpha", "beta")})
    lo, hi = np.percentile(laws.optimal_n(target), [2.5, 97.5])
    assert lo < float(SURFACE.optimal_n(target)) < hi
