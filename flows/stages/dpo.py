"""`dpo`: preference tuning of the fine-tuned (or pretrained) model (the recipe's `dpo:`); its helper steps encode
the preference pairs (`preference_data`, the recipe's `data.preference:`) and score them once under the frozen
reference (`reference_logps`), so training holds one model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flows.stage_def import Given, Inputs, StageDef, Toggle
from flows.stages.runs import describe_tuned, exported, load_model
from training.config import DPOConfig

if TYPE_CHECKING:
    from data_pipeline.preference import PreferenceManifest
    from flows.recipe import Recipe
    from flows.runner import StepProgress
    from training.stages.dpo import ReferenceLogps
    from training.stages.lifecycle import TrainedModel

BASE = ("sft", "pretrain")  # the fine-tuned model when there is one
GIVEN_BASE = Given(
    "base",
    "base",
    load_model,
    "a fine-tuned (or pretrained) run directory (default: this recipe's, trained if missing)",
)


def preference_data(recipe: Recipe, base: TrainedModel) -> PreferenceManifest:
    """Preference pairs (derived from the SFT conversations, or the user's file) encoded with the base's
    tokenizer at the preference-tuning sequence length."""
    from data_pipeline.preference import derive_pairs, read_pairs, run_preference_data
    from data_pipeline.sft import sft_examples as conversations
    from data_pipeline.tokenizer import describe

    cfg = recipe.data.preference
    if cfg.source == "derived":
        pairs = derive_pairs(conversations(recipe.data.sft), cfg.rejected, cfg.seed)
    else:
        pairs = read_pairs(Path(cfg.source))
    tokenizer = describe(Path(exported(base)))
    return run_preference_data(
        cfg, pairs[: cfg.max_pairs], tokenizer, recipe.dpo.train.seq_len, recipe.output_dir
    )


def check_pairs(recipe: Recipe) -> None:
    """A user's pairs file is read and checked before anything in the plan trains (not after SFT)."""
    from data_pipeline.preference import read_pairs

    if recipe.data.preference.source != "derived":
        read_pairs(Path(recipe.data.preference.source))


def reference_logps(recipe: Recipe, base: TrainedModel, pairs: PreferenceManifest) -> ReferenceLogps:
    from training.stages.dpo import run_reference_logps

    return run_reference_logps(pairs, base, recipe.output_dir)


def heldout(pairs: PreferenceManifest) -> str:
    """The held-out pairs (the evaluation's preference task)."""
    return str(Path(pairs.path) / "heldout.jsonl")


PREFERENCE_DATA: StageDef[PreferenceManifest] = StageDef(
    name="preference_data",
    help="preference pairs encoded with the base model's tokenizer",
    run=lambda recipe, inputs, progress: preference_data(recipe, inputs["base"]),
    needs={"base": BASE},
    section="data",
    command=False,
    flow=False,
)

REFERENCE_LOGPS: StageDef[ReferenceLogps] = StageDef(
    name="reference_logps",
    help="the frozen reference model's log-probabilities of every pair",
    run=lambda recipe, inputs, progress: reference_logps(recipe, inputs["base"], inputs["pairs"]),
    needs={"base": BASE, "pairs": "preference_data"},
    command=False,
    flow=False,
)


def run(recipe: Recipe, inputs: Inputs, progress: StepProgress | None) -> TrainedModel:
    from training.stages.dpo import run_dpo

    return run_dpo(recipe.dpo_spec(), inputs["base"], inputs["pairs"], inputs["reference"], progress=progress)


def report(recipe: Recipe, inputs: Inputs, model: TrainedModel) -> str:
    pairs = inputs["pairs"]
    counts = ", ".join(f"{k} {v}" for k, v in pairs.counts.items())
    return f"pairs      {pairs.path} ({counts})\n{describe_tuned(model)}"


DPO: StageDef[TrainedModel] = StageDef(
    name="dpo",
    help="preference tuning (DPO, IPO, hinge, length-normalised) of a fine-tuned model",
    run=run,
    needs={"base": BASE, "pairs": "preference_data", "reference": "reference_logps"},
    section="dpo",
    config=DPOConfig,
    progress="steps",
    total=lambda recipe, inputs: recipe.dpo.train.max_steps,
    headline=lambda model: dict(model.summary),
    report=report,
    outputs=lambda recipe, inputs, model: {"preference-tuned model": model.hf_export},
    models=lambda model: {model.kind: model},
    toggle=Toggle(
        "dpo",
        False,
        "Preference-tune (DPO)",
        "DPO on preference pairs after fine-tuning (dpo.loss: sigmoid, ipo, hinge, sigmoid_norm); the registry then "
        "gates the DPO model against the fine-tuned one",
    ),
    given=GIVEN_BASE,
    tags=("gpu",),
    preflight=check_pairs,
)
