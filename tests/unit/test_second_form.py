"""Kaplan's form beside Chinchilla's: the fit recovers a known law; the form closer on the held-out budget sizes
the rung and predicts it, the other's prediction is written beside before it trains, checked after and reported."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evaluation.kaplan_fit import KaplanLaw, fit_kaplan, kaplan_intervals
from evaluation.law_form import choose_form, heldout_gap
from evaluation.law_noise import NoiseModel
from evaluation.scaling_data import ScalingPoints
from evaluation.scaling_report import (
    FLOORLESS,
    FormPrediction,
    Prediction,
    headline,
    precision_goals,
    run_fit_scaling,
    rung_lines,
)
from evaluation.synthetic_ladder import Design, simulate
from flows.recipe import load_recipe
from flows.scaling import (
    choose_and_size,
    fit_sweep,
    form_predictions,
    kaplan_form,
    nearest_shapes,
    rung_size,
    second_form_metric,
    sweep_points,
    target_budget,
    task_prediction,
)
from tests.unit.test_law_intervals import DEMO
from tests.unit.test_sweep_plan import sweep_of
from training.sizing import count_n, sized_model

TRUE = KaplanLaw(n_c=3e4, d_c=2e6, alpha_n=0.25, alpha_d=0.3, E=1.2)


def points(law, noise: float = 0.0, seed: int = 0) -> ScalingPoints:
    """An IsoFLOP design like the demo's: 7 sizes at 3 budgets, with lognormal noise."""
    rng = np.random.default_rng(seed)
    n = np.tile(np.geomspace(1.2e4, 2e5, 7), 3)
    c = np.repeat([2e11, 4e11, 8e11], 7)
    d = c / (6 * n)
    loss = law.loss(n, d) * np.exp(rng.normal(0.0, noise, n.size))
    return ScalingPoints(n, d, loss, c, n.copy(), source="synthetic")


def test_the_law_is_kaplans_formula():
    n, d = 5e4, 3e6
    want = TRUE.E + ((TRUE.n_c / n) ** (TRUE.alpha_n / TRUE.alpha_d) + TRUE.d_c / d) ** TRUE.alpha_d
    assert float(TRUE.loss(n, d)) == pytest.approx(want, rel=1e-12)


def test_the_compute_optimal_size_minimises_the_law_along_an_isoflop_curve():
    c = 2.4e12
    n = np.geomspace(1e3, 1e8, 200001)
    best = n[np.argmin(TRUE.loss(n, c / (6 * n)))]
    assert float(TRUE.optimal_n(c)) == pytest.approx(best, rel=1e-3)


def test_a_runaway_laws_optimum_is_infinite_not_an_exception():
    """A bootstrap resample of a tiny sweep (the e2e pipeline's) can fit n_c^p past a float's range: N* comes out
    of logs (an inf where it is one, left out of the intervals), not an OverflowError that failed the pipeline."""
    runaway = KaplanLaw(n_c=1e300, d_c=1.0, alpha_n=5.0, alpha_d=0.1, E=1.0)
    p = 50.0
    want = np.exp((np.log(p) + p * np.log(1e300) + np.log(1e12 / 6.0)) / (p + 1.0))
    assert float(runaway.optimal_n(1e12)) == pytest.approx(want, rel=1e-9)
    tiny = points(TRUE, noise=0.05)
    tiny = ScalingPoints(tiny.n[::3], tiny.d[::3], tiny.loss[::3], tiny.c[::3], tiny.n_total[::3])
    got = kaplan_intervals(tiny, fit_kaplan(tiny, starts=8), 1e5, 4e6, 2.4e12, n_resamples=40)
    assert got.n + got.n_failed == 40 and np.isfinite(got.n_opt).all()


