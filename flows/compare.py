"""`lmforge compare`: the same IsoFLOP ladder for two variants (recipes, or one recipe with two sets of
overrides), one scaling law each, and the compute multiplier between them (`evaluation/compute_multiplier.py`).

Both sweeps are the ordinary cached sweep stage, so a variant already swept (the pipeline's own ladder, say) is
reused. The comparison is a cached step in `<A's output_dir>/compare/<A>-vs-<B>-<hash>/` (keyed by both sweeps'
digests, the reference budget and the names; local or on object storage like every stage): comparison.json,
comparison.md and compare.png, logged to an MLflow run `compare-<A>-vs-<B>`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from evaluation.compare_plot import compare_plot
from evaluation.compute_multiplier import Comparison, compare_points
from evaluation.scaling_data import ScalingPoints
from flows.recipe import ConfigError, Recipe
from flows.runner import Runner
from flows.scaling import sweep_points
from infra.steps import Artifact, Step, run_step
from infra.storage import atomic_write_json
from infra.tracking import tracked_run

RESULT = "comparison.json"
COMPARE_VERSION = 2  # 2: each ladder fitted with its noise model (calibrated_fit)


def check_comparable(a: Recipe, b: Recipe, names: tuple[str, str]) -> None:
    """Losses compare only in one tokenizer on one corpus; both recipes need a ladder."""
    if a.data.tokenizer != b.data.tokenizer:
        raise ConfigError(
            f"compare needs one tokenizer: {names[0]} has data.tokenizer "
            f"{a.data.tokenizer.model_dump(mode='json')} but {names[1]} has {b.data.tokenizer.model_dump(mode='json')}; "
            "losses in different tokenizers are not comparable, give both the same data.tokenizer"
        )
    if a.data.model_dump(exclude={"num_workers"}) != b.data.model_dump(exclude={"num_workers"}):
        raise ConfigError(
            f"compare needs one corpus: the data sections of {names[0]} and {names[1]} differ; give both the same data"
        )
    for name, recipe in zip(names, (a, b), strict=True):
        if not recipe.sweep.budgets or not recipe.sweep.all_sizes():
            raise ConfigError(
                f"{name}: no IsoFLOP ladder to compare (sweep.budgets and sweep.depths/sizes are empty)"
            )


def reference_budget(a: Recipe, b: Recipe, budget: float | None) -> float:
    """The budget the multiplier is read at: given, else the largest one both ladders swept."""
    return budget or float(min(max(a.sweep.budgets), max(b.sweep.budgets)))


class Compared(Artifact):
    """A finished comparison; its comparison.json holds the multiplier, its interval and both laws (read from the
    file, where an interval the bootstrap could not bound stays NaN)."""

    def summary(self) -> dict[str, Any]:
        return json.loads((Path(self.path) / RESULT).read_text()) | {"path": self.path}


def run_compare(
    a: Recipe,
    b: Recipe,
    names: tuple[str, str],
    run: Runner,
    budget: float | None = None,
    n_bootstrap: int = 1000,
) -> dict[str, Any]:
    """Sweep both (cached), fit both, and write/return the comparison: a cached step of its own in A's output
    directory (local or object storage), keyed by both sweeps' digests, the budget and the names."""
    from flows.registry import resolve

    check_comparable(a, b, names)
    results = [resolve("sweep", recipe, run).done["sweep"] for recipe in (a, b)]
    c_ref = reference_budget(a, b, budget)
    config = {"c_ref": c_ref, "n_bootstrap": n_bootstrap, "names": list(names)}
    step = Step(
        "compare",
        f"{names[0]}-vs-{names[1]}",
        COMPARE_VERSION,
        config,
        Compared,
        {"a": results[0], "b": results[1]},
    )

    def build(out: Path, key: str) -> Compared:
        points = (sweep_points(results[0].results), sweep_points(results[1].results))
        sweeps = {name: r.results for name, r in zip(names, results, strict=True)}
        write_comparison(points, names, c_ref, n_bootstrap, out, a, sweeps)
        return Compared(path=str(out))

    return run_step(a.output_dir, step, build).summary()


