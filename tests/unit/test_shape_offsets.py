"""The rung's shape by its offset from the law: each swept shape's offset at the largest budget, shrunk by the seed
noise (`evaluation/shape_offsets.py`); the rung is the shape lowest by the law times that offset
(`flows.scaling.shaped_rung`) and is predicted with it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from evaluation.kaplan_fit import KaplanLaw
from evaluation.scaling_data import ScalingPoints
from evaluation.scaling_report import FormPrediction, run_fit_scaling, rung_lines
from evaluation.shape_offsets import ShapeOffset, shape_offsets
from flows.recipe import load_recipe
from flows.scaling import (
    choose_and_size,
    nearest_shapes,
    offset_prediction,
    rung_size,
    shaped_rung,
    size_for_budget,
)
from flows.stages.scaling import sized
from training.sizing import count_n, sized_model

TRUE = KaplanLaw(n_c=3e4, d_c=2e6, alpha_n=0.25, alpha_d=0.3, E=1.2)
BUDGET = 2.4e12
N_OPT = float(TRUE.optimal_n(BUDGET))


def demo(tmp_path, *overrides: str):
    return load_recipe("demo", [f"output_dir={tmp_path}", *overrides])


def swept(recipe) -> dict[tuple[int, int], float]:
    """The demo's swept shapes: (depth, width) -> N."""
    models = [sized_model(recipe.model, s.depth, s.width) for s in recipe.sweep.all_sizes()]
    return {(m.n_layers, m.d_model): float(count_n(m, recipe.sweep.param_count)) for m in models}


def nearest_and_next(recipe) -> tuple[tuple[int, int], tuple[int, int], float]:
    """The shape nearest the true law's N* at BUDGET, and the swept shape nearest N* other than it (with its N)."""
    nearest = nearest_shapes(recipe, N_OPT)[0][:2]
    other, n_other = next(
        (shape, n)
        for shape, n in sorted(swept(recipe).items(), key=lambda kv: abs(math.log(kv[1] / N_OPT)))
        if shape != nearest
    )
    return nearest, other, n_other


def sweep(
    sizes: list[float], offsets: dict[float, float], seeds: int, noise: float, seed: int = 0
) -> ScalingPoints:
    """The demo's design from a known law, every size under `seeds` runs, each size's loss times exp(its offset)
    at every budget, and lognormal noise per run."""
    rng = np.random.default_rng(seed)
    n, c, run = [], [], []
    for size in sizes:
        for s in range(seeds):
            n += [size] * 3
            c += [2e11, 4e11, 8e11]
            run += [f"{size:.0f}-{s}"] * 3
    n, c = np.array(n), np.array(c)
    d = c / (6 * n)
    shift = np.array([offsets.get(size, 0.0) for size in n])
    loss = TRUE.loss(n, d) * np.exp(shift + rng.normal(0.0, noise, n.size))
    return ScalingPoints(n, d, loss, c, n.copy(), source="synthetic", run=np.array(run))


def test_a_shapes_offset_is_kept_and_noise_shrinks_toward_the_law(tmp_path):
    """Four seeds at 0.5% noise: the shape 3% below the law keeps nearly all of it, the others' noise is shrunk
    (never grown); one seed per shape gives no estimate of the noise, so no offsets."""
    sizes = sorted(swept(demo(tmp_path)).values())
    low = sizes[4]
    offsets = shape_offsets(sweep(sizes, {low: -0.03}, seeds=4, noise=0.005), TRUE)
    assert set(offsets) == set(sizes) and all(o.runs == 4 for o in offsets.values())
    assert offsets[low].offset == pytest.approx(-0.03, abs=0.006)
    for size, o in offsets.items():
        assert abs(o.offset) <= abs(o.raw) + 1e-12 and o.sd >= 0
        if size != low:
            assert abs(o.offset) < 0.006
    assert shape_offsets(sweep(sizes, {low: -0.03}, seeds=1, noise=0.005), TRUE) == {}
    alike = shape_offsets(sweep(sizes, {}, seeds=4, noise=0.005, seed=1), TRUE).values()
    assert all(
        abs(o.offset) <= 0.5 * abs(o.raw) for o in alike
    )  # shapes apart by noise only: mostly shrunk away


def test_the_rung_is_the_shape_lowest_by_the_law_times_its_offset(tmp_path):
    """A swept shape other than the one nearest N* becomes the rung when its offset puts it below the nearest
    shape's law loss, not when its offset is above; the size for the final model follows the rung's shape."""
    recipe = demo(tmp_path)
    nearest, other, n_other = nearest_and_next(recipe)
    for offset, want in ((-0.05, other), (0.05, nearest)):
        offsets = {n_other: ShapeOffset(n_other, offset, 0.004, offset, 4)}
        rung, shape = shaped_rung(recipe, TRUE, offsets, N_OPT, BUDGET)
        assert (rung.model.n_layers, rung.model.d_model) == (shape.depth, shape.width) == want
        assert (shape.offset is not None) == (want == other)
    rung, shape = shaped_rung(recipe, TRUE, {}, N_OPT, BUDGET)
    assert (shape.depth, shape.width) == nearest and shape.offset is None
    final, note = size_for_budget(recipe, N_OPT, BUDGET, shape=other)
    assert (final.model.n_layers, final.model.d_model) == other and "not the nearest" in note


def test_a_prediction_carries_its_shapes_offset_and_its_uncertainty():
    before = FormPrediction(form="kaplan", law={}, loss=2.0, interval=(1.9, 2.1), run_interval=(1.8, 2.2))
    offset = ShapeOffset(1e5, -0.02, 0.01, -0.025, 4)
    after = offset_prediction(before, offset)
    assert after.loss == pytest.approx(2.0 * math.exp(-0.02)) and after.shape_offset == -0.02
    assert after.interval[0] < 1.9 * math.exp(-0.02) and after.interval[1] > 2.1 * math.exp(-0.02)  # wider
    assert offset_prediction(before, None) == before


def test_the_fit_sizes_and_predicts_the_rung_with_its_shapes_offset(tmp_path):
    """Through `choose_and_size`: a sweep whose shape next to N* runs 4% below the law gets that shape as its rung,
    predicted 4% (shrunk a little) below the law, and the report says so."""
    recipe = demo(tmp_path, "sweep.law_form=kaplan")
    shapes = swept(recipe)
    _, other, n_other = nearest_and_next(recipe)
    table = sweep(sorted(shapes.values()), {n_other: -0.04}, seeds=3, noise=0.003)
    fit = run_fit_scaling(table, tmp_path, target_budget=BUDGET, n_bootstrap=40, plots=False, write=False)
    fit, rung, prediction, law = choose_and_size(recipe, table, fit, BUDGET, tmp_path, n_resamples=30)
    assert (prediction.shape.depth, prediction.shape.width) == other and (
        prediction.n,
        prediction.d,
    ) == rung_size(rung)
    assert prediction.shape.offset == pytest.approx(-0.04, abs=0.015)
    assert prediction.loss == pytest.approx(
        float(law.loss(prediction.n, prediction.d)) * math.exp(prediction.shape.offset)
    )
    assert prediction.second_form.shape_offset is not None  # the other form is offset from its own law
    assert any("Its shape" in line for line in rung_lines(prediction))
    results = tmp_path / "results.parquet"
    pq.write_table(pa.table({"N": table.n}), results)
    final, note = sized(
        recipe, {"sweep": SimpleNamespace(results=str(results))}, fit.model_copy(update={"rung": prediction})
    )
    assert (final.model.n_layers, final.model.d_model) == other  # the final model is the rung's shape