def test_a_law_whose_floor_underflows_keeps_a_loss_and_a_log():
    """A bootstrap resample of the e2e pipeline's tiny sweep (500 of them at its rung) refitted E past e^-745: 0.0,
    whose log raised ("math domain error") in the resample's `loss` and failed the pipeline."""
    law = KaplanLaw.from_theta(np.array([np.log(3e4), np.log(2e6), 0.25, 0.3, -800.0]))
    assert law.E > 0 and np.isfinite(law.theta()).all()
    assert np.isfinite(law.loss(1e5, 1e7)) and np.isfinite(float(KaplanLaw.from_theta(np.full(5, 900.0)).n_c))


def test_the_laws_derivatives_are_its_slopes():
    from evaluation.kaplan_fit import _log_jacobian, _log_loss

    theta, n, d = TRUE.theta(), np.geomspace(1e4, 3e5, 6), np.geomspace(3e5, 3e7, 6)
    step = 1e-6 * np.eye(5)
    numeric = [(_log_loss(theta + h, n, d) - _log_loss(theta - h, n, d)) / 2e-6 for h in step]
    assert _log_jacobian(theta, n, d) == pytest.approx(np.stack(numeric, axis=1), rel=1e-6, abs=1e-9)


def test_a_resample_is_refitted_as_the_sweep_was_even_from_a_law_without_a_floor():
    """At E → 0 (the demo's sweeps) the gradient in log E vanishes: refitted from the sweep's law alone, every
    resample kept E ≈ 0 and the exponents' intervals came out ~8x too narrow. Each refit now reaches the objective
    that many random starts reach."""
    from evaluation.kaplan_fit import ROBUST_SCALE, _log_loss, _refits

    def objective(law: KaplanLaw, y: np.ndarray) -> float:
        z = (_log_loss(law.theta(), table.n, table.d) - y) / ROBUST_SCALE
        return float(np.sum(np.sqrt(1 + z**2) - 1))

    floorless = KaplanLaw(n_c=2.6e6, d_c=1.75e7, alpha_n=0.22, alpha_d=0.31, E=1e-10)
    table, rng = points(floorless), np.random.default_rng(0)
    ys = np.log(table.loss) + rng.normal(0.0, 0.012, (4, len(table)))
    moved = 0
    for got, y in zip(_refits(table, ys, floorless.theta()), ys, strict=True):
        best = fit_kaplan(replace(table, loss=np.exp(y)), starts=30)
        assert objective(got, y) <= objective(best, y) + 1e-6
        moved += got.E > 0.01
    assert moved >= 2  # most resamples' optimum has a floor the sweep's law did not


def test_a_known_kaplan_law_is_recovered_from_its_points():
    got = fit_kaplan(points(TRUE))
    probe_n, probe_d = (
        np.array([1e5, 3e5]),
        np.array([1e7, 3e7]),
    )  # beyond the points: 2-10x the largest budget
    assert got.loss(probe_n, probe_d) == pytest.approx(TRUE.loss(probe_n, probe_d), rel=2e-3)


def test_a_start_whose_loss_is_not_finite_is_skipped(monkeypatch):
    import evaluation.kaplan_fit as kaplan_fit

    # the first start (the fixed one) overflows: α_D ~ 0 puts N_c/N under an exponent of 1e9
    monkeypatch.setattr(kaplan_fit, "START", np.array([np.log(1e6), np.log(1e6), 0.7, 1e-9, 0.5]))
    got = fit_kaplan(points(TRUE), starts=20)
    assert got.loss(1e5, 1e7) == pytest.approx(float(TRUE.loss(1e5, 1e7)), rel=0.02)


