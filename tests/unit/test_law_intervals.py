"""The scaling fit's intervals, checked against sweeps simulated from a known law: the noise model recovers the
scatter it was given, and the 95% intervals hold the truth about as often as they claim (a small version of
benchmarks/scaling_calibration.py, which runs 200 sweeps per method)."""

from __future__ import annotations

import numpy as np
import pytest

from evaluation.chinchilla_fit import Law, fit_law
from evaluation.law_noise import NoiseModel, calibrated_fit, estimate_noise, prediction_interval
from evaluation.synthetic_ladder import Design, run_trial, scored, simulate

TRUTH = Law(E=1.72, A=2665.0, B=2223.0, alpha=0.815, beta=0.563)
# The demo's sweep (configs/demo.yaml): 7 sizes, each one WSD run with horizons at 2e11, 4e11 and 8e11 FLOPs.
SIZES = [12288, 29696, 43008, 79872, 107520, 139264, 192512]
TOKENS = [
    [2711552, 5427200, 10850304],
    [1122304, 2244608, 4489216],
    [774144, 1550336, 3100672],
    [417792, 835584, 1669120],
    [309248, 620544, 1241088],
    [239616, 478208, 957440],
    [173056, 346112, 692224],
]
DEMO = Design(
    np.repeat(np.array(SIZES, float), 3), np.array(TOKENS, float).ravel(), np.repeat(np.arange(7), 3)
)


def wide_design(runs: int = 40, horizons: int = 4) -> Design:
    n = np.geomspace(1e4, 3e5, runs)
    d = np.outer(np.geomspace(3e6, 1e7, runs)[::-1], 2.0 ** np.arange(horizons)) / 2 ** (horizons - 1)
    return Design(np.repeat(n, horizons), d.ravel(), np.repeat(np.arange(runs), horizons))


def estimates(design: Design, given: NoiseModel, rng: np.random.Generator, sweeps: int) -> list[NoiseModel]:
    """The noise model estimated on `sweeps` sweeps simulated from TRUTH and `given` (each fit started at the truth)."""
    found = []
    for _ in range(sweeps):
        points = simulate(TRUTH, design, given, rng)
        found.append(estimate_noise(points, fit_law(points, starts=TRUTH.theta()).law))
    return found


def test_the_noise_model_recovers_run_offsets_and_point_noise() -> None:
    """Fitted law, residuals, method of moments: on average the two standard deviations come back (within 10%),
    and the degrees of freedom say how well each is pinned (~ runs for the offsets, ~ points for the noise)."""
    found = estimates(wide_design(), NoiseModel(0.03, 0.01), np.random.default_rng(0), 8)
    assert np.sqrt(np.mean([f.run_sd**2 for f in found])) == pytest.approx(0.03, rel=0.1)
    assert np.sqrt(np.mean([f.point_sd**2 for f in found])) == pytest.approx(0.01, rel=0.1)
    assert 20 < np.median([f.run_df for f in found]) < 40  # 40 runs, less what the fit absorbs
    assert 80 < np.median([f.point_df for f in found]) < 125  # 120 within-run degrees of freedom


def seeded(design: Design, seeds: int) -> Design:
    """The design with each run trained under `seeds` seeds (each its own run)."""
    runs = int(design.run.max()) + 1
    return Design(
        np.tile(design.n, seeds),
        np.tile(design.d, seeds),
        np.concatenate([design.run + runs * s for s in range(seeds)]),
    )


def test_the_noise_model_tells_the_laws_misfit_per_cell_from_the_seeds_scatter() -> None:
    """Four seeds of the demo's design, the law missing each (size, budget) cell by 1.2% (the same for every seed),
    runs scattering 1% and points 0.5%: the three come back (within 20% on average). With one seed a cell is one
    run's point, and its misfit is counted as point noise."""
    given, rng = NoiseModel(0.01, 0.005, cell_sd=0.012), np.random.default_rng(4)
    found = estimates(seeded(DEMO, 4), given, rng, 8)
    for name, value in (("cell_sd", 0.012), ("run_sd", 0.01), ("point_sd", 0.005)):
        assert np.sqrt(np.mean([getattr(f, name) ** 2 for f in found])) == pytest.approx(value, rel=0.2), name
    (alone,) = estimates(DEMO, given, rng, 1)
    assert alone.cell_sd == 0 and alone.point_sd > 0


def test_the_noise_model_tells_a_shapes_misfit_from_its_cells() -> None:
    """Four seeds of the demo's design, the law missing each shape by 1.2% at every budget and each (shape, budget)
    by 0.8% more (as on the demo's ten-seed sweep, where the shapes' depths and widths differ), runs scattering 1%
    and points 0.5%: all four come back (within 25% on average; seven shapes pin their variance loosely, with ~4
    degrees of freedom). With one seed a shape is one multi-horizon run, and its misfit is counted as the run's."""
    given, rng = NoiseModel(0.01, 0.005, cell_sd=0.008, shape_sd=0.012), np.random.default_rng(6)
    found = estimates(seeded(DEMO, 4), given, rng, 16)
    for name in ("shape_sd", "cell_sd", "run_sd", "point_sd"):
        rms = np.sqrt(np.mean([getattr(f, name) ** 2 for f in found]))
        assert rms == pytest.approx(getattr(given, name), rel=0.25), name
    assert 2 < np.median([f.shape_df for f in found]) < 7
    (alone,) = estimates(DEMO, given, rng, 1)
    assert alone.shape_sd == 0 and alone.run_sd > 0


