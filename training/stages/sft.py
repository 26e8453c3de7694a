"""Stage 3: supervised fine-tuning, full or LoRA, of a pretrained model, as a stage over the one lifecycle.

`run_sft(spec, base, data) -> TrainedModel`: the same engine and loop as pretraining, fed SFT batches whose
targets cover only assistant tokens (the loss is the mean over the step's response tokens), with `sft.replay_rows`
windows of the base's pretraining text stacked under each micro-batch (their tokens join the mean). Before and after
training it measures the held-out response-token loss (the loop's val/loss at the first and last step) and
exact match of greedy answers to held-out prompts. Outputs: for LoRA a PEFT adapter directory (loads on the
base's Hugging Face export with `PeftModel.from_pretrained`, verified) plus a merged export; for full SFT an
export. Both exports are verified against our model's logits like every export.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from data_pipeline.chat import Messages, chat_format, chat_token_ids
from data_pipeline.loader import MixedLoader, PackedLoader, SampledLoader
from data_pipeline.sft import SFTLoader, SFTManifest
from data_pipeline.shards import DatasetManifest, token_counts
from data_pipeline.sources import DataError
from data_pipeline.tokenizer import TokenizerRef, describe
from infra.steps import Artifact
from infra.storage import atomic_write_json
from infra.tracking import Tracker
from training.config import SFTSpec
from training.loop import Batches
from training.model.config import ModelConfig
from training.model.hf_interop import load_export, load_hf_config
from training.model.lora import apply_lora, start_unseen_rows
from training.model.sampling import greedy_each
from training.model.transformer import Transformer
from training.stages.lifecycle import (
    Progress,
    TrainedModel,
    TrainingJob,
    TrainingStage,
    run_training_stage,
    val_losses,
)
from training.stages.tuning import check_examples, export_tuned

log = logging.getLogger(__name__)


def base_config(base: TrainedModel) -> ModelConfig:
    """The base's architecture at the context it was trained on: its export's `max_seq_len`, not its manifest's
    (the recipe's `model.max_seq_len`, which may be longer than the windows it saw). The tuned model is exported,
    evaluated and served at that context, or at this stage's windows where they are longer."""
    return ModelConfig(**base.model).trained_at(load_hf_config(base.hf_export).max_seq_len)


def base_model(base: TrainedModel) -> Transformer:
    """The pretrained model in fp32 from its final checkpoint (an imported one's: its export)."""
    from training.parallel import fp32_state_dict

    cfg = base_config(base)
    if base.kind == "imported":
        return load_export(base.hf_export).train()
    model = Transformer(cfg, seed=None)
    model.load_state_dict(fp32_state_dict(Path(base.checkpoint), cfg.tie_embeddings), strict=True)
    return model


def build_model(base: TrainedModel, spec: SFTSpec, corpus: DatasetManifest | None = None) -> nn.Module:
    """The base, with adapters and trainable chat-token rows for LoRA; the chat tokens pretraining never saw in
    `corpus` (the base's own token shards) start apart from one another (`start_unseen_rows`)."""
    model = base_model(base)
    tokens = chat_token_ids(describe(Path(base.hf_export)))
    tuned = apply_lora(model, spec.lora, tokens) if spec.method == "lora" else model
    own_corpus = corpus is not None and corpus.tokenizer.digest == base.tokenizer_digest
    trains_rows = spec.method == "full" or spec.lora.train_chat_tokens
    if own_corpus and trains_rows and base.kind == "pretrain":
        seen = token_counts(corpus, model.cfg.vocab_size) > 0
        fresh = start_unseen_rows(tuned, tokens, seen, spec.train.seed)
        log.info(
            "SFT: %d chat tokens pretraining never saw start at the seen rows' mean plus noise", len(fresh)
        )
    return tuned


class SFT(TrainingStage):
    name = "sft"
    version = 4  # 4: chat-token rows trained (LoRA) and those pretraining never saw started apart

    def check(self, spec: SFTSpec, inputs: Mapping[str, Artifact]) -> None:
        base, data = inputs["base"], inputs["data"]
        assert isinstance(base, TrainedModel) and isinstance(data, SFTManifest)
        check_examples(base, data, spec.train.seq_len, "SFT data", "sft")
        if spec.replay_rows:
            replay = inputs.get("replay")
            if not isinstance(replay, DatasetManifest):
                raise DataError(
                    f"sft.replay_rows={spec.replay_rows} replays pretraining text, but no token shards were given; "
                    "pass the base's tokenized corpus or set sft.replay_rows=0"
                )
            replay.check_tokenizer(base.tokenizer_digest)

    def run_name(self, spec: SFTSpec) -> str:
        return f"{spec.name}-{spec.method}"

    def tags(self, spec: SFTSpec, inputs: Mapping[str, Artifact]) -> dict[str, str]:
        base = inputs["base"]
        return {
            "lmforge.method": spec.method,
            "lmforge.base_run_id": str(base.mlflow_run_id),
            "lmforge.base_run_dir": base.path,
        }

    def model_config(self, job: TrainingJob) -> ModelConfig:
        return base_config(job.inputs["base"])

    def build_model(self, job: TrainingJob) -> nn.Module:
        return build_model(job.inputs["base"], job.spec, job.inputs.get("corpus"))

    def loaders(self, job: TrainingJob, rank: int, world: int) -> tuple[Batches, SampledLoader | None]:
        data: SFTManifest = job.inputs["data"]
        common = {
            "batch_size": job.spec.train.micro_batch_size,
            "rank": rank,
            "world_size": world,
            "tokenizer_digest": job.inputs["base"].tokenizer_digest,
        }
        accumulation = job.spec.train.grad_accum_steps(world)
        train = SFTLoader(data, "train", seed=job.spec.train.seed, accumulation=accumulation, **common)
        heldout = SFTLoader(data, "heldout", shuffle=False, **common)  # the responses' loss alone
        if not job.spec.replay_rows:
            return train, heldout
        replay = PackedLoader(
            job.inputs["replay"],
            "train",
            seq_len=job.spec.train.seq_len,
            batch_size=job.spec.replay_rows,
            rank=rank,
            world_size=world,
            seed=job.spec.train.seed,
            accumulation=accumulation,
        )
        return MixedLoader(train, replay), heldout

    def finalize(self, job: TrainingJob, final: Path, tracker: Tracker) -> TrainedModel:
        """Adapter / merged export (verified), before-and-after metrics."""
        spec: SFTSpec = job.spec
        base: TrainedModel = job.inputs["base"]
        tok = describe(Path(base.hf_export))
        examples = heldout_examples(job.inputs["data"], spec.eval_examples)
        model = base_model(base)  # the base is read once: scored first, then turned into the tuned model
        match_before = exact_match(model, tok, examples)
        tuned = export_tuned(job, final, model, spec.method, spec.lora, base.hf_export)
        val = val_losses(job.run_dir)
        summary = {
            **tuned.counts("sft"),
            "sft/heldout_loss_before": val[0],
            "sft/heldout_loss_after": val[-1],
            "sft/exact_match_before": match_before,
            "sft/exact_match_after": exact_match(tuned.model, tok, examples),
            "export/max_abs_logit_diff": tuned.verification["max_abs_logit_diff"],
        }
        atomic_write_json(job.run_dir / "sft_summary.json", summary)
        return tuned.trained_model(
            job,
            final,
            tracker,
            "lora" if spec.method == "lora" else "sft-full",
            summary,
            final_val_loss=val[-1],
            tokenizer_digest=base.tokenizer_digest,
            base_run_dir=base.path,
        )


SFT_STAGE = SFT()


def run_sft(
    spec: SFTSpec,
    base: TrainedModel,
    data: SFTManifest,
    progress: Progress | None = None,
    replay: DatasetManifest | None = None,
) -> TrainedModel:
    """Fine-tune `base` on `data` (1 worker in-process, N on Ray Train), with `sft.replay_rows` windows of `replay`
    (the base's pretraining tokens) in every micro-batch."""
    inputs = {"base": base, "data": data, **({"replay": replay} if spec.replay_rows and replay else {})}
    return run_training_stage(SFT_STAGE, spec, inputs, progress)


def heldout_examples(data: SFTManifest, limit: int) -> list[Messages]:
    lines = (Path(data.path) / "heldout.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines[:limit]]


@torch.no_grad()
def exact_match(model: Transformer, tok: TokenizerRef, examples: list[Messages]) -> float:
    """Share of held-out prompts whose greedy answer equals the reference answer (whitespace-trimmed), each given
    the reference's length in tokens plus 4 (at most what its context leaves); generated in batches
    (`greedy_each`)."""
    tokenizer, fmt = tok.load(), chat_format(tok)
    end_id = tokenizer.token_to_id(fmt.end_of_turn)
    prompts, budgets, references = [], [], []
    for messages in examples:
        reference = messages[-1]["content"]
        ids = tokenizer.encode(fmt.prompt(messages[:-1]), add_special_tokens=False).ids
        budget = min(len(tokenizer.encode(reference).ids) + 4, model.cfg.max_seq_len - len(ids))
        if budget > 0:
            prompts.append(ids)
            budgets.append(budget)
            references.append(reference)
    answers = greedy_each(model.eval(), prompts, budgets, end_id)
    hits = sum(tokenizer.decode(a).strip() == r.strip() for a, r in zip(answers, references, strict=True))
    return hits / max(len(examples), 1)
