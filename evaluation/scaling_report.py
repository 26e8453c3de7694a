"""`run_fit_scaling(table) -> ScalingFit`: Approach 3 with bootstrap intervals, Approach 2, the compute-optimal
size for a target budget, a held-out-budget check, plots and `fit.json`.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from evaluation.chinchilla_fit import Law
from evaluation.isoflop import IsoFlopFit, fit_parabolas
from evaluation.law_form import FormChoice
from evaluation.law_noise import IntervalMethod, NoiseModel, calibrated_fit, prediction_interval
from evaluation.loss_curve import CURVE_TOLERANCE, CurvePoints
from evaluation.scaling_data import ScalingDataError, ScalingPoints, load_points
from infra.steps import Artifact
from infra.storage import atomic_write_json

FIT_FILE = "fit.json"
BOOTSTRAP_FILE = "bootstrap.npz"  # the resampled laws, for intervals on later predictions
PLOTS = ("isoflop.png", "contours.png", "residuals.png", "prediction.png")
CURVE_PLOT = "curve.png"  # the rung's curve against the law's, when a loss-curve law was fitted
LAW_KEYS = ("E", "A", "B", "alpha", "beta")
RUNG_TOLERANCE = 0.03  # a prediction holds when the measurement is inside its 95% interval and this close


class ComputeOptimal(BaseModel):
    budget: float
    n_opt: float
    d_opt: float
    tokens_per_param: float
    loss: float
    loss_interval: tuple[float, float]
    n_opt_interval: tuple[float, float]
    n_total_opt: float  # for MoE: total parameters at the optimal active size (median total/active ratio)


class CurvePrediction(BaseModel):
    """The rung's validation curve as predicted before the run (at the steps the run will evaluate; anchored to
    the point law at each, `flows.scaling.rung_curve`), the end point under other schedules (same N and D), and
    once trained the measured curve."""

    steps: list[int]
    tokens: list[float]
    loss: list[float]
    schedules: dict[str, float]  # the loss at the run's end under other schedules: what it would have reached
    band: float | None = None  # relative: 95% of a held-out sweep run's points were this close to the law
    seed_spread: float | None = None  # relative: one seed's curve from its seeds' mean, the sweep's median
    curve_law_end: float | None = None  # the curve law's own end point, unanchored
    reference_warmup: int | None = None  # warmup steps of the runs the curve is anchored to (the sweep's)
    measured: list[float | None] | None = None
    max_rel_error: float | None = None

    def check(self, measured: dict[int, float]) -> CurvePrediction:
        values = [measured.get(s) for s in self.steps]
        errors = [abs(p / m - 1.0) for p, m in zip(self.loss, values, strict=True) if m is not None]
        return self.model_copy(update={"measured": values, "max_rel_error": max(errors) if errors else None})


class FormPrediction(BaseModel):
    """One law form's answer for the rung (`evaluation/law_form.py`): its law, its loss at the rung with its own
    95% intervals (the law's and a run's), its N* at the target budget with its interval, its exponents' intervals
    and its mean error on the held-out budget (fitted without it); once trained, its own error."""

    form: str
    law: dict[str, float]
    loss: float
    interval: tuple[float, float] | None = None  # its law's 95% interval at the rung
    run_interval: tuple[float, float] | None = None  # where a run at the rung lands, by this form (95%)
    n_opt: float | None = None  # its compute-optimal size at the fit's target budget
    n_opt_interval: tuple[float, float] | None = None  # 95%
    exponents: dict[str, tuple[float, float]] | None = None  # 95%: alpha, beta (Chinchilla); alpha_n, alpha_d
    heldout_mean_rel_error: float | None = None
    rel_error: float | None = None
    shape_offset: float | None = None  # the rung's shape's log offset from this form's law, in `loss`
    # Kaplan's: the sweep cannot tell E from 0, so its intervals also span the law without a floor (`kaplan_intervals`)
    floorless: bool | None = None

    def check(self, loss: float) -> FormPrediction:
        return self.model_copy(update={"rel_error": abs(loss - self.loss) / loss})


class RungShape(BaseModel):
    """The rung's depth and width, and when it is a swept shape with an offset from the law
    (`evaluation/shape_offsets.py`), that offset (log, shrunk), before shrinking, its sd and its runs: the
    prediction is the law's times exp(offset)."""

    depth: int
    width: int
    offset: float | None = None
    raw: float | None = None
    sd: float | None = None
    runs: int | None = None


