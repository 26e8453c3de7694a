"""Scaling-law fits on synthetic tables: recovery of a known law, Approach 2, and the refusals for bad tables."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from evaluation.chinchilla_fit import (
    Law,
    batched_lbfgs,
    batched_objective,
    bootstrap,
    cell_nnls,
    fit_law,
    projected_starts,
)
from evaluation.isoflop import fit_parabolas
from evaluation.scaling_data import ScalingDataError, ScalingPoints, load_points, points_from_table
from evaluation.scaling_report import (
    CurvePrediction,
    Prediction,
    ScalingFit,
    headline,
    precision_goals,
    run_fit_scaling,
    rung_lines,
)

TRUE = Law(E=1.7, A=400.0, B=1500.0, alpha=0.34, beta=0.30)


def isoflop_points(law: Law, budgets=(1e18, 1e19, 1e20, 1e21), sizes=8, noise=0.005, seed=0) -> ScalingPoints:
    """IsoFLOP design: per budget, `sizes` model sizes around the law's optimum, losses with lognormal noise."""
    rng = np.random.default_rng(seed)
    n = np.concatenate([law.optimal_n(c) * np.geomspace(0.1, 10, sizes) for c in budgets])
    c = np.repeat(budgets, sizes).astype(float)
    d = c / (6 * n)
    loss = law.loss(n, d) * np.exp(rng.normal(0, noise, len(n)))
    return ScalingPoints(n, d, loss, c, n.copy(), source="synthetic")


def test_recovers_known_law_from_noisy_points():
    fit = fit_law(isoflop_points(TRUE))
    got = fit.law
    assert got.alpha == pytest.approx(TRUE.alpha, abs=0.03)
    assert got.beta == pytest.approx(TRUE.beta, abs=0.03)
    assert pytest.approx(TRUE.E, abs=0.05) == got.E
    assert got.a == pytest.approx(TRUE.a, abs=0.03)
    # the compute-optimal size at a 10x larger budget is within 30 % of the truth
    assert float(got.optimal_n(1e22)) == pytest.approx(float(TRUE.optimal_n(1e22)), rel=0.3)


def test_noiseless_points_are_fitted_exactly():
    fit = fit_law(isoflop_points(TRUE, noise=0.0))
    for k, v in TRUE.as_dict().items():
        assert fit.law.as_dict()[k] == pytest.approx(v, rel=1e-3), k


def test_variable_projection_solves_e_a_b_exactly_at_the_true_exponents():
    """With (α, β) on its grid, the best cell is the truth and its NNLS coefficients are E, A, B; off the grid the
    starts still lead the fit to the law."""
    points = isoflop_points(TRUE, noise=0.0)
    best = projected_starts(points, keep=3, exponents=np.array([0.2, 0.30, 0.34, 0.5]))[0]
    assert best == pytest.approx(TRUE.theta(), rel=1e-6)
    starts = projected_starts(points)
    assert len(starts) == 32 and np.all(np.isfinite(starts))
    assert Law.from_theta(starts[0]).alpha == pytest.approx(TRUE.alpha, abs=0.02)


def test_every_cells_nnls_is_scipys():
    """Variable Projection's grid solves its 15,376 small NNLS problems at once (`cell_nnls`); each is scipy's
    `nnls`, with and without coefficients at their bound 0, and where two columns are the same."""
    from scipy.optimize import nnls

    rng = np.random.default_rng(0)
    columns = rng.normal(size=(200, 12, 3)) * np.array([1.0, 10.0, 1e-3])
    columns[:5, :, 2] = columns[:5, :, 1]  # dependent columns
    target = rng.normal(size=12)
    coef, residual = cell_nnls(columns, target)
    for got, res, cols in zip(coef, residual, columns, strict=True):
        want, want_res = nnls(cols, target)
        assert res == pytest.approx(want_res, rel=1e-9)
        if np.linalg.matrix_rank(cols) == 3:
            assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert (coef == 0).any(axis=1).sum() > 50 and (coef > 0).all(axis=1).sum() > 10


def test_optimal_n_minimises_the_law_along_an_isoflop_curve():
    c = 1e21
    n = np.geomspace(1e7, 1e12, 20001)
    best = n[np.argmin(TRUE.loss(n, c / (6 * n)))]
    assert float(TRUE.optimal_n(c)) == pytest.approx(best, rel=1e-3)
    assert float(TRUE.optimal_n(c) * TRUE.optimal_d(c)) * 6 == pytest.approx(c)


