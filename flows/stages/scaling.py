"""The scaling stages (the recipe's `sweep:`): `sweep` trains the IsoFLOP ladder as Ray Tune trials, `fit` fits
L(N, D) to it and sizes the model for the target budget (every later stage trains that size), `rung` checks
the prediction the fit made for that model against its measured loss once it has trained."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.stage_def import Inputs, StageDef
from training.config import SweepConfig

if TYPE_CHECKING:
    from evaluation.scaling_report import ScalingFit
    from flows.recipe import Recipe
    from flows.runner import TrialProgress
    from training.stages.sweep import SweepResult


def run_sweep(recipe: Recipe, inputs: Inputs, progress: TrialProgress | None) -> SweepResult:
    from training.stages.sweep import run_sweep

    return run_sweep(recipe.sweep_spec(), inputs["data"], progress=progress)


def check_sweep(recipe: Recipe) -> None:
    from training.stages.sweep import planned_trials

    planned_trials(recipe.sweep_spec())


def sweep_report(recipe: Recipe, inputs: Inputs, result: SweepResult) -> str:
    lines = [f"left out   {line}" for line in result.skipped]
    lines.append(
        f"results   {result.results} ({result.n_completed} completed, {result.n_stopped} stopped early)"
    )
    if result.overhead:
        lines.append(
            f"overhead  Tune wall {result.wall_seconds:.1f} s / trials {result.trial_seconds:.1f} s = "
            f"{result.overhead:.3f}"
        )
    lines.append(f"mlflow    run {result.mlflow_run_id}")
    lines.append(
        f"points    {result.n_points} (N, D) points from {result.n_completed} runs; points per FLOP "
        f"{result.points_per_flop_gain:.2f}x a one-run-per-point design"
    )
    lines += [f"warning   {warning}" for warning in result.warnings]
    return "\n".join(lines)


SWEEP: StageDef[SweepResult] = StageDef(
    name="sweep",
    help="scaling sweep: Ray Tune trials over (budget, size)",
    run=run_sweep,
    needs={"data": "tokenize"},
    section="sweep",
    config=SweepConfig,
    progress="trials",
    preflight=check_sweep,
    headline=lambda r: {
        "trials": r.n_trials,
        "completed": r.n_completed,
        "points": r.n_points,
        "points per FLOP vs one run per point": round(r.points_per_flop_gain, 3),
        "results": r.results,
    },
    report=sweep_report,
    tags=("gpu",),
)


def run_fit(recipe: Recipe, inputs: Inputs, progress: Any) -> ScalingFit:
    from flows.scaling import fit_sweep

    return fit_sweep(recipe, inputs["sweep"], inputs["data"])


def sized(recipe: Recipe, inputs: Inputs, law: ScalingFit) -> tuple[Recipe, str]:
    """The recipe at the size nearest the chosen law form's N* for the target budget (or the swept shape the fit
    chose for the rung by its offset from the law), and why that size."""
    import pyarrow.parquet as pq

    from flows.scaling import size_for_budget

    sizes = [row["N"] for row in pq.read_table(inputs["sweep"].results, columns=["N"]).to_pylist()]
    shape = (law.rung.shape.depth, law.rung.shape.width) if law.rung and law.rung.shape else None
    final, note = size_for_budget(
        recipe, law.sizing_n_opt, law.optimal.budget, (min(sizes), max(sizes)), shape
    )
    return final.override({"name": f"{recipe.name}-optimal"}), note


def fit_report(recipe: Recipe, inputs: Inputs, law: ScalingFit) -> str:
    from evaluation.scaling_report import headline

    chosen = sized(recipe, inputs, law)[1]
    return f"Scaling law (sweep → fit):\n{headline(law)}\nChosen size: {chosen}\nfit       {law.path}"


def fit_headline(law: ScalingFit) -> dict[str, Any]:
    """The law with its exponents' intervals, both approaches' N* and the rung's prediction (and measurement)."""
    numbers: dict[str, Any] = {k: round(v, 4) for k, v in law.law.items()}
    numbers |= {f"{k} 95%": [round(x, 4) for x in law.intervals[k]] for k in ("alpha", "beta")}
    numbers |= {"N* (Approach 3)": round(law.optimal.n_opt), "N* (Approach 2)": law.approach2_n_opt}
    if law.choice is not None:
        numbers |= {"law form": law.choice.form, "N* (the form's, sizing)": round(law.choice.n_opt)}
    rung = law.rung
    if rung is not None:
        numbers |= {"rung predicted loss": round(rung.loss, 4), "rung 95% interval": list(rung.interval)}
        numbers |= {"rung 95% prediction interval (a run)": list(rung.check_interval)}
        numbers |= {"rung measured loss": rung.measured_loss, "fit/rung_rel_error": rung.rel_error}
        numbers |= {"prediction held": rung.held}
        if rung.curve is not None:
            numbers |= {"rung curve max error": rung.curve.max_rel_error}
        if rung.task_loss is not None:
            numbers |= {
                "rung predicted HumanEval bits/byte": round(rung.task_loss, 4),
                "rung measured HumanEval bits/byte": rung.measured_task_loss,
                "task rel error": rung.task_rel_error,
                "task prediction held": rung.task_held,
            }
    return numbers


FIT: StageDef[ScalingFit] = StageDef(
    name="fit",
    help="fit Chinchilla's and Kaplan's laws to the sweep; size the model for the target budget by the one closer on the held-out budget",
    run=run_fit,
    needs={"sweep": "sweep", "data": "tokenize"},
    section="sweep",
    headline=fit_headline,
    report=fit_report,
    refine=lambda recipe, inputs, law: sized(recipe, inputs, law)[0],
)


def run_rung(recipe: Recipe, inputs: Inputs, progress: Any) -> ScalingFit:
    from flows.lineage import record_fit
    from flows.scaling import check_rung

    checked = check_rung(recipe, inputs["sweep"], inputs["law"], inputs["model"])
    record_fit(recipe, checked, Path(checked.path), checked.optimal.budget)
    return checked


def rung_outputs(recipe: Recipe, inputs: Inputs, law: ScalingFit) -> dict[str, str]:
    return {"scaling fit": str(Path(law.path) / "fit.json"), "scaling plots": str(Path(law.path) / "*.png")}


def rung_report(recipe: Recipe, inputs: Inputs, law: ScalingFit) -> str:
    from evaluation.scaling_report import choice_lines, goal_lines, rung_lines

    lines = choice_lines(law) + rung_lines(law.rung) + goal_lines(law)
    return "The rung (the model trained at the fitted size):\n" + "\n".join(lines)


RUNG: StageDef[ScalingFit] = StageDef(
    name="rung",
    help="sweep, fit, pretrain at the fitted compute-optimal size, and check the loss the fit predicted for it",
    run=run_rung,
    needs={"sweep": "sweep", "law": "fit", "model": "pretrain"},
    section="sweep",
    headline=fit_headline,
    report=rung_report,
    outputs=rung_outputs,
)
