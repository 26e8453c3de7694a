"""The register stage: gates from the evaluation report, then the MLflow registry."""

from __future__ import annotations

from evaluation.gates import gate_results
from evaluation.report import EvalReport
from flows.recipe import Recipe
from infra.registry import RegisteredVersion, register
from training.stage import TrainedModel


def register_final(
    recipe: Recipe, ref: TrainedModel, report: EvalReport, base_name: str | None
) -> RegisteredVersion:
    """Gate the model on the report; register it (alias only when every gate passes)."""
    names = list(report.models)
    gates = gate_results(report, names[-1], base_name, ref, recipe.eval)
    name = recipe.eval.register_name or f"lmforge-{recipe.name.removesuffix('-optimal')}"
    lines = [
        f"{m}: {v.get(names[-1])}"
        for m, v in report.metrics.items()
        if m.startswith(("heldout/all", "sft-heldout", "stdlib"))
    ]
    return register(
        recipe.tracking,
        recipe.output_dir,
        ref,
        name,
        recipe.eval.alias,
        gates,
        report.path,
        "\n".join(lines),
    )