def test_the_rung_gets_a_second_prediction_checked_and_reported(tmp_path):
    table = points(TRUE, noise=0.005)
    fit = run_fit_scaling(table, tmp_path, target_budget=2.4e12, n_bootstrap=50, plots=False, write=False)
    law, heldout = kaplan_form(table)
    errors = {"chinchilla": fit.holdout["mean_rel_error"], "kaplan": float(heldout.mean())}
    forms = form_predictions(table, fit, law, errors, 1e5, 4e6, tmp_path)
    second, chinchilla = forms["kaplan"], forms["chinchilla"]
    assert chinchilla.loss == pytest.approx(float(fit.to_law().loss(1e5, 4e6)))
    assert chinchilla.n_opt == fit.optimal.n_opt and chinchilla.exponents["alpha"] == fit.intervals["alpha"]
    assert chinchilla.heldout_mean_rel_error == fit.holdout["mean_rel_error"]
    assert second.loss == pytest.approx(float(TRUE.loss(1e5, 4e6)), rel=0.02)
    assert second.n_opt == pytest.approx(float(TRUE.optimal_n(2.4e12)), rel=0.1)
    assert 0 < second.heldout_mean_rel_error < 0.02  # the true form, fitted without the largest budget
    lo, hi = second.exponents["alpha_d"]
    assert lo < TRUE.alpha_d < hi and set(second.exponents) == {"alpha_n", "alpha_d"}
    rung = Prediction(n=1e5, d=4e6, loss=2.5, interval=(2.4, 2.6), second_form=second).check(2.4, None)
    assert rung.second_form.rel_error == pytest.approx(abs(2.4 - second.loss) / 2.4)
    (line,) = [x for x in rung_lines(rung) if "Kaplan's form" in x]
    assert f"predicted {second.loss:.4f}" in line and f"error {rung.second_form.rel_error:.2%}" in line
    assert f"compute-optimal N at the target {second.n_opt:.3g}" in line
    assert second.floorless is False and FLOORLESS not in line  # a floor at 1.2: the sweep tells it from 0
    floorless = rung.model_copy(update={"second_form": second.model_copy(update={"floorless": True})})
    assert FLOORLESS in [x for x in rung_lines(floorless) if "Kaplan's form" in x][0]
    assert second.interval[0] < second.loss < second.interval[1]
    assert second.run_interval[0] < second.interval[0] and second.interval[1] < second.run_interval[1]
    assert second.n_opt_interval[0] < second.n_opt < second.n_opt_interval[1]
    assert f"law 95% [{second.interval[0]:.4f}, {second.interval[1]:.4f}]" in line
    for chinchillas, apart in (((2.4, 2.6), True), ((second.interval[1] - 0.01, 2.6), False)):
        lines = rung_lines(rung.model_copy(update={"interval": chinchillas}))
        assert ("apart from Chinchilla's" in [x for x in lines if "Kaplan's form" in x][0]) == apart


def test_the_held_out_budget_chooses_the_form_unless_the_recipe_names_one():
    assert choose_form("auto", {"chinchilla": 0.018, "kaplan": 0.017})[0] == "kaplan"
    form, reason = choose_form("auto", {"chinchilla": 0.012, "kaplan": 0.017})
    assert form == "chinchilla" and "1.20% against Kaplan's 1.70%" in reason
    assert choose_form("chinchilla", {"chinchilla": 0.05, "kaplan": 0.01})[0] == "chinchilla"
    assert choose_form("kaplan", {"chinchilla": None, "kaplan": None})[0] == "kaplan"
    assert (
        choose_form("auto", {"chinchilla": 0.05, "kaplan": None})[0] == "chinchilla"
    )  # nothing to choose by


