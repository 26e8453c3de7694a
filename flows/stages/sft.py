"""Stage 3, `sft`: supervised fine-tuning of the pretrained model on conversations (the recipe's `sft:`), full or
LoRA, response tokens only; its helper step `sft_data` encodes the examples with the base's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.stage_def import Given, Inputs, StageDef, Toggle
from flows.stages.runs import describe_tuned, exported, load_model
from training.config import SFTConfig

if TYPE_CHECKING:
    from data_pipeline.sft import SFTManifest
    from flows.recipe import Recipe
    from flows.runner import StepProgress
    from training.stages.lifecycle import TrainedModel


def sft_examples(recipe: Recipe, tokenizer_dir: str | Path, seq_len: int | None = None) -> SFTManifest:
    """SFT examples encoded with the given tokenizer at `seq_len` (default: the fine-tuning sequence length)."""
    from data_pipeline.sft import run_sft_data
    from data_pipeline.tokenizer import describe

    seq_len = seq_len or recipe.sft.train.seq_len
    return run_sft_data(recipe.data.sft, describe(Path(tokenizer_dir)), seq_len, recipe.output_dir)


def sft_data(recipe: Recipe, base: TrainedModel) -> SFTManifest:
    """The SFT examples in the base model's tokenizer."""
    return sft_examples(recipe, exported(base))


def heldout(examples: SFTManifest) -> str:
    """The held-out conversations (the evaluation's exact-match task)."""
    return str(Path(examples.path) / "heldout.jsonl")


SFT_DATA: StageDef[SFTManifest] = StageDef(
    name="sft_data",
    help="SFT examples encoded with the base model's tokenizer",
    run=lambda recipe, inputs, progress: sft_data(recipe, inputs["base"]),
    needs={"base": "pretrain"},
    section="data",
    command=False,
    flow=False,
)


def run(recipe: Recipe, inputs: Inputs, progress: StepProgress | None) -> TrainedModel:
    from training.stages.sft import run_sft

    return run_sft(recipe.sft_spec(), inputs["base"], inputs["data"], progress, inputs["corpus"])


def outputs(recipe: Recipe, inputs: Inputs, model: TrainedModel) -> dict[str, Any]:
    return {"fine-tuned model": model.hf_export, **({"LoRA adapter": model.adapter} if model.adapter else {})}


SFT: StageDef[TrainedModel] = StageDef(
    name="sft",
    help="stage 3: supervised fine-tuning, LoRA or full (--set sft.method=full)",
    run=run,
    needs={"base": "pretrain", "data": "sft_data", "corpus": "tokenize"},  # corpus: sft.replay_rows' windows
    section="sft",
    config=SFTConfig,
    progress="steps",
    total=lambda recipe, inputs: recipe.sft.train.max_steps,
    headline=lambda model: dict(model.summary),
    report=lambda recipe, inputs, model: describe_tuned(model),
    outputs=outputs,
    models=lambda model: {model.kind: model},
    toggle=Toggle(
        "sft",
        True,
        "Fine-tune (SFT)",
        "supervised fine-tuning of the pretrained model (sft.method: lora or full)",
    ),
    given=Given(
        "base",
        "base",
        load_model,
        "a pretraining run directory (default: this recipe's run, trained if missing)",
    ),
    tags=("gpu",),
)