def test_batched_objective_gradient_matches_finite_differences():
    pts = isoflop_points(TRUE)
    args = (np.log(pts.n), np.log(pts.d), np.log(pts.loss), np.ones(len(pts)), 1e-2)
    theta = np.array([[5.5, 7.0, 0.4, 0.3, 0.28]])
    _, grad = batched_objective(theta, *args)
    eps = 1e-6
    for i in range(5):
        step = np.zeros_like(theta)
        step[0, i] = eps
        fd = (batched_objective(theta + step, *args)[0] - batched_objective(theta - step, *args)[0]) / (
            2 * eps
        )
        assert grad[0, i] == pytest.approx(fd[0], rel=1e-4, abs=1e-6)


def test_batched_lbfgs_solves_independent_quadratics():
    centres = np.array([[1.0, -2.0], [3.0, 0.5], [-1.0, 4.0]])

    def fun(x, rows):
        diff = x - centres[rows]
        return (diff**2 * [1.0, 10.0]).sum(1), 2 * diff * [1.0, 10.0]

    x, f, converged = batched_lbfgs(fun, np.zeros((3, 2)), gtol=1e-10)
    np.testing.assert_allclose(x, centres, atol=1e-8)
    assert converged.all()


def test_bootstrap_intervals_cover_the_truth():
    pts = isoflop_points(TRUE, noise=0.01, seed=3)
    fit = fit_law(pts)
    boot = bootstrap(pts, fit.law, n_resamples=300)
    for name in ("alpha", "beta", "E"):
        lo, hi = boot.interval(name)
        assert lo < TRUE.as_dict()[name] < hi, (name, lo, hi)
        assert lo < fit.law.as_dict()[name] < hi


def test_approach2_recovers_optimal_size_exponent():
    iso = fit_parabolas(isoflop_points(TRUE, sizes=9, noise=0.0))
    assert len(iso.parabolas) == 4 and not iso.skipped
    # a parabola in log N only approximates the law's IsoFLOP curve, so allow a few percent
    assert iso.n_opt.exponent == pytest.approx(TRUE.a, abs=0.03)
    assert iso.d_opt.exponent == pytest.approx(TRUE.b, abs=0.03)