@pytest.mark.parametrize("setting", ["auto", "chinchilla"])
def test_the_chosen_form_sizes_the_rung_and_predicts_it(tmp_path, setting):
    """A sweep drawn from Kaplan's form (so its held-out budget prefers it): with `auto` the rung is sized at
    Kaplan's N* and predicted by it, Chinchilla's prediction beside; told `chinchilla`, the other way round. The
    precision goals then read the chosen form's N* and exponents, and the headline says which form and why."""
    table = points(TRUE, noise=0.003)
    budget = 2.4e12
    fit = run_fit_scaling(table, tmp_path, target_budget=budget, n_bootstrap=60, plots=False, write=False)
    recipe = load_recipe("demo", [f"output_dir={tmp_path}", f"sweep.law_form={setting}"])
    fit, rung, prediction, law = choose_and_size(recipe, table, fit, budget, tmp_path, n_resamples=60)
    other = "chinchilla" if setting == "auto" else "kaplan"
    want = setting if setting != "auto" else "kaplan"
    n_opt = float(law.optimal_n(budget)) if want == "kaplan" else fit.optimal.n_opt
    assert fit.choice.form == prediction.form == want and prediction.second_form.form == other
    assert fit.sizing_n_opt == pytest.approx(n_opt) and (prediction.n, prediction.d) == rung_size(rung)
    assert prediction.n == nearest_shapes(recipe, n_opt)[0][2]  # the shape nearest the chosen form's N*
    assert (
        nearest_shapes(recipe, fit.optimal.n_opt)[0]
        != nearest_shapes(recipe, float(law.optimal_n(budget)))[0]
    )
    chosen_loss = (
        law.loss(prediction.n, prediction.d)
        if want == "kaplan"
        else fit.to_law().loss(prediction.n, prediction.d)
    )
    assert prediction.loss == pytest.approx(float(chosen_loss))
    goals = [what for what, _, _ in precision_goals(fit.model_copy(update={"rung": prediction}))]
    exponents = ["alpha_n", "alpha_d"] if want == "kaplan" else ["alpha", "beta"]
    assert goals[:3] == ["N* 95% interval", *(f"{k} 95% interval" for k in exponents)]
    assert f"Law form: {want.capitalize()}'s sizes the rung" in headline(fit)
    assert fit.choice.floorless is (False if want == "kaplan" else None) and FLOORLESS not in headline(fit)
    floorless = fit.model_copy(update={"choice": fit.choice.model_copy(update={"floorless": True})})
    assert FLOORLESS in headline(floorless)


def test_kaplans_intervals_hold_the_true_law_about_as_often_as_they_say():
    """Sweeps drawn from a known law with 1% noise per point: the 95% intervals of the loss at a 3x rung, of N* at
    its budget and of the two exponents (what the precision goals read when this form is chosen) hold the truth in
    most of them (each miss is 5% likely), and narrow with less noise."""
    n, d, budget = 1e5, 4e6, 2.4e12
    truth_loss, truth_n = float(TRUE.loss(n, d)), float(TRUE.optimal_n(budget))
    held = {"loss": 0, "n_opt": 0, "alpha_n": 0, "alpha_d": 0}
    widths = {}
    for seed in range(8):
        for noise in (0.01, 0.0025) if seed == 0 else (0.01,):
            table = points(TRUE, noise=noise, seed=seed)
            got = kaplan_intervals(
                table, fit_kaplan(table, starts=8), n, d, budget, n_resamples=40, seed=seed
            )
            assert got.n == 40 and got.n_failed == 0
            widths[noise] = got.loss[1] - got.loss[0]
            if noise == 0.01:
                held["loss"] += got.loss[0] <= truth_loss <= got.loss[1]
                held["n_opt"] += got.n_opt[0] <= truth_n <= got.n_opt[1]
                for k in ("alpha_n", "alpha_d"):
                    held[k] += got.exponents[k][0] <= getattr(TRUE, k) <= got.exponents[k][1]
    assert min(held.values()) >= 6, held  # P(fewer than 6 of 8 | 95%) = 0.6%
    assert 2 < widths[0.01] / widths[0.0025] < 8  # four times the noise, about four times the width