class Prediction(BaseModel):
    """The law's loss at one (N, D), made before the run, with two 95% intervals: where the law's value lies
    (`interval`, the confidence interval) and where one new run's loss lands (`run_interval`, the prediction
    interval: the law's uncertainty plus a run's own scatter). Once it has trained: the measured loss and whether
    the prediction held (inside the prediction interval and within 3%). `form` is the law form that made it, the
    other form's is beside it (`second_form`)."""

    n: float
    d: float
    loss: float
    interval: tuple[float, float]
    run_interval: tuple[float, float] | None = None  # None in fits made before lmforge reported it
    task_loss: float | None = None  # the downstream probe's law, when the sweep measured one
    task_interval: tuple[float, float] | None = None
    task_run_interval: tuple[float, float] | None = None  # where the rung's task loss lands (95%)
    task_form: str | None = None  # the form of the task's law: the one that predicts the loss (`form`)
    task_floorless: bool | None = None  # its intervals also span its law without a floor (Kaplan's, E at 0)
    measured_loss: float | None = None
    measured_task_loss: float | None = None
    rel_error: float | None = None
    task_rel_error: float | None = None
    inside_interval: bool | None = None
    held: bool | None = None
    task_held: bool | None = None  # the task loss's prediction held, by the loss's rule (`check`)
    curve: CurvePrediction | None = None  # the whole validation curve (the loss-curve law's), when fitted
    form: str = "chinchilla"  # the law form that made this prediction (`evaluation/law_form.py`)
    second_form: FormPrediction | None = None  # the same rung predicted by the other form
    shape: RungShape | None = None  # which shape, and its offset from the law where it was swept

    @property
    def check_interval(self) -> tuple[float, float]:
        """What a measured run is judged against: the prediction interval (the law's, in older fits)."""
        return self.run_interval or self.interval

    def check(
        self, loss: float, task_loss: float | None, curve: dict[int, float] | None = None
    ) -> Prediction:
        """The measurement: the final loss (and task loss), and `curve` (step → validation loss) for the curve. A
        prediction held when the measurement lies inside its prediction interval (the law's, in older fits) and
        within `RUNG_TOLERANCE` of it; the task loss's is judged the same way."""
        rel = abs(loss - self.loss) / loss
        lo, hi = self.check_interval
        inside = lo <= loss <= hi
        task_rel, task_held = None, None
        if task_loss is not None and self.task_loss:
            task_rel = abs(task_loss - self.task_loss) / task_loss
            bounds = self.task_run_interval or self.task_interval
            if bounds is not None:
                task_held = bounds[0] <= task_loss <= bounds[1] and task_rel <= RUNG_TOLERANCE
        return self.model_copy(
            update={
                "measured_loss": loss,
                "measured_task_loss": task_loss,
                "rel_error": rel,
                "task_rel_error": task_rel,
                "task_held": task_held,
                "inside_interval": inside,
                "held": inside and rel <= RUNG_TOLERANCE,
                "curve": self.curve.check(curve) if self.curve is not None and curve else self.curve,
                "second_form": self.second_form.check(loss) if self.second_form is not None else None,
            }
        )


