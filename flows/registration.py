"""The register stage: gates from the evaluation report, then the MLflow registry."""

from __future__ import annotations

from typing import Any

from evaluation.gates import gate_results
from infra.registry import RegisteredVersion, register


def register_final(recipe: Any, ref: Any, report: Any, base_name: str | None) -> RegisteredVersion:
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
        report.out_dir,
        "\n".join(lines),
    )