def test_a_sweep_that_cannot_tell_its_floor_from_0_gets_intervals_spanning_the_law_without_one():
    """A sweep of the demo's design (two seeds, its noise) drawn from a law without a floor (the demo's own Kaplan
    law) whose fit found a floor (E 0.91) and so steeper exponents: E = 0 is not ruled out, and the intervals span
    the floorless law's bootstrap too, holding the true α_N and the rung's loss that the free refits' intervals
    alone, [0.222, 0.532] and [2.2230, 2.3873], missed below. A sweep with a clear floor keeps the free ones."""
    truth = KaplanLaw(n_c=2.609e6, d_c=1.754e7, alpha_n=0.2187, alpha_d=0.313, E=1e-14)
    design = Design(np.tile(DEMO.n, 2), np.tile(DEMO.d, 2), np.r_[DEMO.run, DEMO.run + 7])
    table = simulate(truth, design, NoiseModel(0.0034, 0.0082, cell_sd=0.0088), np.random.default_rng(2))
    law = fit_kaplan(table, starts=8)
    budget = 2.4e12
    n = float(truth.optimal_n(budget))
    got = kaplan_intervals(table, law, n, budget / (6 * n), budget, n_resamples=60, seed=2)
    assert law.E > 0.5 and law.alpha_n > truth.alpha_n + 0.1 and got.floorless
    assert got.exponents["alpha_n"][0] < truth.alpha_n < got.exponents["alpha_n"][1]
    assert got.loss[0] < float(truth.loss(n, budget / (6 * n))) < got.loss[1]
    clear = points(TRUE, noise=0.0025)
    assert not kaplan_intervals(
        clear, fit_kaplan(clear, starts=8), 1e5, 4e6, budget, n_resamples=40
    ).floorless


def test_the_task_loss_is_judged_as_the_loss_is():
    """Inside a run's interval and within 3%: held; outside it, or a law's interval alone in an older fit: judged
    the same way, and the report says which."""
    rung = Prediction(n=1e5, d=4e6, loss=2.5, interval=(2.4, 2.6), task_loss=2.30, task_interval=(2.27, 2.33))
    typed = rung.model_copy(update={"task_run_interval": (2.22, 2.38), "task_form": "kaplan"})
    held = typed.check(2.5, 2.25)
    assert held.task_held and held.task_rel_error == pytest.approx(0.05 / 2.25)
    (line,) = [x for x in rung_lines(held) if "HumanEval" in x]
    assert line.endswith("measured 2.2500 (error 2.22%: the prediction held)") and "by Kaplan's form" in line
    # a task law whose E the sweep cannot tell from 0
    floorless = held.model_copy(update={"task_floorless": True})
    (line,) = [x for x in rung_lines(floorless) if "HumanEval" in x]
    assert line.endswith(f"(error 2.22%: the prediction held); {FLOORLESS}")
    assert not typed.check(2.5, 2.40).task_held  # outside a run's interval
    assert not typed.check(2.5, 2.23).task_held  # inside it, but 3.1% off
    assert not rung.check(2.5, 2.25).task_held  # an older fit: the law's interval, which 2.25 is outside
    assert rung.check(2.5, None).task_held is None


def test_a_prediction_without_a_second_form_reads_as_before():
    rung = Prediction(n=1e5, d=4e6, loss=2.5, interval=(2.4, 2.6)).check(2.45, None)
    assert rung.second_form is None and not any("Kaplan" in x for x in rung_lines(rung))
    assert "Chinchilla's form predicted 2.5000" in rung_lines(rung)[0]
    assert FormPrediction(form="kaplan", law={}, loss=2.0).check(2.5).rel_error == pytest.approx(0.2)


def test_mlflow_gets_the_second_forms_numbers_when_there_are_some():
    second = FormPrediction(form="kaplan", law={}, loss=2.0)
    rung = Prediction(n=1e5, d=4e6, loss=2.5, interval=(2.4, 2.6), second_form=second)
    assert second_form_metric(rung, "predicted_loss", "loss") == {"fit/rung_kaplan_predicted_loss": 2.0}
    assert second_form_metric(rung, "rel_error", "rel_error") == {}  # not trained yet
    checked = rung.check(2.5, None)
    assert second_form_metric(checked, "rel_error", "rel_error") == {"fit/rung_kaplan_rel_error": 0.2}
    assert second_form_metric(rung.model_copy(update={"second_form": None}), "predicted_loss", "loss") == {}


