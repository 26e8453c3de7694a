"""Stage 5: `eval` scores every model the enabled stages made side by side (held-out loss and bits per byte,
tasks, samples; the recipe's `eval:`); `register` gates the last tuned model on that report and puts it in the
MLflow registry, and with compression on, the smallest variant within tolerance too."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from evaluation.config import EvalConfig
from flows.stage_def import Given, Inputs, StageDef, Toggle
from flows.stages.dpo import heldout as pairs_heldout
from flows.stages.runs import load_models
from flows.stages.sft import heldout as sft_heldout
from infra.config import ConfigError
from infra.registry import RegisteredVersion

if TYPE_CHECKING:
    from evaluation.report import EvalReport
    from flows.recipe import Recipe

# the numbers the summary and the stage's Prefect artifact show
HEADLINE = (
    "heldout/all/bits_per_byte",
    "heldout/all/loss",
    "stdlib-import-mc/acc",
    "sft-heldout-em/exact_match",
    "sft-heldout-em/response_loss",
    "preference-heldout/accuracy",
    "rl/heldout_reward",
    "rl/heldout_reward_gain_low",
)


def run_eval(recipe: Recipe, inputs: Inputs, progress: Any) -> EvalReport:
    from evaluation.report import run_eval

    names, models = zip(*inputs["models"], strict=True)
    sft = sft_heldout(inputs["sft_data"]) if "sft_data" in inputs else None
    pairs = pairs_heldout(inputs["pairs"]) if "pairs" in inputs else None
    return run_eval(recipe.eval_spec(), list(models), list(names), sft_heldout=sft, preference_heldout=pairs)


def eval_headline(report: EvalReport) -> dict[str, Any]:
    return {m: report.metrics[m] for m in HEADLINE if m in report.metrics}


def eval_report(recipe: Recipe, inputs: Inputs, report: EvalReport) -> str:
    lines = [f"Evaluation (full table in {Path(report.path) / 'report.md'}):"]
    for metric, values in eval_headline(report).items():
        lines.append(f"  {metric:<32} " + "   ".join(f"{name} {value:.4f}" for name, value in values.items()))
    return "\n".join(lines)


EVAL: StageDef[EvalReport] = StageDef(
    name="eval",
    help="stage 5: evaluate models side by side (loss, bits/byte, tasks, samples)",
    run=run_eval,
    wants={"sft_data": "sft_data", "pairs": "preference_data"},
    collects=True,
    section="eval",
    config=EvalConfig,
    headline=eval_headline,
    report=eval_report,
    outputs=lambda recipe, inputs, report: {"eval report": str(Path(report.path) / "report.md")},
    given=Given(
        "runs", "models", load_models, "finished run directories to compare, in this order", many=True
    ),
    command=False,  # `lmforge eval RECIPE RUN ...` (flows/cli_eval.py) evaluates any runs
)


class Registered(BaseModel):
    """What the register stage did: the gated model's version and, with compression, the chosen variant's."""

    final: RegisteredVersion
    compressed: RegisteredVersion | None = None


def needs_llama_layout(stage: str) -> Any:
    def check(recipe: Recipe) -> None:
        if not recipe.model.has_llama_layout:
            raise ConfigError(
                f"model.attention={recipe.model.attention} has no Hugging Face layout, which {stage} needs; leave "
                f"the {stage} stage out (pipeline: --no-register, no --compress) or use model.attention=softmax"
            )

    return check


def run_register(recipe: Recipe, inputs: Inputs, progress: Any) -> Registered:
    """Gate the candidate against the model it was tuned from (its column in the report), and each tuned model before
    it against its own base, register it; then the frontier's chosen compressed variant, when compression ran."""
    from flows.lineage import record_register
    from flows.registration import register_compressed, register_final

    model, report = inputs["model"], inputs["report"]
    name = report.column(model.path)
    version = register_final(
        recipe, model, report, report.column(model.base_run_dir), inputs.get("law"), name
    )
    record_register(recipe, version, model)
    front = inputs.get("frontier")
    compressed = register_compressed(recipe, front, inputs["variants"]) if front is not None else None
    return Registered(final=version, compressed=compressed)


def register_headline(done: Registered) -> dict[str, Any]:
    v = done.final
    numbers = {"model": v.name, "version": v.version, "alias": v.alias, **v.gates}
    if done.compressed is not None:
        numbers["compressed version"] = f"{done.compressed.version} ({done.compressed.alias})"
    return numbers


def register_report(recipe: Recipe, inputs: Inputs, done: Registered) -> str:
    from evaluation.gates import describe_gates

    v = done.final
    lines = [f"Registered: {v.name} v{v.version} (alias: {v.alias or 'not set, a gate failed'})"]
    lines.append(f"  gates: {describe_gates(v.gates, v.skipped)}")
    if done.compressed is not None:
        c = done.compressed
        lines.append(f"  registered {c.name} v{c.version} (alias: {c.alias})")
    return "\n".join(lines)


REGISTER: StageDef[Registered] = StageDef(
    name="register",
    help="gate the last tuned model on the evaluation and register it in MLflow (alias when the gates pass)",
    run=run_register,
    needs={"report": "eval", "model": ("rl", "dpo", "sft", "pretrain")},
    wants={"law": "rung", "variants": "compress", "frontier": "frontier"},
    section="eval",
    headline=register_headline,
    report=register_report,
    preflight=needs_llama_layout("register"),
    # (the field is not `register`: pydantic models have a `register` method)
    toggle=Toggle(
        "register_model", True, "Register", "log the final model to the MLflow registry", flag="register"
    ),
)
