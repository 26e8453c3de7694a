"""The loss-curve law: a schedule's areas, a fit that recovers a known law from noisy curves of several sizes and
predicts a new size's curve under a schedule it never saw, and curves anchored to a point law."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from evaluation.chinchilla_fit import Law
from evaluation.loss_curve import (
    Anchor,
    CurveLaw,
    CurvePoints,
    Schedule,
    curve_points,
    fit_curve_law,
    seed_spread,
)
from evaluation.scaling_data import ScalingPoints
from training.config import OptimConfig

TRUTH = CurveLaw(E=2.0, A=2000.0, B=0.75, alpha=0.8, beta=0.57, D=0.2, C=0.13)  # near the demo sweep's fit
PER_STEP = 2048


def wsd(steps: int, decay: float = 0.2) -> OptimConfig:
    return OptimConfig(lr=8e-3, schedule="wsd", decay_fraction=decay, warmup_steps=20, min_lr_ratio=0.1)


def test_a_constant_rate_sweeps_its_tokens_and_no_drop() -> None:
    s1, annealing = Schedule.of(OptimConfig(lr=1e-3, schedule="constant", warmup_steps=0), 50, 2048).at(
        [10, 50]
    )
    assert s1.tolist() == pytest.approx([10 * 2048, 50 * 2048])
    assert annealing.drop.size == 0


def test_a_drop_counts_from_its_step_with_the_rate_area_swept_since() -> None:
    rates = np.array([1.0, 1.0, 0.5, 0.5, 0.5])  # one drop of 0.5 at step 2 (0-based), no warmup
    s1, annealing = Schedule(rates, tokens_per_step=10.0, warmup=0).at([2, 5])
    assert s1.tolist() == pytest.approx([20, 35])
    assert annealing.point.tolist() == [1]  # after 2 steps the drop has not happened yet
    assert (annealing.drop[0], annealing.rate[0], annealing.area[0]) == pytest.approx((0.5, 0.5, 1.5))
    # its gain grows with the area towards D times the drop
    law = CurveLaw(E=1.0, A=0.0, B=0.0, alpha=1.0, beta=1.0, D=0.4, C=1.0)
    x = 1.5 / 0.5**0.5
    assert law.loss(1.0, s1, annealing).tolist() == pytest.approx([1.0, 1.0 - 0.4 * 0.5 * x / (1 + x)])


def synthetic_run(n: float, steps: int, horizons: list[int], rng: np.random.Generator) -> CurvePoints:
    """A multi-horizon WSD run like a sweep's: 8 validation losses along the run plus a decayed branch per horizon,
    each with 0.5% noise."""
    schedules = {h: Schedule.of(wsd(h), h, PER_STEP) for h in [steps, *horizons]}
    every = -(-steps // 8)
    keys = [(s, steps) for s in [*range(every, steps, every), steps]] + [(h, h) for h in horizons]
    losses = {}
    for step, h in keys:
        losses[(step, h)] = float(TRUTH.curve(n, schedules[h], [step])[0] * np.exp(rng.normal(0, 0.005)))
    return curve_points(
        n, losses, schedules, lambda s: Schedule.ending(wsd(s), s, PER_STEP), name=f"run-{n:g}"
    )


def test_the_fit_recovers_a_known_law_and_predicts_another_size_and_schedule() -> None:
    rng = np.random.default_rng(0)
    runs = [synthetic_run(n, 1600, [400, 800], rng) for n in (1e4, 3e4, 6e4, 1.2e5, 2.4e5)]
    points = CurvePoints.concat(runs)
    fit = fit_curve_law(points)
    one = points.subset(points.run == 2)  # a run taken back out has its own drops, not its neighbours'
    assert (
        TRUTH.loss(one.n, one.s1, one.annealing).tolist()
        == TRUTH.loss(6e4, runs[2].s1, runs[2].annealing).tolist()
    )
    assert fit.n_points == 5 * 10 and fit.n_runs == 5
    assert pytest.approx(TRUTH.D * 0.9, abs=0.03) == fit.law.D * 0.9  # the gain of a full decay, in nats
    assert fit.rel_errors.mean() < 0.006  # the noise, not a misfit
    # a size between the swept ones, trained twice as long under a schedule none of them used
    cosine = OptimConfig(lr=8e-3, schedule="cosine", warmup_steps=20, min_lr_ratio=0.1)
    schedule, steps = Schedule.of(cosine, 3200, 2048), list(range(200, 3201, 100))
    predicted, true = fit.law.curve(8e4, schedule, steps), TRUTH.curve(8e4, schedule, steps)
    assert np.abs(predicted / true - 1).max() < 0.01


def test_the_laws_derivatives_are_its_slopes() -> None:
    """The fit's analytic Jacobian (each of the seven parameters, the decay's gain among them) against central
    differences of the log loss, on a multi-horizon run's points."""
    run = synthetic_run(3e4, 1600, [400, 800], np.random.default_rng(1))
    theta = np.log([TRUTH.E, TRUTH.A, 1.0, TRUTH.B, 1.0, TRUTH.D, TRUTH.C])
    theta[2], theta[4] = TRUTH.alpha, TRUTH.beta

    def log_loss(t: np.ndarray) -> np.ndarray:
        return np.log(CurveLaw.from_theta(t).loss(run.n, run.s1, run.annealing))

    numeric = np.stack([(log_loss(theta + h) - log_loss(theta - h)) / 2e-6 for h in 1e-6 * np.eye(7)], axis=1)
    got = CurveLaw.from_theta(theta).log_jacobian(run.n, run.s1, run.annealing)
    assert got == pytest.approx(numeric, rel=1e-5, abs=1e-9)
    assert np.abs(got[:, 6]).max() > 1e-3  # the decays' gain moves with C at these points