def test_with_one_point_per_run_and_shape_all_scatter_is_per_point() -> None:
    design = Design(DEMO.n * (1 + 0.01 * np.arange(len(DEMO.n))), DEMO.d, np.arange(len(DEMO.n)))
    points = simulate(TRUTH, design, NoiseModel(0.0, 0.02), np.random.default_rng(1))
    noise = estimate_noise(points, fit_law(points, starts=TRUTH.theta()).law)
    assert noise.run_sd == 0 and noise.point_df == pytest.approx(len(points) - 5)


def test_the_prediction_interval_adds_a_runs_scatter_to_the_laws() -> None:
    """Inside the swept range, a new run's interval is wider than the law's by about its own scatter; without
    scatter the two agree."""
    points = simulate(TRUTH, DEMO, NoiseModel(0.03, 0.01), np.random.default_rng(2))
    fitted = calibrated_fit(points, n_resamples=400)
    n, d = 43008.0, 3.1e6  # a swept size at its largest budget
    law_lo, law_hi = np.percentile(
        Law(**{k: fitted.boot.samples[k] for k in ("E", "A", "B", "alpha", "beta")}).loss(n, d), [2.5, 97.5]
    )
    known = NoiseModel(fitted.noise.run_sd, fitted.noise.point_sd)  # its scatter taken as exact
    run_lo, run_hi = prediction_interval(fitted.boot.samples, known, n, d)
    assert run_lo < law_lo and run_hi > law_hi
    widened = np.log(run_hi / run_lo) ** 2 - np.log(law_hi / law_lo) ** 2
    assert np.sqrt(widened) / (2 * 1.96) == pytest.approx(known.total_sd, rel=0.35)
    unsure_lo, unsure_hi = prediction_interval(fitted.boot.samples, fitted.noise, n, d)
    assert unsure_lo < run_lo and unsure_hi > run_hi  # ~4 degrees of freedom for the run offsets: wider still
    same = prediction_interval(fitted.boot.samples, NoiseModel(0.0, 0.0), n, d)
    assert same == pytest.approx((law_lo, law_hi), rel=1e-9)


def test_intervals_cover_the_truth_on_simulated_demo_sweeps() -> None:
    """30 sweeps of the demo's design (a 3% run offset shared by a run's three horizons, 1% per point), fitted as
    lmforge fits them: α, N* and the rung's loss (the law's and a new run's) inside their 95% intervals in at
    least 27 of 30 (expected 28.5; intervals that ignore the shared offsets or take the estimated scatter as
    exact cover 85-89% in the 200-sweep benchmark)."""
    rng = np.random.default_rng(3)
    trials = [run_trial(TRUTH, DEMO, NoiseModel(0.03, 0.01), 2.4e12, "noise", rng, 300) for _ in range(30)]
    covered = {q: sum(t.covered[q] for t in trials) for q in trials[0].covered}
    assert min(covered.values()) >= 27, covered


def test_a_miss_says_on_which_side_of_the_interval_the_truth_lay() -> None:
    """Misses all below an interval are a biased estimate (Kaplan's exponents where its E sits at 0: every miss
    of 100 simulated sweeps), not a narrow interval: each trial records the side with the miss."""
    bounds = {"alpha": (0.3, 0.5), "beta": (0.3, 0.5), "n_opt": (1e5, 2e5), "rung_law": (2.2, 2.4)}
    values = {"alpha": 0.25, "beta": 0.55, "n_opt": 1.5e5, "rung_law": 2.1}
    covered, below, width = scored(bounds, values, 2.3)
    assert covered == {"alpha": False, "beta": False, "n_opt": True, "rung_law": False}
    assert below == {"alpha": True, "beta": False, "n_opt": False, "rung_law": True}
    assert width == pytest.approx({"alpha": 0.2, "beta": 0.2, "n_opt": 2.0, "rung_law": 0.2 / 2.3})


def test_more_seeds_do_not_narrow_the_intervals_past_the_laws_misfit() -> None:
    """Sweeps of four seeds each where the law misses every (size, budget) cell by 1.2% (what the demo's ten-seed
    sweep shows): the 95% intervals of α, N* and the rung (the law's and a new run's) still hold the truth in at least
    17 of 20 sweeps. Intervals that took the misfit for seed noise shrink with the seeds and miss: on the ten-seed
    sweep's law and noise (200 simulated sweeps, README) they held α 62%, N* 51% and the rung's law 53% of the time."""
    rng = np.random.default_rng(5)
    design, noise = seeded(DEMO, 4), NoiseModel(0.01, 0.005, cell_sd=0.012)
    trials = [run_trial(TRUTH, design, noise, 2.4e12, "noise", rng, 300) for _ in range(20)]
    covered = {q: sum(t.covered[q] for t in trials) for q in trials[0].covered}
    assert min(covered.values()) >= 17, covered


def test_a_misfit_shared_by_a_shapes_budgets_widens_the_exponents_interval() -> None:
    """The same 1.5% misfit, once shared by each shape at every budget (what depth and width do at equal N) and
    once drawn afresh per (shape, budget): over six four-seed sweeps the median width of α's interval is well over
    1.4x the second's (seven shapes are seven looks at α; 17 cells are more). A bootstrap that redrew a shape's
    misfit per cell gave about the same width to both (0.41 vs 0.40), and held α in 70% of 40 sweeps with a 2%
    shape misfit (87.5% with it)."""
    design, widths = seeded(DEMO, 4), {}
    for shared, noise in (
        ("shape", NoiseModel(0.003, 0.003, shape_sd=0.015)),
        ("cell", NoiseModel(0.003, 0.003, cell_sd=0.015)),
    ):
        rng = np.random.default_rng(8)
        bounds = [
            calibrated_fit(simulate(TRUTH, design, noise, rng), n_resamples=200).boot.interval("alpha")
            for _ in range(6)
        ]
        widths[shared] = float(np.median([hi - lo for lo, hi in bounds]))
    assert widths["shape"] > 1.4 * widths["cell"], widths
