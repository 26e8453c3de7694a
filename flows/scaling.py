"""The scaling stages as the CLI and the pipeline run them: sweep (Ray Tune) then fit, logged to MLflow.

The fit of a sweep for a target budget is a cached step of its own (`<output_dir>/fit/<name>-<hash>/`: fit.json,
the bootstrap laws, the plots), attached to the sweep's MLflow run; once the rung has trained, its check is
another step (`<output_dir>/rung/<name>-<hash>/`) holding fit.json and the plots with the measurement.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_pipeline.shards import DatasetManifest
from evaluation.chinchilla_fit import HUBER_DELTA
from evaluation.kaplan_fit import KaplanLaw, fit_kaplan, kaplan_intervals
from evaluation.law_form import FormChoice, choose_form, heldout_gap
from evaluation.law_noise import calibrated_fit
from evaluation.loss_curve import (
    Anchor,
    CurveLaw,
    CurvePoints,
    PointLaw,
    Schedule,
    fit_curve_law,
    run_curve,
)
from evaluation.scaling_data import ScalingDataError, ScalingPoints, points_from_table
from evaluation.scaling_report import (
    CURVE_PLOT,
    FIT_FILE,
    LAW_KEYS,
    PLOTS,
    CurvePrediction,
    FormPrediction,
    Prediction,
    RungShape,
    ScalingFit,
    holdout_mask,
    load_samples,
    predict,
    run_fit_scaling,
    write_fit_plots,
)
from evaluation.shape_offsets import ShapeOffset, Shifted, shape_offsets, widened
from infra.steps import Step, run_step
from infra.tracking import existing_run
from training.config import OptimConfig
from training.sizing import count_n, run_shape, sized_model
from training.stages.lifecycle import TrainedModel, read_metrics
from training.stages.sweep import SweepResult

if TYPE_CHECKING:
    from flows.recipe import Recipe

log = logging.getLogger(__name__)
# 2: noise-model intervals; 3: the curve law, the rung's curve; 4: that curve pinned; 5: Kaplan's form beside;
# 6: the curve anchored to the point law at every evaluation; 7: Kaplan's intervals; 8: the form chosen; 9: Kaplan's
# resamples refitted from several starts; 10: the rung's shape by its offset from the law (evaluation/shape_offsets.py);
# 11: the held-out gap between the forms; 12: the law's misfit per (size, budget) cell in the noise model; 13: and
# per shape, across budgets; 14: Kaplan's intervals span the floorless law's where the sweep cannot tell E from 0;
# 15: and say so (`floorless`); the task loss's law in the form that predicts the loss, with a run's interval
# 16: the task law's too (`rung.task_floorless`)
FIT_VERSION = 16
RUNG_VERSION = 3  # 2: the measured validation curve; 3: the task loss's verdict (`task_held`)


def sweep_points(results: str | Path, column: str = "loss") -> ScalingPoints:
    """Completed points of a sweep table (`column`: the validation loss, or the probe's `task_loss`); with a
    learning-rate grid, the best rate per (N, D) and seed (every seed's replica is a run of its own). A table
    without one usable point says why."""
    table = pq.read_table(results)
    rows = table.to_pylist()
    usable = [r for r in rows if r["status"] == "completed" and r.get(column) is not None]
    if column == "loss" and not usable:
        statuses = Counter(r["status"] for r in rows)
        raise ScalingDataError(
            f"{results}: no sweep run finished with a loss ({', '.join(f'{n} {s}' for s, n in statuses.items())}); "
            "lower optim.lr (diverged runs) or sweep.min_steps, then rerun the sweep"
        )
    best: dict[tuple[int, int], dict[str, Any]] = {}
    for row in usable:
        key = (row["N"], row["D"], row.get("seed"))
        if key not in best or row[column] < best[key][column]:
            best[key] = row
    chosen = pa.Table.from_pylist(list(best.values())) if best else table.slice(0, 0)
    fields = ["N", "N_total", "D", "C", *(["run_dir"] if "run_dir" in table.column_names else [])]
    chosen = chosen.select([*fields, column]).rename_columns(
        [*fields, "loss"]
    )  # `column` is what gets fitted; the points of one multi-horizon run share its run directory
    points = points_from_table(chosen, source=str(results))
    return replace(points, dropped=len(table) - len(points))


def target_budget(recipe: Recipe) -> float:
    """The compute budget the final model (the rung) is sized for: `sweep.target_budget`, else
    `sweep.rung_multiple` times the largest swept budget (3x by default: an extrapolation that tests the law)."""
    return float(recipe.sweep.target_budget or recipe.sweep.rung_multiple * max(recipe.sweep.budgets))


def fit_sweep(recipe: Recipe, sweep: SweepResult, data: DatasetManifest | None) -> ScalingFit:
    """The fit of the sweep's results for the target budget, with the loss (and the probe's task loss) it
    predicts for the model sized there, made before that model trains: a cached step (`<output_dir>/fit/`) keyed
    by the sweep, the data and what sizing reads (the recipe's model, run and sweep sections)."""
    budget, n_bootstrap = target_budget(recipe), recipe.sweep.bootstrap_resamples
    config = {
        "budget": budget,
        "n_bootstrap": n_bootstrap,
        "sweep": recipe.sweep.model_dump(mode="json"),
        "model": recipe.model.model_dump(mode="json"),
        "train": recipe.train.model_dump(mode="json"),
        "world_size": recipe.parallel.world_size,
    }
    step = Step("fit", recipe.name, FIT_VERSION, config, ScalingFit, {"sweep": sweep, "data": data})
    return run_step(
        recipe.output_dir, step, lambda out, key: _fit(recipe, sweep, data, budget, n_bootstrap, out)
    )


def _fit(
    recipe: Recipe,
    sweep: SweepResult,
    data: DatasetManifest | None,
    budget: float,
    n_bootstrap: int,
    out: Path,
) -> ScalingFit:
    """Fit, size the rung, predict it; write fit.json and the plots; log the fit to the sweep's MLflow run."""
    earlier = Path(sweep.path) / f"fit-C{budget:.3g}".replace("+", "")
    if earlier.is_dir():  # where fits lived before they were steps of their own
        log.warning("fitting again into %s: %s is an earlier version's fit, no longer read", out, earlier)
    points = sweep_points(sweep.results)
    fit = run_fit_scaling(
        points,
        out,
        target_budget=budget,
        n_bootstrap=n_bootstrap,
        param_count=recipe.sweep.param_count,
        moe=recipe.model.moe is not None,
        plots=False,
        write=False,
    )
    fit, rung, prediction, kaplan = choose_and_size(recipe, points, fit, budget, out, n_bootstrap // 4)
    n, d = prediction.n, prediction.d
    contamination = contamination_report(data) if recipe.sweep.probe and data is not None else None
    updates: dict[str, Any] = {"contamination": contamination}
    task_points = sweep_points(sweep.results, "task_loss") if recipe.sweep.probe else None
    if task_points is not None and len(task_points) > 5:
        task = task_prediction(task_points, prediction.form, n, d, budget, n_bootstrap // 4)
        prediction = prediction.model_copy(
            update={
                "task_loss": task.loss,
                "task_interval": task.interval,
                "task_run_interval": task.run_interval,
                "task_form": task.form,
                "task_floorless": task.floorless,
            }
        )
        updates |= {"task_law": task.law, "task_intervals": task.exponents}
    curves = sweep_curves(points, recipe.sweep.min_steps)
    anchor = curve_anchor(points, fit, kaplan)
    try:
        curve_fit = fit_curve_law(curves, start=fit.law, anchor=anchor) if curves is not None else None
    except ValueError as e:  # too few points or sizes: the point law stands without the curve
        log.warning("no loss-curve law: %s", e)
        curve_fit = None
    if curve_fit is not None:
        summary = curve_fit.summary()
        offset = prediction.shape.offset if prediction.shape is not None else None
        point_law = Shifted(anchor.law, float(np.exp(offset))) if offset is not None else anchor.law
        curve = rung_curve(rung, curve_fit.law, point_law, sweep_warmup(points))
        curve = curve.model_copy(
            update={"band": curve_fit.band, "seed_spread": summary["seed_spread_median"]}
        )
        prediction = prediction.model_copy(update={"curve": curve})
        updates["curve_law"] = summary
    fit = fit.model_copy(update={**updates, "rung": prediction})
    write_fit_plots(fit, points, out, curves)
    fit.save(out)
    tracker = existing_run(recipe.tracking, recipe.output_dir, sweep.mlflow_run_id).tracker()
    tracker.log_metrics({f"fit/{k}": v for k, v in fit.law.items()}, step=0)
    tracker.log_metrics(
        {
            "fit/n_opt": fit.sizing_n_opt,
            "fit/d_opt": budget / (6.0 * fit.sizing_n_opt),
            "fit/rung_predicted_loss": prediction.loss,
            **second_form_metric(prediction, "predicted_loss", "loss"),
        },
        step=0,
    )
    for name in (FIT_FILE, *PLOTS, CURVE_PLOT):
        if (out / name).is_file():
            tracker.log_artifact(out / name, "fit")
    return fit


def choose_and_size(
    recipe: Recipe, points: ScalingPoints, fit: ScalingFit, budget: float, out: Path, n_resamples: int
) -> tuple[ScalingFit, Recipe, Prediction, KaplanLaw | None]:
    """The law form that sizes the rung (`choose_form` on each form's held-out error, recorded as `fit.choice`),
    the rung's recipe at that form's N*, its prediction there with the other form's beside (Kaplan's intervals
    from `n_resamples`), and Kaplan's law (None where it did not converge)."""
    kaplan = kaplan_form(points)
    law = kaplan[0] if kaplan else None
    kaplan_errors = kaplan[1] if kaplan else None
    heldout = {
        "chinchilla": (fit.holdout or {}).get("mean_rel_error"),
        "kaplan": float(np.mean(kaplan_errors)) if kaplan_errors is not None else None,
    }
    gap = paired_gap(points, fit, kaplan_errors)
    if law is None:  # nothing to choose from
        form, reason = "chinchilla", "Kaplan's form did not converge on this sweep"
    else:
        form, reason = choose_form(recipe.sweep.law_form, heldout, gap)
    n_opt = float(law.optimal_n(budget)) if form == "kaplan" else fit.optimal.n_opt
    laws: dict[str, PointLaw] = {"chinchilla": fit.to_law(), **({"kaplan": law} if law is not None else {})}
    offsets = {f: shape_offsets(points, point_law) for f, point_law in laws.items()}
    rung, shape = shaped_rung(recipe, laws[form], offsets[form], n_opt, budget)
    n, d = rung_size(rung)
    forms = form_predictions(points, fit, law, heldout, n, d, out, n_resamples)
    forms = {f: offset_prediction(p, offsets[f].get(n)) for f, p in forms.items()}
    chosen = forms.pop(form)
    choice = FormChoice(
        form=form,
        law=chosen.law,
        reason=reason,
        heldout=heldout,
        heldout_gap=gap,
        n_opt=chosen.n_opt,
        n_opt_interval=chosen.n_opt_interval,
        exponents=chosen.exponents,
        floorless=chosen.floorless,
    )
    prediction = Prediction(
        n=n,
        d=d,
        loss=chosen.loss,
        interval=chosen.interval,
        run_interval=chosen.run_interval,
        form=form,
        second_form=next(iter(forms.values()), None),
        shape=shape,
    )
    return fit.model_copy(update={"choice": choice}), rung, prediction, law


def shaped_rung(
    recipe: Recipe, law: PointLaw, offsets: dict[float, ShapeOffset], n_opt: float, budget: float
) -> tuple[Recipe, RungShape]:
    """The rung: the shape nearest N*, unless a swept shape's loss by the law times its offset from it
    (`shape_offsets`) is lower at this budget; each candidate as it would train (`rung_recipe`). Without offsets
    (one seed, or shapes no further from the law than noise) the nearest shape, as before."""
    depth, width, _ = nearest_shapes(recipe, n_opt)[0]
    candidates = [(depth, width)]
    if offsets:
        swept = [sized_model(recipe.model, s.depth, s.width) for s in recipe.sweep.all_sizes()]
        candidates += [(m.n_layers, m.d_model) for m in swept]

    def scored(shape: tuple[int, int]) -> tuple[float, Recipe, ShapeOffset | None]:
        sized = rung_recipe(recipe, *shape, budget)
        n, d = rung_size(sized)
        offset = offsets.get(n)
        return float(law.loss(n, d)) * (offset.factor() if offset else 1.0), sized, offset

    _, rung, offset = min((scored(c) for c in dict.fromkeys(candidates)), key=lambda t: t[0])
    shape = RungShape(depth=rung.model.n_layers, width=rung.model.d_model)
    if offset is not None:
        shape = shape.model_copy(
            update={"offset": offset.offset, "raw": offset.raw, "sd": offset.sd, "runs": offset.runs}
        )
    return rung, shape


def offset_prediction(prediction: FormPrediction, offset: ShapeOffset | None) -> FormPrediction:
    """A form's answer at the rung times the rung's shape's offset from that form's law, its intervals widened by
    the offset's own uncertainty; unchanged where the shape was not swept."""
    if offset is None:
        return prediction
    loss = prediction.loss * offset.factor()
    scaled = {
        k: widened(loss, (bounds[0] * offset.factor(), bounds[1] * offset.factor()), offset)
        for k in ("interval", "run_interval")
        if (bounds := getattr(prediction, k)) is not None
    }
    return prediction.model_copy(update={"loss": loss, **scaled, "shape_offset": offset.offset})


def paired_gap(
    points: ScalingPoints, fit: ScalingFit, kaplan_errors: np.ndarray | None
) -> tuple[float, float] | None:
    """`heldout_gap` over the held-out points both forms predicted (Chinchilla's from `fit.holdout`); None where
    either form has no held-out errors."""
    held = holdout_mask(points)
    chinchilla = (fit.holdout or {}).get("points")
    if held is None or kaplan_errors is None or not chinchilla or len(chinchilla) != len(kaplan_errors):
        return None
    errors = np.array([abs(p["predicted"] - p["measured"]) / p["measured"] for p in chinchilla])
    return heldout_gap(errors, kaplan_errors, points.subset(held).runs)


def kaplan_form(points: ScalingPoints) -> tuple[KaplanLaw, np.ndarray | None] | None:
    """Kaplan's form fitted to the sweep's points, and its relative error at each held-out point (fitted without
    the held-out budget, as Chinchilla's in `fit.holdout`; None with too few sizes left); None when it does not
    converge."""
    try:
        law = fit_kaplan(points)
    except ValueError as e:
        log.warning("no second law form: %s", e)
        return None
    held = holdout_mask(points)
    if held is None or len(np.unique(points.n[~held])) < 2:
        return law, None
    test = points.subset(held)
    try:
        other = fit_kaplan(points.subset(~held))
    except ValueError:
        return law, None
    return law, np.abs(other.loss(test.n, test.d) / test.loss - 1.0)


def form_predictions(
    points: ScalingPoints,
    fit: ScalingFit,
    kaplan: KaplanLaw | None,
    heldout: dict[str, float | None],
    n: float,
    d: float,
    out: Path,
    n_resamples: int = 500,
) -> dict[str, FormPrediction]:
    """Each form's answer at the rung's (n, d): its loss with the law's and a run's 95% intervals, its N* at the
    target budget and its exponents with theirs (Chinchilla's from the fit's bootstrap in `out`, Kaplan's from
    `n_resamples` of its own, `kaplan_intervals`), and its held-out error."""
    budget = fit.optimal.budget
    chinchilla = predict(fit.to_law(), load_samples(out), fit.noise_model(), n, d)
    forms = {
        "chinchilla": FormPrediction(
            form="chinchilla",
            law={k: fit.law[k] for k in LAW_KEYS},
            loss=chinchilla.loss,
            interval=chinchilla.interval,
            run_interval=chinchilla.run_interval,
            n_opt=fit.optimal.n_opt,
            n_opt_interval=fit.optimal.n_opt_interval,
            exponents={k: fit.intervals[k] for k in ("alpha", "beta")},
            heldout_mean_rel_error=heldout["chinchilla"],
        )
    }
    if kaplan is not None:
        forms["kaplan"] = kaplan_prediction(points, kaplan, n, d, budget, n_resamples).model_copy(
            update={"heldout_mean_rel_error": heldout["kaplan"]}
        )
    return forms


def kaplan_prediction(
    points: ScalingPoints, law: KaplanLaw, n: float, d: float, budget: float, n_resamples: int
) -> FormPrediction:
    """Kaplan's form's answer at (n, d): its loss with the law's and a run's 95% intervals, its N* at `budget` and
    its exponents with theirs (`kaplan_intervals` from `n_resamples`)."""
    intervals = kaplan_intervals(points, law, n, d, budget, n_resamples)
    return FormPrediction(
        form="kaplan",
        law=law.as_dict(),
        loss=float(law.loss(n, d)),
        interval=intervals.loss,
        run_interval=intervals.run,
        n_opt=float(law.optimal_n(budget)),
        n_opt_interval=intervals.n_opt,
        exponents=intervals.exponents,
        floorless=intervals.floorless,
    )


def task_prediction(
    points: ScalingPoints, form: str, n: float, d: float, budget: float, n_resamples: int
) -> FormPrediction:
    """The probe's task loss at the rung's (n, d) from a law fitted to the sweep's task losses (the OLMo ladder's
    method) in the form that predicts the rung's loss (Chinchilla's where Kaplan's does not converge on them),
    with its law's and a run's 95% intervals (`n_resamples`), times the rung's shape's offset from that law where
    the shape was swept. Why the chosen form: on the demo (Kaplan's chosen), Chinchilla's task law predicted
    2.3677 with a run's interval [2.2936, 2.4456], and the rung measured 2.2762, 4.0% below and outside it, as its
    loss law's prediction was 3.9% off; Kaplan's task law predicted 2.3256 [2.2612, 2.4318], 2.2% off."""
    kaplan = None
    if form == "kaplan":
        try:
            kaplan = fit_kaplan(points)
        except ValueError as e:
            log.warning("the task loss's law in Chinchilla's form: %s", e)
    law: PointLaw
    if kaplan is not None:
        law = kaplan
        prediction = kaplan_prediction(points, kaplan, n, d, budget, n_resamples)
    else:
        fitted = calibrated_fit(points, n_resamples=n_resamples)
        law = chinchilla = fitted.fit.law
        at = predict(chinchilla, fitted.boot.samples, fitted.noise, n, d)
        prediction = FormPrediction(
            form="chinchilla",
            law={k: getattr(chinchilla, k) for k in LAW_KEYS},
            loss=at.loss,
            interval=at.interval,
            run_interval=at.run_interval,
            exponents={k: fitted.boot.interval(k) for k in ("alpha", "beta")},
        )
    return offset_prediction(prediction, shape_offsets(points, law).get(n))


def curve_anchor(points: ScalingPoints, fit: ScalingFit, kaplan: KaplanLaw | None) -> Anchor:
    """The chosen form's point law for the rung's curve to be anchored to, refitted from itself without a run for
    the curve's held-out band."""
    if fit.choice is not None and fit.choice.form == "kaplan" and kaplan is not None:
        return Anchor(points, kaplan, lambda others: fit_kaplan(others, starts=8, start=kaplan))
    return Anchor.chinchilla(points, fit.to_law(), fit.huber_delta or HUBER_DELTA)


def second_form_metric(rung: Prediction, name: str, field: str) -> dict[str, float]:
    """`fit/rung_<form>_<name>` for MLflow when the rung has a second form's `field`, else nothing."""
    second = rung.second_form
    value = getattr(second, field) if second is not None else None
    return {} if value is None else {f"fit/rung_{second.form}_{name}": value}


def sweep_curves(points: ScalingPoints, min_step: int = 1) -> CurvePoints | None:
    """The validation curves of the runs behind a sweep's fitted `points` (with a learning-rate grid, the best
    rate's) from step `min_step` on (the early plateau left out, as in the points); None when a run's files are
    not on this machine."""
    runs = {} if points.run is None else dict(zip(points.run.tolist(), points.n.tolist(), strict=True))
    try:
        curves = [c for c in (run_curve(d, n, min_step) for d, n in runs.items()) if c is not None]
    except FileNotFoundError as e:
        log.warning("no loss-curve law: %s", e)
        return None
    return CurvePoints.concat(curves) if curves else None


def sweep_warmup(points: ScalingPoints) -> int:
    """The median warmup (optimiser steps) of the runs behind a sweep's points: the runs the point law describes."""
    runs = [] if points.run is None else np.unique(points.run).tolist()
    warmups = [json.loads((Path(r) / "spec.json").read_text())["optim"]["warmup_steps"] for r in runs]
    return int(np.median(warmups))


def rung_curve(rung: Recipe, law: CurveLaw, point_law: PointLaw, warmup: int) -> CurvePrediction:
    """The rung's validation loss at each step it will evaluate, and at its end had it used another schedule (no
    decay, twice the decay, cosine): the curve anchored to the point law (`CurveLaw.anchored`): the point law's
    loss at each evaluation's tokens, that of a run like the sweep's (its `warmup`) decayed there, plus what the
    rung's schedule adds over that run's by the curve law. The curve law's own end point, which sat 3-4% above
    the rung's at the demo's 3x rung, is kept as `curve_law_end`."""
    n, _ = rung_size(rung)
    train, optim = rung.train, rung.optim
    steps, every = train.max_steps, train.eval_every
    per_step = train.global_batch(rung.parallel.world_size) * train.seq_len
    evals = [*range(every, steps, every), steps]

    def reference(step: int) -> Schedule:
        return Schedule.ending(optim, step, per_step, warmup)

    def anchored(o: OptimConfig, at: list[int]) -> np.ndarray:
        decayed = point_law.loss(n, np.asarray(at, dtype=float) * per_step)
        return decayed + law.difference(n, Schedule.of(o, steps, per_step), at, reference)

    longer = min(0.5, 2 * optim.decay_fraction)
    variants = {
        "constant": optim.model_copy(update={"schedule": "constant"}),
        f"wsd, {longer:.0%} decay": optim.model_copy(update={"schedule": "wsd", "decay_fraction": longer}),
        "cosine": optim.model_copy(update={"schedule": "cosine"}),
    }
    curve = anchored(optim, evals)
    return CurvePrediction(
        steps=evals,
        tokens=[float(s * per_step) for s in evals],
        loss=curve.tolist(),
        schedules={
            "as planned": float(curve[-1]),
            **{k: float(anchored(o, [steps])[0]) for k, o in variants.items()},
        },
        curve_law_end=float(law.curve(n, Schedule.of(optim, steps, per_step), [steps])[0]),
        reference_warmup=warmup,
    )


def rung_recipe(recipe: Recipe, depth: int, width: int, budget: float) -> Recipe:
    """The recipe of a rung `depth` layers, `width` wide at `budget` FLOPs, trained as a sweep run of its size
    would be that ends there: the sweep's batch and learning-rate rules for D = C / (6·N) tokens, and its warmup
    (multi-horizon: a share of the shortest horizon, at the sweep's smallest budget over its largest), evaluated
    at `sweep.curve_points` steps (the curve the law predicts). The point law describes runs warmed up so: a tenth
    of the rung's own steps (its rule until 2026-12-05) ended the demo's rungs 0.6-0.9% higher."""
    sweep = recipe.sweep
    model = sized_model(recipe.model, depth, width)
    span = min(sweep.budgets) / max(sweep.budgets) if sweep.multi_horizon and sweep.budgets else 1.0
    shape = run_shape(
        recipe.pretrain_spec(), sweep, count_n(model, sweep.param_count), [budget * span, budget]
    )
    steps = shape.steps[-1]
    return recipe.override(
        {
            "model": model.model_dump(mode="json"),
            **shape.overrides(recipe.optim.lr),
            "train.max_steps": steps,
            "train.eval_every": -(-steps // sweep.curve_points),
            "train.checkpoint_every": max(1, steps // 3),
        }
    )


def rung_size(recipe: Recipe) -> tuple[float, float]:
    """(N, D) of a recipe's pretraining run under the sweep's parameter-count convention."""
    tokens = (
        recipe.train.global_batch(recipe.parallel.world_size) * recipe.train.seq_len * recipe.train.max_steps
    )
    return float(count_n(recipe.model, recipe.sweep.param_count)), float(tokens)


def check_rung(recipe: Recipe, sweep: SweepResult, fit: ScalingFit, model: TrainedModel) -> ScalingFit:
    """The rung's measured loss (and task loss) against the prediction made before it trained: a cached step
    (`<output_dir>/rung/`, keyed by the fit and the model) with fit.json and the plots (logged once, see below),
    `fit/rung_rel_error` and its companions logged to the sweep's, the rung's and the pipeline's runs."""
    if fit.rung is None or model.final_val_loss is None:
        return fit
    step = Step(
        "rung", recipe.name, RUNG_VERSION, {}, ScalingFit, {"law": fit, "model": model, "sweep": sweep}
    )
    return run_step(recipe.output_dir, step, lambda out, key: _check(recipe, sweep, fit, model, out))


def _check(recipe: Recipe, sweep: SweepResult, fit: ScalingFit, model: TrainedModel, out: Path) -> ScalingFit:
    logged = read_metrics(model.run_dir)
    task = [m["probe/bpb"] for m in logged if "probe/bpb" in m]
    curve = {int(m["step"]): m["val/loss"] for m in logged if "val/loss" in m and m["step"] > 0}
    checked = fit.model_copy(
        update={"rung": fit.rung.check(model.final_val_loss, task[-1] if task else None, curve)}
    )
    points = sweep_points(sweep.results)
    write_fit_plots(checked, points, out, sweep_curves(points, recipe.sweep.min_steps))
    checked.save(out)
    rung = checked.rung
    metrics = {
        "fit/rung_rel_error": rung.rel_error,
        "fit/rung_measured_loss": rung.measured_loss,
        "fit/rung_held": float(rung.held),
    }
    if rung.task_rel_error is not None:
        metrics["fit/rung_task_rel_error"] = rung.task_rel_error
    if rung.task_held is not None:
        metrics["fit/rung_task_held"] = float(rung.task_held)
    if rung.curve is not None and rung.curve.max_rel_error is not None:
        metrics["fit/rung_curve_max_rel_error"] = rung.curve.max_rel_error
    metrics |= second_form_metric(rung, "rel_error", "rel_error")
    parent = recipe.tracking.parent_run_id  # the pipeline's run, when there is one
    for run_id in dict.fromkeys(r for r in (sweep.mlflow_run_id, model.mlflow_run_id, parent) if r):
        tracker = existing_run(recipe.tracking, recipe.output_dir, run_id).tracker()
        tracker.log_metrics(metrics, step=0)
        # the checked fit's files once: in a pipeline its lineage run holds them (flows/lineage.record_fit), else
        # the rung's run, beside the measurement (the sweep's run holds the fit as it was before the rung)
        if run_id == model.mlflow_run_id and parent is None:
            for name in (FIT_FILE, *PLOTS, CURVE_PLOT):
                if (out / name).is_file():
                    tracker.log_artifact(out / name, "fit")
    return checked


def contamination_report(data: DatasetManifest) -> dict[str, Any]:
    """HumanEval prompts and solutions found verbatim in the training shards (decoded)."""
    from data_pipeline.humaneval import contamination
    from data_pipeline.shards import training_documents

    return contamination(training_documents(data))


def nearest_shapes(recipe: Recipe, n_opt: float, max_aspect: float = 48) -> list[tuple[int, int, int]]:
    """(depth, width, N) of every shape of depth 1-8, widths in whole kv groups of heads, width/depth 16 to
    `max_aspect`, nearest N* first (in log space; ties to width/depth nearest 24)."""
    step = recipe.model.head_dim * (recipe.model.n_heads // recipe.model.n_kv_heads)  # whole kv groups
    candidates = []
    for depth in range(1, 9):
        for width in range(step, int(max_aspect) * depth + 1, step):
            if 16 <= width / depth <= max_aspect:
                n = count_n(sized_model(recipe.model, depth, width), recipe.sweep.param_count)
                candidates.append((abs(np.log(n / n_opt)), abs(width / depth - 24), depth, width, n))
    return [(depth, width, n) for *_, depth, width, n in sorted(candidates)]


def size_for_budget(
    recipe: Recipe,
    n_opt: float,
    budget: float,
    swept: tuple[float, float] | None = None,
    shape: tuple[int, int] | None = None,
) -> tuple[Recipe, str]:
    """The recipe at the size nearest N* (in log space; depth 1-8, widths in whole kv groups of heads, aspect
    ratio 16-48 like the sweep's shapes), with the sweep's batch, horizon and warmup rules for D = C / (6·N)
    tokens (`rung_recipe`); returns it and a one-line explanation (which flags an N* outside the `swept` sizes).
    One layer gets no wider aspect than the others: the demo's rung at 64 wide (aspect 64) ended 0.6% above two
    layers 48 wide at the same compute, its early losses 3-4.5% above the point law's (README, "the shape it got").
    `shape` (depth, width), where the fit chose a swept shape by its offset from the law (`shaped_rung`), replaces
    the nearest one."""
    depth, width, n = nearest_shapes(recipe, n_opt)[0]
    which = "nearest size"
    if shape is not None and shape != (depth, width):
        (depth, width), which = shape, "the swept shape lowest by the law times its offset (not the nearest):"
        n = count_n(sized_model(recipe.model, depth, width), recipe.sweep.param_count)
    sized = rung_recipe(recipe, depth, width, budget)
    steps, batch = sized.train.max_steps, sized.train.global_batch(sized.parallel.world_size)
    tokens = steps * batch * sized.train.seq_len
    note = (
        f"C={budget:.3g} FLOPs: fitted N*={n_opt:.3g}; {which} depth {depth} width {width} (N={n:,}), "
        f"D={tokens:,} tokens ({steps} steps of {batch} sequences, {tokens / n:.1f} tokens/param)"
    )
    if swept and not swept[0] <= n_opt <= swept[1]:
        note += f"; N* lies outside the swept sizes ({swept[0]:,.0f}–{swept[1]:,.0f}): an extrapolation, widen the sweep"
    shapes = [sized_model(recipe.model, s.depth, s.width) for s in recipe.sweep.all_sizes()]
    aspects = [m.d_model / m.n_layers for m in shapes]
    if aspects and not min(aspects) <= width / depth <= max(aspects):
        note += (
            f"; its width/depth {width / depth:.0f} lies outside the swept shapes' ({min(aspects):.0f}–"
            f"{max(aspects):.0f}): its early curve may stray from the law's (a one-layer rung 64 wide on the demo's "
            "sweep sat 4.5% above the point law at 7 tokens per parameter)"
        )
    return sized, note