class ScalingFit(Artifact):
    """Everything in fit.json; `law` is Approach 3's point estimate. As the fit and rung stages' artifact, `path`
    is the step's directory (empty for a table fitted by `lmforge fit-scaling`)."""

    path: str = ""

    source: str
    n_points: int
    dropped: int
    law: dict[str, float]
    objective: float
    max_grad: float
    n_starts: int
    fit_seconds: float
    intervals: dict[str, tuple[float, float]]
    n_bootstrap: int
    n_bootstrap_diverged: int = 0
    interval_method: str = "points"  # how the bootstrap resampled: noise (model), runs or points
    noise: dict[str, float | None] | None = None  # the scatter of runs around the law (NoiseModel fields)
    huber_delta: float | None = None  # the fit's Huber threshold in log loss
    approach2: dict[str, Any]
    optimal: ComputeOptimal
    holdout: dict[str, Any] | None
    moe: bool
    param_count: str = "matmul"  # what N counts: every matmul per token (head included) or non-embedding
    approach2_n_opt: float | None = None  # Approach 2's N_opt(C) at the target budget
    # the downstream probe's L(N, D), when measured, in the rung's form (`rung.task_form`)
    task_law: dict[str, float] | None = None
    task_intervals: dict[str, tuple[float, float]] | None = None  # its exponents' 95% intervals
    contamination: dict[str, Any] | None = None
    rung: Prediction | None = None  # the model trained at the target budget: predicted, then measured
    curve_law: dict[str, Any] | None = None  # the loss-curve law fitted on the sweep's validation curves
    # the law form that sized the rung (None: Chinchilla's, in fits from before 2026-12-05)
    choice: FormChoice | None = None

    @property
    def sizing_n_opt(self) -> float:
        """The N* the rung is sized at: the chosen form's."""
        return self.choice.n_opt if self.choice is not None else self.optimal.n_opt

    @classmethod
    def read(cls, out_dir: str | Path) -> ScalingFit:
        return cls.from_file(Path(out_dir) / FIT_FILE)

    def to_law(self) -> Law:
        return Law(**{k: self.law[k] for k in LAW_KEYS})

    def noise_model(self) -> NoiseModel:
        """The runs' scatter (none recorded: a fit from before lmforge measured it)."""
        if not self.noise:
            return NoiseModel(0.0, 0.0)
        # JSON has no infinity: an exactly known variance's degrees of freedom are written as null
        return NoiseModel(**{k: math.inf if v is None else v for k, v in self.noise.items()})

    def save(self, out_dir: str | Path) -> None:
        atomic_write_json(Path(out_dir) / FIT_FILE, self.model_dump(mode="json"))