def test_run_fit_scaling_writes_fit_json_and_plots(tmp_path):
    pts = isoflop_points(TRUE, noise=0.003)
    table = pa.table({"N": pts.n, "D": pts.d, "loss": pts.loss})
    csv = tmp_path / "runs.csv"
    pacsv.write_csv(table, csv)
    fit = run_fit_scaling(csv, tmp_path / "fit", target_budget=1e22, n_bootstrap=200)
    saved = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert saved["law"]["alpha"] == pytest.approx(fit.law["alpha"])
    assert saved["optimal"]["budget"] == 1e22
    assert saved["holdout"]["n_test"] == 8 and saved["holdout"]["mean_rel_error"] < 0.02
    # the noise the fit measured (0.3% per point, one point per run) and the Huber threshold scaled to it
    assert saved["interval_method"] == "noise" and saved["noise"]["run_sd"] == 0
    assert saved["noise"]["point_sd"] == pytest.approx(0.003, rel=0.3)
    assert saved["huber_delta"] == pytest.approx(1.345 * saved["noise"]["point_sd"], rel=0.2)
    assert saved["holdout"]["inside_interval"] >= 7 / 8  # each held-out run inside its prediction interval
    read_back = ScalingFit.read(tmp_path / "fit").noise_model()  # an unknown-free variance's df is inf (null)
    assert read_back.run_df == math.inf and read_back.point_sd == saved["noise"]["point_sd"]
    for name in ("isoflop.png", "contours.png", "residuals.png"):
        assert (tmp_path / "fit" / name).read_bytes()[:4] == b"\x89PNG"
    assert "warning" not in headline(fit)  # a well-identified law
    loose = fit.model_copy(
        update={
            "law": {**fit.law, "E": 0.0},
            "intervals": {**fit.intervals, "E": [0.0, 0.0], "alpha": [0.05, 1.1]},
        }
    )
    text = headline(loose)
    assert "warning: E=0 sits at its bound" in text
    assert "warning: alpha's 95% interval [0.05, 1.1] spans more than 3x" in text and "beta's" not in text
    # the precision goals, each judged: this sweep's exponents are pinned (0.3% noise), the loose one's alpha not
    goals = {what: ok for what, _, ok in precision_goals(fit)}
    assert goals["alpha 95% interval"] and goals["beta 95% interval"]
    assert not {what: ok for what, _, ok in precision_goals(loose)}["alpha 95% interval"]
    lo, hi = fit.optimal.n_opt_interval
    assert goals["N* 95% interval"] == (hi / lo <= 1.5) and "Precision goals:" in headline(fit)
    curve = CurvePrediction(steps=[10, 20], tokens=[1e5, 2e5], loss=[3.0, 2.0], schedules={"as planned": 2.0})
    rung = Prediction(n=1e5, d=2e6, loss=2.0, interval=(1.95, 2.05), curve=curve)
    checked = fit.model_copy(update={"rung": rung.check(2.01, None, {10: 2.94, 20: 2.01})})
    goals = {what: (value, ok) for what, value, ok in precision_goals(checked)}
    assert goals["rung's law interval"] == ("±2.5% (goal ±3%)", True)
    assert goals["rung's loss"] == ("0.50% off (goal ≤ 1%)", True)
    assert goals["rung's curve"] == ("max 2.04% off (goal ≤ 1.5%)", False)  # 3.0 predicted, 2.94 measured
    # the summary's curve line: the error beside one seed's spread, and what the curve is anchored to
    anchored = curve.model_copy(update={"seed_spread": 0.0105, "curve_law_end": 2.07, "reference_warmup": 60})
    lines = rung_lines(rung.model_copy(update={"curve": anchored}).check(2.01, None, {10: 2.94, 20: 2.01}))
    (line,) = [x for x in lines if "Validation curve" in x]
    assert "max error 2.04%" in line and "one seed's curve strays 1.05% from its seeds' mean" in line
    assert (
        "anchored to the point law (its runs warm up for 60 steps); the curve law alone ends at 2.0700"
        in line
    )


# ---- bad input ------------------------------------------------------------------------------------------


def _table(**cols) -> pa.Table:
    return pa.table({k: np.asarray(v, dtype=float) for k, v in cols.items()})


def test_fewer_points_than_parameters_is_refused():
    pts = points_from_table(_table(N=[1e8, 2e8, 4e8, 8e8], D=[1e9, 2e9, 1e9, 3e9], loss=[3.0, 2.9, 2.8, 2.7]))
    with pytest.raises(ScalingDataError, match=r"4 usable runs; a fit of 5 parameters needs at least 6"):
        fit_law(pts)


@pytest.mark.parametrize("column", ["N", "D"])
def test_degenerate_design_is_named(column):
    n = np.full(8, 1e8) if column == "N" else np.geomspace(1e7, 1e9, 8)
    d = np.full(8, 1e10) if column == "D" else np.geomspace(1e9, 1e11, 8)
    pts = points_from_table(_table(N=n, D=d, loss=np.linspace(3, 2.5, 8)))
    with pytest.raises(ScalingDataError, match="degenerate design"):
        fit_law(pts)


def test_non_finite_and_non_positive_losses_are_dropped_with_a_count(tmp_path):
    pts = isoflop_points(TRUE)
    loss = pts.loss.copy()
    loss[[0, 5, 9]] = [np.nan, -1.0, np.inf]
    table = tmp_path / "t.csv"
    pacsv.write_csv(_table(N=pts.n, D=pts.d, loss=loss), table)
    got = load_points(table)
    assert got.dropped == 3 and len(got) == len(pts) - 3
    fit = fit_law(got)
    assert fit.n_points == len(pts) - 3


def test_too_few_left_after_dropping_is_refused():
    pts = points_from_table(
        _table(
            N=np.geomspace(1e7, 1e9, 7), D=np.geomspace(1e9, 1e11, 7), loss=[3, 2.9, np.nan, 0, -2, 2.5, 2.4]
        )
    )
    with pytest.raises(ScalingDataError, match=r"4 usable runs \(3 dropped"):
        fit_law(pts)


