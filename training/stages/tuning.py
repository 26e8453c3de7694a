"""What the tuning stages (SFT, DPO) share: the check that encoded examples fit the base model, and the tuned
model's verified export (merged weights, plus the PEFT adapter for LoRA) with its artifact."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_pipeline.chat import chat_token_ids
from data_pipeline.sources import DataError
from data_pipeline.tokenizer import describe
from infra.steps import Artifact
from infra.storage import MANIFEST
from infra.tracking import Tracker
from training.config import LoraSettings
from training.model.config import ModelConfig
from training.model.export import export_hf
from training.model.hf_interop import load_hf_config, weight_folds
from training.model.lora import apply_lora, merged_state_dict, save_adapter, trainable_counts
from training.model.transformer import Transformer
from training.stages.lifecycle import TrainedModel, TrainingJob, TrainingStage, trained_model


def check_tokenizer(base: TrainedModel, data: Artifact, what: str) -> None:
    """Data encoded for a tuning stage (SFT examples, preference pairs, RL prompts) must use the base's tokenizer."""
    if base.tokenizer_digest != data.tokenizer_digest:
        raise DataError(
            f"the base model was trained with tokenizer {base.tokenizer_digest[:16]}... but the {what} {data.path} "
            f"was made with {data.tokenizer_digest[:16]}...; rebuild the {what} with the base's tokenizer"
        )


def check_examples(base: TrainedModel, data: Artifact, seq_len: int, what: str, section: str) -> None:
    """Encoded examples (SFT or preference pairs) must use the base's tokenizer and the stage's sequence length."""
    check_tokenizer(base, data, what)
    if data.seq_len != seq_len:
        raise DataError(
            f"the {what} has seq_len={data.seq_len}, {section}.train.seq_len={seq_len}; rebuild it with the "
            f"{section} sequence length"
        )


class TunedFromBase(TrainingStage):
    """A stage that starts from a finished run (`inputs["base"]`) and trains on data encoded for it
    (`inputs["data"]`: DPO's and the reward model's preference pairs, RL's prompts): their run tags, the data
    manifest they log, the base's model config."""

    def tags(self, spec: Any, inputs: Mapping[str, Artifact]) -> dict[str, str]:
        base = inputs["base"]
        return {
            "lmforge.base_run_id": str(base.mlflow_run_id),
            "lmforge.base_run_dir": base.path,
            "lmforge.data_digest": inputs["data"].digest(),
        }

    def log_inputs(self, inputs: Mapping[str, Artifact], tracker: Tracker) -> None:
        tracker.log_artifact(Path(inputs["data"].path) / MANIFEST, "data")

    def model_config(self, job: TrainingJob) -> ModelConfig:
        return load_hf_config(job.inputs["base"].hf_export)


@dataclass
class Tuned:
    """A fine-tuned model's final weights: the verified export, the adapter (LoRA), the model itself."""

    model: Transformer  # the tuned weights (merged for LoRA), fp32
    verification: dict[str, Any]
    adapter_dir: Path | None
    trainable: int
    total: int

    def counts(self, prefix: str) -> dict[str, float]:
        return {
            f"{prefix}/trainable_params": float(self.trainable),
            f"{prefix}/trainable_fraction": self.trainable / self.total,
        }

    def trained_model(
        self,
        job: TrainingJob,
        final: Path,
        tracker: Tracker,
        kind: str,
        summary: dict[str, float],
        **fields: Any,
    ) -> TrainedModel:
        """The run's artifact (the adapter logged and recorded when there is one)."""
        if self.adapter_dir is not None:
            tracker.log_artifact(self.adapter_dir, "adapter")
        adapter = str(self.adapter_dir.resolve()) if self.adapter_dir else None
        model = self.model.cfg.model_dump(mode="json")
        return trained_model(
            job,
            final,
            tracker,
            kind,
            self.verification,
            summary,
            model=model,
            adapter=adapter,
            summary=summary,
            **fields,
        )


def export_tuned(
    job: TrainingJob, final: Path, base: Transformer, method: str, lora: LoraSettings, base_export: str
) -> Tuned:
    """Load the final checkpoint onto `base` (wrapped in LoRA first when `method` is lora; `base` is changed in
    place), save the adapter pointing at `base_export`, and write the verified merged export to `<run>/hf`."""
    from training.parallel import fp32_state_dict

    cfg = base.cfg
    state = fp32_state_dict(final, tie_embeddings=False)
    tuned = apply_lora(base, lora, chat_token_ids(describe(Path(base_export)))) if method == "lora" else base
    trainable, total = trainable_counts(tuned)
    adapter_dir = None
    if method == "lora":
        tuned.load_state_dict(state, strict=True)
        adapter_dir = job.run_dir / "adapter"
        save_adapter(tuned, adapter_dir, base_export, weight_folds(cfg))
        weights = merged_state_dict(tuned)
    else:
        weights = state
        if cfg.tie_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    # the base's trained context (its export's), or this stage's windows when they are longer
    exported = cfg.trained_at(max(cfg.max_seq_len, job.spec.train.seq_len))
    verification = export_hf(weights, exported, base_export, job.run_dir / "hf")
    model = Transformer(exported, seed=None)
    model.load_state_dict(weights, strict=True)
    return Tuned(model.eval(), verification, adapter_dir, trainable, total)