def write_comparison(
    points: tuple[ScalingPoints, ScalingPoints],
    names: tuple[str, str],
    c_ref: float,
    n_bootstrap: int,
    out: Path,
    recipe: Recipe,
    sweeps: dict[str, str],
) -> dict[str, Any]:
    """Fit both ladders, write comparison.md, compare.png and comparison.json into `out`, log them to an MLflow
    run in `recipe`'s tracking store; returns the summary."""
    comparison = compare_points(*points, c_ref, n_bootstrap)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "a": names[0],
        "b": names[1],
        **comparison.as_dict(),
        "sweeps": sweeps,
        "points": {name: len(p) for name, p in zip(names, points, strict=True)},
        "warnings": fit_warnings(comparison, names),
        "path": str(out),
    }
    compare_plot(comparison, points, names, out / "compare.png")
    (out / "comparison.md").write_text(markdown(summary))
    tags = {"lmforge.stage": "compare", "lmforge.config_digest": out.name.rsplit("-", 1)[-1]}
    with tracked_run(
        recipe.tracking, recipe.output_dir, f"compare-{names[0]}-vs-{names[1]}", tags
    ) as tracked:
        tracker = tracked.tracker()
        tracker.log_params({"a": names[0], "b": names[1], "c_ref": c_ref, "bootstrap": n_bootstrap})
        low, high = comparison.interval
        tracker.log_metrics(
            {"multiplier": comparison.multiplier, "multiplier_low": low, "multiplier_high": high}, 0
        )
        for name in ("compare.png", "comparison.md"):
            tracker.log_artifact(out / name, "compare")
        summary["mlflow_run_id"] = tracked.run_id
    atomic_write_json(out / RESULT, summary)
    return summary


def fit_warnings(comparison: Comparison, names: tuple[str, str]) -> list[str]:
    """What makes the multiplier untrustworthy: resamples that did not converge, an irreducible loss near 0."""
    warnings = []
    for name, boot, law in (
        (names[0], comparison.boot_a, comparison.law_a),
        (names[1], comparison.boot_b, comparison.law_b),
    ):
        if boot.n < 0.5 * (boot.n + boot.n_diverged):
            warnings.append(
                f"{name}: {boot.n_diverged} of {boot.n + boot.n_diverged} bootstrap refits ran off; its ladder is too "
                "small or too noisy for a five-parameter law (add sizes or budgets)"
            )
        if law.E < 0.1 or max(law.alpha, law.beta) > 5:
            warnings.append(
                f"{name}: a degenerate law (E={law.E:.3g}, α={law.alpha:.3g}, β={law.beta:.3g}); its runs are too short "
                "or too few to pin it down, so the multiplier extrapolates"
            )
    return warnings


def markdown(summary: dict[str, Any]) -> str:
    a, b = summary["a"], summary["b"]
    low, high = summary["interval"]
    lines = [
        f"# Compute multiplier: {a} vs {b}",
        "",
        f"**{a} needs {summary['multiplier']:.3g}x the compute of {b}** ({100 * summary['level']:.0f}% bootstrap "
        f"interval [{low:.3g}, {high:.3g}], {summary['bootstrap_pairs']} paired resamples) to reach {b}'s "
        f"compute-optimal loss at C = {summary['c_ref']:.3g} FLOPs ({summary['loss_b_at_c_ref']:.4f}; {a} reaches "
        f"{summary['loss_a_at_c_ref']:.4f} there). Above 1, {b} is the more compute-efficient choice.",
        "",
        "| | E | A | B | α | β | sweep points |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, key in ((a, "law_a"), (b, "law_b")):
        law = summary[key]
        lines.append(
            f"| {name} | {law['E']:.4f} | {law['A']:.4g} | {law['B']:.4g} | {law['alpha']:.3f} | {law['beta']:.3f} "
            f"| {summary['points'][name]} |"
        )
    lines += ["", *(f"- warning: {w}" for w in summary["warnings"])]
    return "\n".join(lines) + "\n"