def test_a_trial_step_past_a_floats_range_is_an_infinite_law_not_an_error() -> None:
    """least_squares shrinks its step where the residuals are not finite; an OverflowError from the parameters'
    logs ended a bf16 smoke pipeline's fit stage in a traceback."""
    far = CurveLaw.from_theta(np.array([0.7, 800.0, 0.8, -0.3, 0.57, -1.6, -2.0]))  # log A = 800
    assert np.isinf(far.A) and pytest.approx(np.exp(0.7)) == far.E
    assert not np.isfinite(far.curve(1e4, Schedule.of(wsd(800), 800, PER_STEP), [400])).any()


def test_a_law_needs_runs_of_two_sizes() -> None:
    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="2 or more sizes"):
        fit_curve_law(CurvePoints.concat([synthetic_run(1e4, 800, [200, 400], rng)]))


def test_the_band_is_how_far_held_out_runs_landed() -> None:
    rng = np.random.default_rng(2)
    runs = [synthetic_run(n, 1600, [400, 800], rng) for n in (1e4, 3e4, 6e4, 1.2e5, 2.4e5)]
    assert fit_curve_law(CurvePoints.concat(runs)).band < 0.015  # the 0.5% noise, and the law's extrapolation
    shifted = CurvePoints.concat([*runs[:2], replace(runs[2], loss=runs[2].loss * 1.05), *runs[3:]])
    fit = fit_curve_law(shifted)
    assert fit.band > 0.04  # a run 5% off the law is 5% off when it is held out
    assert fit.rel_errors.mean() < fit.held_out.mean()


def test_a_decayed_point_is_its_own_reference_and_a_stable_one_is_above_its_reference() -> None:
    """A point anchored to its reference's loss: a decay branch's end or the run's end is that loss itself; a
    point of the stable phase lies above it by the annealing gain it has not had."""
    run = synthetic_run(3e4, 1600, [400, 800], np.random.default_rng(3))
    gap = TRUTH.anchored(run, np.zeros(len(run)))
    ends = [0, 1, len(run) - 1]  # the branches' ends (400, 800), then the run's evaluations, the last its end
    assert run.step[ends].tolist() == [400, 800, 1600]
    assert gap[ends] == pytest.approx(0.0, abs=1e-12)
    stable = run.step[2:] < 1280  # the run's evaluations before its decay, 400 and 800 among them
    assert stable.sum() == 6 and (gap[2:][stable] > 0.01).all()  # ~0.1 nats above a run decayed there
    # anchored to the losses of runs that end there, decayed, the true law gives each point's own loss back
    decayed = [TRUTH.curve(3e4, Schedule.of(wsd(s), int(s), PER_STEP), [int(s)])[0] for s in run.step]
    own = TRUTH.loss(run.n, run.s1, run.annealing)
    assert TRUTH.anchored(run, np.array(decayed)) == pytest.approx(own, rel=1e-12)


