"""Approach 3 on the Chinchilla runs that Epoch AI extracted (../shared/anchors/chinchilla/), against the
converged optimum and Epoch's bootstrap intervals (Besiroglu et al. 2024)."""

from __future__ import annotations

import time

import pytest

from evaluation.chinchilla_fit import HOFFMANN, Law, bootstrap, fit_law, grid_starts, hoffmann_start
from evaluation.scaling_data import load_points
from tests.conftest import shared_file

pytestmark = pytest.mark.parity

# The converged minimum of the Huber sum (δ = 1e-3) over the 240 runs Epoch keep (this code's output, kept so a
# change of optimiser shows; the independent checks are the published values below).
CONVERGED = {"E": 1.8172, "A": 477.8, "B": 2143.0, "alpha": 0.3473, "beta": 0.3672, "a": 0.514}

# Epoch's published estimates and standard errors (Besiroglu et al. 2024, arXiv 2404.10102, Table 1; printed by
# cell 25 of data_analysis.ipynb in github.com/epoch-research/analyzing-chinchilla at 9225883, "Parameter estimates
# and their standard errors"). Their final fit maximises a likelihood with an extra scale parameter and stops with
# scipy's "precision loss" warning, so it is not the Huber minimum to the last digit.
EPOCH_ESTIMATE = {"A": 482.01, "B": 2085.43, "E": 1.81686, "alpha": 0.34781, "beta": 0.36585}
EPOCH_SE = {"A": 124.52, "B": 1293.28, "E": 0.02566, "alpha": 0.01540, "beta": 0.02060}
# Epoch's 95 % bootstrap intervals (4000 resamples), from cell 26 of the same notebook, also Table 1 of the paper.
EPOCH_CI = {
    "A": (285.214, 743.626),
    "B": (1042.357, 5810.344),
    "E": (1.769, 1.871),
    "alpha": (0.317, 0.373),
    "beta": (0.331, 0.415),
}


@pytest.fixture(scope="module")
def runs():
    points = load_points(shared_file("anchors/chinchilla/svg_extracted_data.csv"), drop_highest=5)
    assert len(points) == 240 and points.dropped == 5
    return points


def assert_converged(law: Law) -> None:
    got = law.as_dict()
    for name, want in CONVERGED.items():
        assert got[name] == pytest.approx(want, rel=2e-4), (name, got[name])


def test_variable_projection_and_hoffmanns_grid_reach_the_converged_optimum(runs):
    """The default starts (Variable Projection over α, β) and Hoffmann et al.'s 4,500-point grid over all five
    parameters find the same minimum."""
    for starts in (None, grid_starts()):
        t0 = time.perf_counter()
        fit = fit_law(runs, starts=starts)
        assert fit.n_starts == (4500 if starts is not None else 32)
        assert_converged(fit.law)
        print(f"{fit.n_starts}-start fit: {time.perf_counter() - t0:.1f} s, objective {fit.objective:.10f}")


def test_single_start_from_hoffmanns_values_reaches_the_same_optimum(runs):
    single = fit_law(runs, starts=hoffmann_start())
    assert_converged(single.law)
    # and it did not stop at Hoffmann's own values, which are far from this data's optimum
    assert abs(single.law.alpha - HOFFMANN["alpha"]) > 1e-3


def test_fit_matches_epochs_published_estimates(runs):
    """Within 0.1 of Epoch's standard error for every parameter: the two optimisers' leftover disagreement
    (measured 0.01-0.06 SE) is noise next to the data's uncertainty, while a wrong fit is not (Hoffmann's own
    β = 0.28 is 4 SE away; α off by 0.002, a 0.5 % change, already fails)."""
    got = fit_law(runs, starts=hoffmann_start()).law.as_dict()
    for name, want in EPOCH_ESTIMATE.items():
        assert abs(got[name] - want) <= 0.1 * EPOCH_SE[name], (name, got[name], want)


def test_bootstrap_intervals_are_comparable_to_epochs(runs):
    law = fit_law(runs, starts=hoffmann_start()).law
    boot = bootstrap(runs, law, n_resamples=4000, seed=0)
    for name, (lo, hi) in EPOCH_CI.items():
        got_lo, got_hi = boot.interval(name)
        width = hi - lo
        # each end within 5 % of Epoch's interval width (measured: at most 4.5 % over seeds 0-2). The Monte-Carlo
        # error of a 2.5 % quantile at 4000 draws is ~1.1 % of a 95 % interval's width, so two independent
        # 4000-draw bootstraps differ by ~1.6 % (1 SD): 5 % is three of those.
        assert got_lo == pytest.approx(lo, abs=0.05 * width), (name, got_lo, lo)
        assert got_hi == pytest.approx(hi, abs=0.05 * width), (name, got_hi, hi)