def test_the_choice_says_whether_the_held_out_budget_tells_the_forms_apart():
    """Both forms scored on the same held-out runs: Kaplan's errors lower at every run by 0.5 points is a gap
    beyond the noise; differences that change sign from run to run are within it, and the reason says which."""
    rng = np.random.default_rng(0)
    runs = np.repeat(np.arange(12), 2)
    chinchilla = 0.02 + rng.normal(0.0, 0.004, runs.size)
    better = heldout_gap(chinchilla, chinchilla - 0.005 + rng.normal(0.0, 0.0005, runs.size), runs)
    assert better[0] < better[1] < 0
    alike = heldout_gap(chinchilla, chinchilla + rng.normal(0.0, 0.004, runs.size), runs)
    assert alike[0] < 0 < alike[1]
    errors = {"chinchilla": 0.02, "kaplan": 0.015}
    assert "a gap beyond the held-out runs' noise" in choose_form("auto", errors, better)[1]
    assert "a gap within the held-out runs' noise" in choose_form("auto", errors, alike)[1]


def test_kaplans_intervals_do_not_average_the_laws_misfit_over_seeds():
    """Four seeds of each run: a scatter the seeds share (the law's misfit per size and budget) leaves the law about
    twice as unsure as the same scatter drawn per point, which four seeds average (Kaplan's bootstrap redraws one
    misfit per cell, as Chinchilla's does)."""
    n = np.repeat(np.geomspace(1.2e4, 2e5, 7), 3)
    d = np.tile([2e11, 4e11, 8e11], 7) / (6 * n)
    seeds = 4
    design = Design(np.tile(n, seeds), np.tile(d, seeds), np.repeat(np.arange(7 * seeds), 3))
    widths = {}
    for name, noise in {
        "cell": NoiseModel(0.001, 0.001, cell_sd=0.015),
        "point": NoiseModel(0.001, 0.015),
    }.items():
        table = simulate(TRUE, design, noise, np.random.default_rng(6))
        got = kaplan_intervals(table, fit_kaplan(table, starts=8), 1e5, 4e6, 2.4e12, n_resamples=40)
        widths[name] = got.loss[1] - got.loss[0]
    assert widths["cell"] > 1.4 * widths["point"], widths


def test_the_batched_solver_reaches_scipys_optimum():
    """Every start of every fit runs in one batched Levenberg-Marquardt solve. From the fixed start and 39
    perturbations of it (on noisy sweeps with and without a floor) its best fit is scipy's `least_squares` best with
    the same soft-L1 loss, or lower, and most starts reach it (a start with a negative exponent can end in another
    basin, as scipy's do)."""
    from scipy.optimize import least_squares

    from evaluation.kaplan_fit import ROBUST_SCALE, START, _log_jacobian, _log_loss, _robust_cost, _solve

    def scipys(table: ScalingPoints, y: np.ndarray, start: np.ndarray) -> float:
        with np.errstate(all="ignore"):
            try:
                got = least_squares(
                    lambda t: _log_loss(t, table.n, table.d) - y,
                    start,
                    jac=lambda t: _log_jacobian(t, table.n, table.d),
                    loss="soft_l1",
                    f_scale=ROBUST_SCALE,
                    max_nfev=2000,
                )
            except ValueError:  # a start whose loss is not finite
                return np.inf
        return float(got.cost) if got.success else np.inf

    rng = np.random.default_rng(2)
    floorless = KaplanLaw(n_c=2.6e6, d_c=1.75e7, alpha_n=0.22, alpha_d=0.31, E=1e-10)
    for law in (TRUE, floorless):
        table = points(law, noise=0.015, seed=1)
        y = np.log(table.loss)
        starts = START + np.r_[[np.zeros(5)], rng.normal(0.0, 0.5, (39, 5))]
        x, cost, ok = _solve(table, np.broadcast_to(y, (40, len(table))), starts, 2000)
        best = min(scipys(table, y, start) for start in starts)
        assert np.min(cost[ok]) <= best * (1 + 1e-9)
        assert ok[0] and cost[0] <= best * (1 + 1e-9)  # the fixed start
        assert np.mean(ok & (cost <= best * (1 + 1e-6))) >= 0.6
        assert cost[ok] == pytest.approx(_robust_cost(_log_loss(x[ok], table.n, table.d) - y))