def test_an_anchored_curve_is_a_run_decayed_there_plus_what_its_schedule_adds() -> None:
    """At step 800 of a 1,600-step run, its loss is that of an 800-step run (decayed, warmup as the run's)
    plus the curve law's difference between the two schedules: for the true law, exactly its own loss."""
    n, optim = 6e4, wsd(1600)
    long, short = Schedule.of(optim, 1600, PER_STEP), Schedule.of(optim, 800, PER_STEP)
    decayed = TRUTH.curve(n, short, [800])
    reference = lambda s: Schedule.ending(optim, s, PER_STEP)  # noqa: E731
    assert decayed + TRUTH.difference(n, long, [800], reference) == pytest.approx(TRUTH.curve(n, long, [800]))
    # a reference with a longer warmup than the run's is a worse run: the run's own loss sits further below it
    slow = lambda s: Schedule.ending(optim, s, PER_STEP, warmup=300)  # noqa: E731
    assert TRUTH.difference(n, long, [800], slow)[0] < TRUTH.difference(n, long, [800], reference)[0] - 0.01


def decayed_points(runs: list[CurvePoints], scale: float = 1.0) -> ScalingPoints:
    """The decayed points of `runs` (branch ends and run ends) as a point law's table, losses times `scale`."""
    n, d, loss, name = [], [], [], []
    for r in runs:
        ends = r.ref_s1 == r.s1  # a point whose schedule is its reference's: decayed there
        n += r.n[ends].tolist()
        d += r.tokens[ends].tolist()
        loss += (r.loss[ends] * scale).tolist()
        name += [r.runs[0]] * int(ends.sum())
    n, d = np.array(n), np.array(d)
    return ScalingPoints(n, d, np.array(loss), 6 * n * d, n, run=np.array(name))


def test_held_out_runs_are_scored_against_the_point_law_refitted_without_them() -> None:
    """With an anchor, a held-out run's curve is its point law's decayed losses (refitted without the run) plus
    the curve law's gaps: a point law that is right keeps the inner runs near the noise, one 5% off shows as 5%
    (the outer runs are the point law's extrapolation from 12 points, 5-7% off here)."""
    rng = np.random.default_rng(2)
    runs = [synthetic_run(n, 1600, [400, 800], rng) for n in (1e4, 3e4, 6e4, 1.2e5, 2.4e5)]
    points = CurvePoints.concat(runs)
    law = Law(E=2.0, A=2000.0, B=0.75 * 1e6**0.57, alpha=0.8, beta=0.57)  # TRUTH's size and data terms
    for scale, low, high in ((1.0, 0.0, 0.02), (1.05, 0.04, 0.07)):
        anchor = Anchor.chinchilla(decayed_points(runs, scale), law, delta=1e-3)
        inner = fit_curve_law(points, anchor=anchor).held_out.reshape(len(runs), -1)[1:-1]
        assert low < inner.mean() and inner.max() < high


def test_the_seed_spread_is_how_far_one_replica_strays_from_their_mean() -> None:
    """Two replicas of a size (the second 2% above the first from step 800 on) stray from their mean by 1% each,
    √2 × 1% as an estimate for a new seed; a size run once has no spread."""
    rng = np.random.default_rng(4)
    first, lone = synthetic_run(3e4, 1600, [400, 800], rng), synthetic_run(6e4, 1600, [400, 800], rng)
    second = replace(first, loss=np.where(first.step >= 800, first.loss * 1.02, first.loss))
    spread = seed_spread(CurvePoints.concat([first, lone, second]))
    assert spread.tolist() == pytest.approx([0.02 / 2.02 * 2**0.5] * 2)
    assert seed_spread(CurvePoints.concat([first, lone])).size == 0