def test_budget_with_fewer_than_three_sizes_is_skipped_with_a_reason():
    good = isoflop_points(TRUE, budgets=(1e18, 1e19), sizes=5)
    n = np.concatenate([good.n, [1e8, 2e8]])
    c = np.concatenate([good.c, [1e21, 1e21]])
    pts = ScalingPoints(n, c / (6 * n), TRUE.loss(n, c / (6 * n)), c, n)
    iso = fit_parabolas(pts)
    assert len(iso.parabolas) == 2
    assert iso.skipped == ["budget 1e+21 FLOPs: 2 model size(s), a parabola needs 3"]


def test_no_usable_budget_for_approach2_is_an_error():
    n = np.array([1e8, 2e8, 1e8, 2e8])
    c = np.array([1e19, 1e19, 1e20, 1e20])
    pts = ScalingPoints(n, c / (6 * n), np.array([3.0, 2.9, 2.7, 2.6]), c, n)
    with pytest.raises(ScalingDataError, match="train at least 3 sizes per compute budget"):
        fit_parabolas(pts)


def test_missing_columns_are_named():
    with pytest.raises(ScalingDataError, match="no column for loss"):
        points_from_table(pa.table({"N": [1.0], "D": [2.0], "val": [3.0]}))


def test_flops_column_derives_tokens():
    pts = points_from_table(pa.table({"Model Size": [1e8], "Training FLOP": [6e18], "loss": [3.0]}))
    assert pts.d[0] == pytest.approx(1e10)


@pytest.mark.parametrize("budget", [-5.0, 0.0])
def test_a_non_positive_budget_is_refused_before_anything_is_written(tmp_path, budget):
    pts = isoflop_points(TRUE)
    with pytest.raises(ScalingDataError, match="positive compute budget"):
        run_fit_scaling(pts, tmp_path / "fit", target_budget=budget, n_bootstrap=50)
    assert not (tmp_path / "fit").exists()


@pytest.mark.parametrize("drop", [-1, 32, 40])
def test_drop_highest_must_leave_runs(tmp_path, drop):
    pts = isoflop_points(TRUE)  # 32 runs
    csv = tmp_path / "runs.csv"
    pacsv.write_csv(pa.table({"N": pts.n, "D": pts.d, "loss": pts.loss}), csv)
    with pytest.raises(ScalingDataError, match="--drop-highest"):
        load_points(csv, drop_highest=drop)


def test_a_law_whose_every_bootstrap_refit_ran_off_gets_nan_intervals_not_a_crash() -> None:
    """Seen on a 7-point smoke ladder on one CPU model: the point fit has α ≈ 190 and every resample is dropped;
    the fit, the compute-optimal size and the rung's prediction still come out, with NaN intervals."""
    import math

    import numpy as np

    from evaluation.chinchilla_fit import Bootstrap
    from evaluation.scaling_report import compute_optimal, intervals_at

    empty = {k: np.array([]) for k in ("E", "A", "B", "alpha", "beta", "a", "b")}
    boot = Bootstrap(empty, 0, 0.95, n_diverged=200)
    assert all(math.isnan(v) for pair in boot.intervals().values() for v in pair)
    lo, hi = intervals_at(empty, np.array([1e5]), np.array([1e6]))
    assert math.isnan(lo[0]) and math.isnan(hi[0])
    from evaluation.chinchilla_fit import Law
    from evaluation.scaling_data import ScalingPoints

    n = np.array([1e4, 2e4])
    points = ScalingPoints(n, n * 10, np.array([3.0, 2.9]), 60 * n * n, n)
    optimal = compute_optimal(points, Law(E=1.7, A=400, B=400, alpha=0.3, beta=0.3), empty, 1e18)
    assert (
        optimal.n_opt > 0 and math.isnan(optimal.loss_interval[0]) and math.isnan(optimal.n_opt_interval[1])
    )


def test_a_table_without_usable_rows_or_with_text_losses_is_named(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("N,D,loss\n1000,1e6,nan\n2000,1e6,-1\n")
    with pytest.raises(ScalingDataError, match="no usable runs \\(2 rows dropped"):
        load_points(empty)
    text = tmp_path / "text.csv"
    text.write_text("N,D,loss\n1000,1e6,abc\n2000,1e6,def\n")
    with pytest.raises(ScalingDataError, match="text.csv: column 'loss' is not numeric"):
        load_points(text)
