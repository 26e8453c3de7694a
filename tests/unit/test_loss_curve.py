"""The loss-curve law: a schedule's areas, and a fit that recovers a known law from noisy curves of several sizes
and predicts a new size's curve under a schedule it never saw."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from evaluation.loss_curve import CurveLaw, CurvePoints, Schedule, curve_points, fit_curve_law
from training.config import OptimConfig

TRUTH = CurveLaw(E=2.0, A=2000.0, B=0.75, alpha=0.8, beta=0.57, D=0.2, C=0.13)  # near the demo sweep's fit


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
    per_step = 2048
    schedules = {h: Schedule.of(wsd(h), h, per_step) for h in [steps, *horizons]}
    every = -(-steps // 8)
    keys = [(s, steps) for s in [*range(every, steps, every), steps]] + [(h, h) for h in horizons]
    losses = {}
    for step, h in keys:
        losses[(step, h)] = float(TRUTH.curve(n, schedules[h], [step])[0] * np.exp(rng.normal(0, 0.005)))
    return curve_points(n, losses, schedules)


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