def intervals_at(
    samples: dict[str, np.ndarray], n: np.ndarray, d: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """95% interval of the loss at each (N, D) over the bootstrap laws (resamples × points at once); NaN when no
    resample's fit stayed finite."""
    if len(samples["E"]) == 0:
        nan = np.full(np.atleast_1d(n).shape, np.nan)
        return nan, nan
    with np.errstate(over="ignore", invalid="ignore"):  # a wild resample's law overflows: inf, ranked last
        boot = Law(**{k: samples[k][:, None] for k in LAW_KEYS}).loss(
            np.atleast_1d(n)[None], np.atleast_1d(d)[None]
        )
    lo, hi = np.nanpercentile(boot, [2.5, 97.5], axis=0)
    return lo, hi


def predict(law: Law, samples: dict[str, np.ndarray], noise: NoiseModel, n: float, d: float) -> Prediction:
    """The law's loss at (N, D) with its confidence interval (over the bootstrap laws) and a new run's
    prediction interval."""
    lo, hi = intervals_at(samples, n, d)
    return Prediction(
        n=n,
        d=d,
        loss=float(law.loss(n, d)),
        interval=(float(lo[0]), float(hi[0])),
        run_interval=prediction_interval(samples, noise, n, d),
    )


def load_samples(out_dir: str | Path, name: str = BOOTSTRAP_FILE) -> dict[str, np.ndarray]:
    with np.load(Path(out_dir) / name) as data:
        return {k: data[k] for k in data.files}


def compute_optimal(
    points: ScalingPoints, law: Law, samples: dict[str, np.ndarray], budget: float
) -> ComputeOptimal:
    n_opt, d_opt = float(law.optimal_n(budget)), float(law.optimal_d(budget))
    boot = [Law(*(samples[k][i] for k in ("E", "A", "B", "alpha", "beta"))) for i in range(len(samples["E"]))]
    # no resample at all (a degenerate law, every refit ran off): NaN intervals
    with np.errstate(over="ignore", invalid="ignore"):  # wild resamples overflow or have no interior optimum
        boot_n = np.array([float(b.optimal_n(budget)) for b in boot] or [np.nan])
        boot_loss = np.array(
            [float(b.loss(b.optimal_n(budget), b.optimal_d(budget))) for b in boot] or [np.nan]
        )
    ratio = float(np.median(points.n_total / points.n))
    return ComputeOptimal(
        budget=budget,
        n_opt=n_opt,
        d_opt=d_opt,
        tokens_per_param=d_opt / n_opt,
        loss=float(law.loss(n_opt, d_opt)),
        # resamples whose law has no interior optimum (a negative exponent) give NaN and are left out
        loss_interval=tuple(float(v) for v in np.nanpercentile(boot_loss, [2.5, 97.5])),
        n_opt_interval=tuple(float(v) for v in np.nanpercentile(boot_n, [2.5, 97.5])),
        n_total_opt=n_opt * ratio,
    )


def holdout_mask(points: ScalingPoints) -> np.ndarray | None:
    """The points of the largest budget, widened to the next budgets down until they hold at least max(3, 5% of
    the points); None with a single budget."""
    labels = points.budgets()
    budgets = np.unique(labels)[::-1]
    if len(budgets) < 2:
        return None
    need = max(3, int(np.ceil(0.05 * len(points))))
    k = 1
    while k < len(budgets) - 1 and (labels >= budgets[k - 1]).sum() < need:
        k += 1
    return labels >= budgets[k - 1]


def holdout_check(
    points: ScalingPoints, starts: np.ndarray | None, n_bootstrap: int = 500, method: IntervalMethod = "noise"
) -> dict[str, Any] | None:
    """Fit on all runs but those of the largest budget(s) and report the relative error predicting them.

    The held-out set is the largest budget, widened to the next budgets down until it holds at least
    max(3, 5 % of the runs), so a table with scattered budgets (like Chinchilla's) is still tested fairly.
    """
    held = holdout_mask(points)
    if held is None:
        return None
    train, test = points.subset(~held), points.subset(held)
    try:
        fitted = calibrated_fit(train, starts=starts, n_resamples=n_bootstrap, method=method)
    except ScalingDataError as err:
        return {"skipped": str(err)}
    law = fitted.fit.law
    predicted = law.loss(test.n, test.d)
    rel = np.abs(predicted - test.loss) / test.loss
    runs = [
        prediction_interval(fitted.boot.samples, fitted.noise, n, d)
        for n, d in zip(test.n, test.d, strict=True)
    ]
    lo, hi = np.array(runs).T  # each held-out point is a new run's: its prediction interval
    return {
        "min_budget": float(points.budgets()[held].min()),
        "n_train": len(train),
        "n_test": len(test),
        "mean_rel_error": float(rel.mean()),
        "max_rel_error": float(rel.max()),
        "inside_interval": float(np.mean((lo <= test.loss) & (test.loss <= hi))),
        "points": [
            {
                "n": float(n),
                "d": float(d),
                "measured": float(m),
                "predicted": float(p),
                "interval": [float(a), float(b)],
            }
            for n, d, m, p, a, b in zip(test.n, test.d, test.loss, predicted, lo, hi, strict=True)
        ],
        "law": law.as_dict(),
    }


def approach2_summary(iso: IsoFlopFit | None, error: str | None) -> dict[str, Any]:
    if iso is None:
        return {"skipped": error}
    return {
        "parabolas": [p.__dict__ for p in iso.parabolas],
        "n_opt": iso.n_opt.__dict__ if iso.n_opt else None,
        "d_opt": iso.d_opt.__dict__ if iso.d_opt else None,
        "skipped_budgets": iso.skipped,
    }


def run_fit_scaling(
    table: str | Path | ScalingPoints,
    out_dir: str | Path,
    target_budget: float | None = None,
    n_bootstrap: int = 4000,
    drop_highest: int = 0,
    starts: np.ndarray | None = None,
    plots: bool = True,
    param_count: str = "matmul",
    moe: bool | None = None,
    write: bool = True,
    method: IntervalMethod = "noise",
) -> ScalingFit:
    """Fit a results table (Parquet/CSV path or points) and write fit.json, the bootstrap laws and the plots
    into `out_dir` (with `write=False` the caller adds to the fit and saves it). `method` is how the bootstrap
    resamples (`calibrated_fit`): the noise model (default; calibrated on simulated sweeps by
    benchmarks/scaling_calibration.py), whole runs, or points as Epoch did."""
    if target_budget is not None and not target_budget > 0:
        raise ScalingDataError(
            f"target budget {target_budget} FLOPs: give a positive compute budget (--budget)"
        )
    points = table if isinstance(table, ScalingPoints) else load_points(table, drop_highest)
    t0 = time.perf_counter()
    fitted = calibrated_fit(points, starts=starts, n_resamples=n_bootstrap, method=method)
    result, boot = fitted.fit, fitted.boot
    fit_seconds = time.perf_counter() - t0
    try:
        iso, iso_error = fit_parabolas(points), None
    except ScalingDataError as err:
        iso, iso_error = None, str(err)
    budget = float(target_budget if target_budget is not None else points.c.max())
    fit = ScalingFit(
        source=points.source,
        n_points=len(points),
        dropped=points.dropped,
        law=result.law.as_dict(),
        objective=result.objective,
        max_grad=result.max_grad,
        n_starts=result.n_starts,
        fit_seconds=fit_seconds,
        intervals=boot.intervals(),
        n_bootstrap=boot.n,
        n_bootstrap_diverged=boot.n_diverged,
        interval_method=method,
        noise=asdict(fitted.noise),
        huber_delta=fitted.delta,
        approach2=approach2_summary(iso, iso_error),
        optimal=compute_optimal(points, result.law, boot.samples, budget),
        holdout=holdout_check(points, starts, method=method),
        # a table says MoE when its total parameters are well above the active ones (norms and an untied
        # embedding alone never double a dense model)
        moe=moe if moe is not None else bool(np.any(points.n_total > 2.0 * points.n)),
        param_count=param_count,
        approach2_n_opt=float(iso.n_opt(budget)) if iso and iso.n_opt else None,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / BOOTSTRAP_FILE, **boot.samples)
    if plots:
        write_fit_plots(fit, points, out)
    if write:
        fit.save(out)
    return fit


def write_fit_plots(
    fit: ScalingFit, points: ScalingPoints, out: Path, curves: CurvePoints | None = None
) -> None:
    """The PNGs from a fit (rewritten when the rung's measurement arrives); curve.png with the sweep's `curves`."""
    from evaluation.scaling_plots import write_plots

    try:
        iso = fit_parabolas(points)
    except ScalingDataError:
        iso = None
    write_plots(points, fit.to_law(), iso, fit, out, curves)


FLOORLESS = "the sweep cannot tell its E from 0: its intervals span the law without one too"
WIDE_INTERVAL = 3.0  # an exponent interval wider than this ratio gets a warning in the headline


def headline(fit: ScalingFit) -> str:
    """A few lines for the terminal: the law with intervals and the compute-optimal size."""
    law, ci, opt = fit.law, fit.intervals, fit.optimal

    def fmt(k: str, digits: int = 4) -> str:
        return f"{k}={law[k]:.{digits}g} [{ci[k][0]:.{digits}g}, {ci[k][1]:.{digits}g}]"

    lines = [
        f"L(N, D) = E + A/N^alpha + B/D^beta fitted on {fit.n_points} runs ({fit.dropped} dropped), "
        f"{fit.n_starts} starts, {fit.fit_seconds:.1f} s with its bootstrap; 95% intervals ({fit.n_bootstrap} "
        f"resamples, {fit.interval_method}):",
        "  " + ", ".join(fmt(k) for k in ("E", "A", "B", "alpha", "beta")),
        f"  N* ∝ C^{law['a']:.3f}, D* ∝ C^{law['b']:.3f}",
        f"At C={opt.budget:.3g} FLOPs: N*={opt.n_opt:.4g} (95% {opt.n_opt_interval[0]:.3g}–{opt.n_opt_interval[1]:.3g}), "
        f"D*={opt.d_opt:.4g}, {opt.tokens_per_param:.1f} tokens/param, loss {opt.loss:.4f} "
        f"[{opt.loss_interval[0]:.4f}, {opt.loss_interval[1]:.4f}]",
    ]
    if fit.noise:
        noise = fit.noise_model()
        misses = (
            [f"each shape by {noise.shape_sd:.2%} (shared by its budgets and seeds)"]
            if noise.shape_sd
            else []
        )
        if noise.cell_sd:
            more = "another " if misses else ""
            misses.append(f"each shape at each budget by {more}{noise.cell_sd:.2%} (shared by its seeds)")
        misfit = f"the law misses {' and '.join(misses)}, " if misses else ""
        lines.append(
            f"  {misfit}runs scatter around the law by {noise.run_sd:.2%} (shared by a run's horizons) and "
            f"{noise.point_sd:.2%} per point (log loss); Huber threshold {fit.huber_delta:.3g}"
        )
    if ci["E"][1] - ci["E"][0] <= 1e-9 * max(1.0, law["E"]) or law["E"] < 1e-6:
        lines.append(
            f"  warning: E={law['E']:.3g} sits at its bound (interval {ci['E'][0]:.3g}–{ci['E'][1]:.3g}): the data "
            "do not identify the irreducible loss; widen the budgets or sizes"
        )
    for k in ("alpha", "beta"):
        low, high = ci[k]
        if low <= 0 or high / low > WIDE_INTERVAL:
            lines.append(
                f"  warning: {k}'s 95% interval [{low:.3g}, {high:.3g}] spans more than {WIDE_INTERVAL:g}x: the sweep "
                "does not pin this exponent (nor N* far from its budgets); add sizes or budgets"
            )
    if fit.moe:
        lines.append(f"  (MoE: N counts active parameters; total at the optimum ≈ {opt.n_total_opt:.4g})")
    if fit.holdout and "mean_rel_error" in fit.holdout:
        h = fit.holdout
        lines.append(
            f"Held out the {h['n_test']} runs at C ≥ {h['min_budget']:.3g} FLOPs, fitted on {h['n_train']}: "
            f"mean relative error {h['mean_rel_error']:.2%}, max {h['max_rel_error']:.2%}"
        )
    a2 = fit.approach2
    if a2.get("n_opt"):
        lines.append(
            f"Approach 2 ({len(a2['parabolas'])} IsoFLOP parabolas): N_opt ∝ C^{a2['n_opt']['exponent']:.3f}, "
            f"D_opt ∝ C^{a2['d_opt']['exponent']:.3f}; N_opt={fit.approach2_n_opt:.4g} at C={opt.budget:.3g} "
            f"({fit.approach2_n_opt / opt.n_opt:.2f}x Approach 3's)"
        )
    elif a2.get("skipped"):
        lines.append(f"Approach 2 skipped: {a2['skipped']}")
    for reason in a2.get("skipped_budgets") or []:
        lines.append(f"  left out of Approach 2: {reason}")
    lines.append(
        f"N counts {fit.param_count} parameters (matmul: every matrix multiply per token, head included)"
    )
    lines += choice_lines(fit)
    lines += rung_lines(fit.rung)
    lines += goal_lines(fit)
    if fit.contamination:
        c = fit.contamination
        lines.append(
            f"Contamination: {c['prompts_found']} of {c['problems']} HumanEval prompts and {c['solutions_found']} "
            f"canonical solutions occur verbatim in the training shards {c['found'] or ''}"
        )
    return "\n".join(lines)


def choice_lines(fit: ScalingFit) -> list[str]:
    """Which law form sized the rung, why, and its N* (nothing for fits from before the choice)."""
    c = fit.choice
    if c is None:
        return []
    line = (
        f"Law form: {c.form.capitalize()}'s sizes the rung and predicts it ({c.reason}); its N*={c.n_opt:.4g} "
        f"(95% {c.n_opt_interval[0]:.3g}–{c.n_opt_interval[1]:.3g})"
    )
    if c.floorless:
        line += f"; {FLOORLESS}"
    return [line]


def precision_goals(fit: ScalingFit) -> list[tuple[str, str, bool]]:
    """What a decision needs from a ladder, each as (what, measured vs goal, met): the compute-optimal size pinned
    within 1.5x (95% interval high/low), both exponents' 95% intervals narrower than 0.15, the rung's law interval
    within ±3%, its measured loss within 1% and its validation curve within 1.5% of the prediction; N* and the
    exponents are the chosen form's (`fit.choice`)."""
    goals = []
    choice = fit.choice
    lo, hi = choice.n_opt_interval if choice is not None else fit.optimal.n_opt_interval
    goals.append(("N* 95% interval", f"{hi / lo:.2f}x (goal ≤ 1.5x)", hi / lo <= 1.5))
    exponents = choice.exponents if choice is not None else {k: fit.intervals[k] for k in ("alpha", "beta")}
    for k, (low, high) in exponents.items():
        goals.append((f"{k} 95% interval", f"width {high - low:.3f} (goal < 0.15)", high - low < 0.15))
    rung = fit.rung
    if rung is not None:
        half = (rung.interval[1] - rung.interval[0]) / 2 / rung.loss
        goals.append(("rung's law interval", f"±{half:.1%} (goal ±3%)", half <= 0.03))
        if rung.rel_error is not None:
            goals.append(("rung's loss", f"{rung.rel_error:.2%} off (goal ≤ 1%)", rung.rel_error <= 0.01))
        if rung.curve is not None and rung.curve.max_rel_error is not None:
            error = rung.curve.max_rel_error
            goals.append(("rung's curve", f"max {error:.2%} off (goal ≤ 1.5%)", error <= CURVE_TOLERANCE))
    return goals


def goal_lines(fit: ScalingFit) -> list[str]:
    goals = precision_goals(fit)
    met = [g for g in goals if g[2]]
    lines = [f"Precision goals: {len(met)} of {len(goals)} met"]
    lines += [f"  {'met    ' if ok else 'not met'} {what}: {value}" for what, value, ok in goals]
    return lines


def rung_lines(rung: Prediction | None) -> list[str]:
    """The rung's predicted loss (and task loss) with its interval, and once trained its measurement."""
    if rung is None:
        return []
    line = (
        f"Rung N={rung.n:,.0f}, D={rung.d:,.0f}: {rung.form.capitalize()}'s form predicted {rung.loss:.4f}, law 95% "
        f"[{rung.interval[0]:.4f}, {rung.interval[1]:.4f}]"
    )
    if rung.run_interval:
        line += f", a run 95% [{rung.run_interval[0]:.4f}, {rung.run_interval[1]:.4f}]"
    if rung.measured_loss is not None:
        verdict = "held" if rung.held else "did not hold"
        line += f", measured {rung.measured_loss:.4f} (error {rung.rel_error:.2%}: the prediction {verdict})"
    lines = [line]
    shape = rung.shape
    if shape is not None and shape.offset is not None:
        lines.append(
            f"  Its shape ({shape.depth} layers, {shape.width} wide) was swept: its {shape.runs} runs sat "
            f"{math.expm1(shape.raw):+.2%} from the law at the largest budget, {math.expm1(shape.offset):+.2%} after "
            f"shrinking toward the other shapes (sd {shape.sd:.2%}); the prediction includes it"
        )
    if rung.task_loss is not None:
        line = f"  HumanEval bits/byte predicted {rung.task_loss:.4f}"
        if rung.task_form is not None:
            line += f" by {rung.task_form.capitalize()}'s form"
        line += f", law 95% [{rung.task_interval[0]:.4f}, {rung.task_interval[1]:.4f}]"
        if rung.task_run_interval is not None:
            line += f", a run 95% [{rung.task_run_interval[0]:.4f}, {rung.task_run_interval[1]:.4f}]"
        if rung.measured_task_loss is not None:
            line += f", measured {rung.measured_task_loss:.4f} (error {rung.task_rel_error:.2%}"
            if rung.task_held is not None:
                line += f": the prediction {'held' if rung.task_held else 'did not hold'}"
            line += ")"
        if rung.task_floorless:
            line += f"; {FLOORLESS}"
        lines.append(line)
    curve = rung.curve
    if curve is not None:
        line = f"  Validation curve: {len(curve.steps)} evaluations predicted"
        if curve.band is not None:
            line += f" (95% of held-out sweep runs' points within ±{curve.band:.1%} of the law)"
        if curve.max_rel_error is not None:
            line += f", max error {curve.max_rel_error:.2%} (goal ≤ {CURVE_TOLERANCE:.1%})"
        if curve.seed_spread is not None:
            line += f"; one seed's curve strays {curve.seed_spread:.2%} from its seeds' mean (sweep median)"
        if curve.curve_law_end is not None:
            line += "; anchored to the point law"
            if curve.reference_warmup is not None:
                line += f" (its runs warm up for {curve.reference_warmup} steps)"
            line += f"; the curve law alone ends at {curve.curve_law_end:.4f}"
        others = ", ".join(f"{k} {v:.4f}" for k, v in curve.schedules.items())
        lines += [line, f"  The end point under other schedules: {others}"]
    second = rung.second_form
    if second is not None:
        line = f"  {second.form.capitalize()}'s form: predicted {second.loss:.4f}"
        if second.interval is not None and second.run_interval is not None:
            line += (
                f", law 95% [{second.interval[0]:.4f}, {second.interval[1]:.4f}], a run 95% "
                f"[{second.run_interval[0]:.4f}, {second.run_interval[1]:.4f}]"
            )
            if second.interval[1] < rung.interval[0] or rung.interval[1] < second.interval[0]:
                line += f" (apart from {rung.form.capitalize()}'s: the form, more than the noise, bounds this prediction)"
        if second.rel_error is not None:
            line += f", error {second.rel_error:.2%}"
        if second.heldout_mean_rel_error is not None:
            line += f" (on the held-out budget {second.heldout_mean_rel_error:.2%} off on average)"
        if second.n_opt is not None:
            line += f"; its compute-optimal N at the target {second.n_opt:.3g}"
            if second.n_opt_interval is not None:
                line += f" [{second.n_opt_interval[0]:.3g}, {second.n_opt_interval[1]:.3g}]"
        if second.floorless:
            line += f"; {FLOORLESS}"
        lines.append(line)
    return lines
