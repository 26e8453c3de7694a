"""The register stage: gates from the evaluation report, then the MLflow registry."""

from __future__ import annotations

from typing import TYPE_CHECKING

from evaluation.config import LOSS
from evaluation.frontier import Frontier
from evaluation.gates import gate_results
from evaluation.report import EvalReport
from evaluation.scaling_report import ScalingFit
from infra.errors import UserError
from infra.registry import RegisteredVersion, register
from training.compress.config import QUANTIZED
from training.model.hf_interop import load_hf_config, no_llama_layout
from training.stages.compress import Compressed
from training.stages.lifecycle import TrainedModel

if TYPE_CHECKING:
    from flows.recipe import Recipe


def register_final(
    recipe: Recipe,
    ref: TrainedModel,
    report: EvalReport,
    base_name: str | None,
    scaling: ScalingFit | None = None,
    candidate: str | None = None,
) -> RegisteredVersion:
    """Gate the model (`candidate` in the report, default its last model) against `base_name`; register it
    (alias only when every gate passes), tagged with whether the scaling law's prediction for its pretrained
    base held. A model without a Llama layout is refused: the registry serves Hugging Face models."""
    cfg = load_hf_config(ref.hf_export)
    if not cfg.has_llama_layout:
        raise UserError(
            f"{ref.path}: not registered: {no_llama_layout(cfg)}; the registry serves Hugging Face models"
        )
    candidate = candidate or list(report.models)[-1]
    gates, skipped = gate_results(report, candidate, base_name, ref, recipe.eval)
    name = recipe.eval.register_name or f"lmforge-{recipe.name.removesuffix('-optimal')}"
    lines = [
        f"{m}: {v.get(candidate)}"
        for m, v in report.metrics.items()
        if m.startswith(("heldout/all", "sft-heldout", "preference-heldout", "stdlib"))
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
        scaling_tags(scaling) | ({"source_model": ref.source_model} if ref.source_model else {}),
        skipped,
    )


def register_compressed(
    recipe: Recipe, frontier: Frontier, compressed: Compressed
) -> RegisteredVersion | None:
    """Register the frontier's chosen variant (the smallest within the held-out loss tolerance, export verified)
    under `compress.alias`; None when no variant qualifies."""
    if frontier.chosen is None:
        return None
    row = frontier.record(frontier.chosen)
    record = next(r for r in compressed.variants if r.name == frontier.chosen)
    gates = {"export_verified": record.export_valid, f"{LOSS} within {frontier.tolerance:g}": True}
    lines = [
        f"{frontier.chosen}: {row['served_ratio']:.2f}x the served size of {compressed.base_run_dir} "
        f"({row['size_ratio']:.2f}x in lmforge's own storage)"
    ]
    lines += [
        f"{m}: {row['metrics'][m]} ({100 * row['relative'].get(m, 0.0):+.2f}%)"
        for m in (LOSS, "heldout/all/bits_per_byte")
    ]
    name = recipe.eval.register_name or f"lmforge-{recipe.name.removesuffix('-optimal')}"
    return register(
        recipe.tracking,
        recipe.output_dir,
        record.model_copy(update={"mlflow_run_id": row["mlflow_run_id"]}),
        name,
        frontier.alias,
        gates,
        frontier.path,
        "\n".join(lines),
        {"lmforge.compression": record.method, "lmforge.base_run_dir": compressed.base_run_dir},
        requirements=("torchao",) if record.method in QUANTIZED else (),
    )


def scaling_tags(scaling: ScalingFit | None) -> dict[str, str]:
    rung = scaling.rung if scaling else None
    if rung is None or rung.measured_loss is None:
        return {}
    return {
        "scaling.prediction_held": str(rung.held).lower(),
        "scaling.predicted_loss": f"{rung.loss:.4f} [{rung.check_interval[0]:.4f}, {rung.check_interval[1]:.4f}]",
        "scaling.measured_loss": f"{rung.measured_loss:.4f}",
        "scaling.rel_error": f"{rung.rel_error:.4f}",
    }