def test_the_task_loss_is_predicted_in_the_form_that_predicts_the_loss():
    """A sweep whose losses follow Kaplan's form with a floor: at a 3x rung its task law in that form holds the
    truth within 1% and inside both intervals; Chinchilla's overshoots it (2.7%), outside its law's interval. On
    the demo the same happened: Chinchilla's task law 4.0% above the rung's HumanEval bits per byte, outside a
    run's interval, Kaplan's 2.2% (`flows.scaling.task_prediction`)."""
    table = points(TRUE, noise=0.005)
    budget = 3 * table.c.max()
    n = float(TRUE.optimal_n(budget))
    d, truth = budget / (6 * n), float(TRUE.loss(n, budget / (6 * n)))
    kaplan = task_prediction(table, "kaplan", n, d, budget, 60)
    assert kaplan.form == "kaplan" and kaplan.loss == pytest.approx(truth, rel=0.01)
    assert kaplan.interval[0] < truth < kaplan.interval[1] and kaplan.run_interval[0] < kaplan.interval[0]
    assert set(kaplan.exponents) == {"alpha_n", "alpha_d"} and kaplan.law == fit_kaplan(table).as_dict()
    chinchilla = task_prediction(table, "chinchilla", n, d, budget, 60)
    assert (
        chinchilla.form == "chinchilla" and chinchilla.loss > truth * 1.02 and chinchilla.interval[0] > truth
    )


def test_the_fit_predicts_the_rungs_task_loss_in_the_chosen_form(tmp_path):
    """`lmforge fit` on a sweep table with the probe's task losses (the demo's shapes, two seeds, Kaplan's form
    chosen): the rung's task loss in fit.json is the task law's in that form, with a run's interval, and the
    report names the form."""
    recipe = load_recipe(
        "demo",
        [
            f"output_dir={tmp_path}",
            "tracking.enabled=false",
            "sweep.law_form=kaplan",
            "sweep.bootstrap_resamples=120",
        ],
    )
    task_law = KaplanLaw(n_c=5e4, d_c=4e6, alpha_n=0.3, alpha_d=0.35, E=1.0)
    rng = np.random.default_rng(4)
    rows = []
    for size in recipe.sweep.all_sizes():
        n = float(count_n(sized_model(recipe.model, size.depth, size.width), recipe.sweep.param_count))
        for seed in (0, 1):
            for c in (2e11, 4e11, 8e11):
                d = c / (6 * n)
                loss, task = (
                    float(law.loss(n, d)) * np.exp(rng.normal(0, 0.004)) for law in (TRUE, task_law)
                )
                row = {"N": n, "N_total": n, "D": d, "C": c, "seed": seed, "loss": loss, "task_loss": task}
                rows.append(row | {"status": "completed"})
    results = tmp_path / "results.parquet"
    pq.write_table(pa.Table.from_pylist(rows), results)
    sweep = sweep_of(results)
    rung = fit_sweep(recipe, sweep, data=None).rung
    budget = target_budget(recipe)
    want = task_prediction(sweep_points(results, "task_loss"), "kaplan", rung.n, rung.d, budget, 30)
    assert rung.form == rung.task_form == "kaplan" and rung.task_floorless is want.floorless is False
    assert (rung.task_loss, rung.task_interval, rung.task_run_interval) == (
        want.loss,
        want.interval,
        want.run_interval,
    )
    assert rung.task_run_interval[0] < float(task_law.loss(rung.n, rung.d)) < rung.task_run_interval[1]
    (line,) = [x for x in rung_lines(rung) if "HumanEval" in x]
    assert "by Kaplan's form" in line and f"a run 95% [{want.run_interval[0]:.4f}" in line
