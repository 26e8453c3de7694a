"""Stage 3: supervised fine-tuning, full or LoRA, on a pretrained checkpoint: `run_sft(recipe, base, data)`.

The same engine and loop as pretraining, fed SFT batches whose targets cover only assistant tokens. Before and
after training it measures the held-out response-token loss (the loop's val/loss at the first and last step)
and exact match of greedy answers to held-out prompts. Outputs: for LoRA a PEFT adapter directory (loads on the
base's Hugging Face export with `PeftModel.from_pretrained`, verified) plus a merged export; for full SFT an
export. Both exports are verified against our model's logits like every export.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from data_pipeline.sft import Messages, SFTLoader, SFTManifest, render
from data_pipeline.sources import DataError
from data_pipeline.tokenizer import END_OF_TURN, describe
from infra.storage import MANIFEST, atomic_write_json, digest_of, stage_dir
from infra.tracking import finish_run, make_tracker, start_run
from training import checkpoint as ckpt
from training.accounting import flops_per_token
from training.export import export_hf
from training.launch import run_stage_workers
from training.loop import LoopSetup, resume, train_loop
from training.lora import apply_lora, merged_state_dict, save_adapter, trainable_counts
from training.model import ModelConfig, Transformer
from training.pretrain import CheckpointRef, Progress, git_revision, peak_flops_for, read_metrics
from training.sampling import generate

log = logging.getLogger(__name__)
SFT_VERSION = 1


def base_model(base: CheckpointRef) -> Transformer:
    """The pretrained model in fp32 from its final checkpoint."""
    from training.parallel import fp32_state_dict

    cfg = ModelConfig(**base.model)
    model = Transformer(cfg, seed=None)
    model.load_state_dict(fp32_state_dict(Path(base.checkpoint), cfg.tie_embeddings), strict=True)
    return model


def check_tokenizers(base: CheckpointRef, data: SFTManifest) -> None:
    if base.tokenizer_digest != data.tokenizer_digest:
        raise DataError(
            f"the base model was trained with tokenizer {base.tokenizer_digest[:16]}... but the SFT data "
            f"{data.path} was made with {data.tokenizer_digest[:16]}...; rebuild the SFT data with the base's tokenizer"
        )


def run_sft(
    recipe: Any, base: CheckpointRef, data: SFTManifest, progress: Progress | None = None
) -> CheckpointRef:
    """Fine-tune `base` on `data` with `recipe.finetune` (1 worker in-process, N on Ray Train)."""
    check_tokenizers(base, data)
    ft = recipe.finetune
    if data.seq_len != ft.train.seq_len:
        raise DataError(
            f"SFT data has seq_len={data.seq_len}, finetune.train.seq_len={ft.train.seq_len}; rebuild it"
        )
    key = {
        "version": SFT_VERSION,
        "finetune": ft.model_dump(mode="json"),
        "parallel": recipe.parallel.model_dump(mode="json"),
        "base": base.config_digest,
        "base_checkpoint": base.checkpoint,
        "data": data.path,
    }
    run_dir = stage_dir(recipe.output_dir, "sft", f"{recipe.name}-{ft.method}", key)
    if (run_dir / MANIFEST).is_file():
        return CheckpointRef.load(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    previous_run = ckpt.read_meta(latest).get("mlflow_run_id") if latest else None
    digest = digest_of(key)
    tags = {
        "lmforge.stage": "sft",
        "lmforge.method": ft.method,
        "lmforge.config_digest": digest,
        "lmforge.git": git_revision(),
        "lmforge.base_run_id": str(base.mlflow_run_id),
        "lmforge.base_run_dir": base.run_dir,
    }
    run_id = start_run(
        recipe.tracking, recipe.output_dir, f"sft-{ft.method}-{recipe.name}", previous_run, tags
    )
    tracker = make_tracker(recipe.tracking, recipe.output_dir, run_id, rank=0)
    if previous_run is None:
        tracker.log_params({"finetune": ft.model_dump(mode="json"), "base_run_dir": base.run_dir})
    spec = {
        "recipe": recipe.model_dump_json(),
        "base": base.model_dump_json(),
        "data": data.model_dump_json(),
        "run_dir": str(run_dir.resolve()),
        "mlflow_run_id": run_id,
        "config_digest": digest,
    }
    try:
        run_stage_workers(sft_worker, spec, recipe.parallel, run_dir, "sft", progress)
        ref = finalize_sft(recipe, base, data, run_dir, run_id, digest, tracker)
    except BaseException:
        finish_run(recipe.tracking, recipe.output_dir, run_id, status="FAILED")
        raise
    finish_run(recipe.tracking, recipe.output_dir, run_id)
    return ref


def build_model(base: CheckpointRef, ft: Any) -> torch.nn.Module:
    model = base_model(base)
    return apply_lora(model, ft.lora) if ft.method == "lora" else model


def sft_worker(spec: dict[str, Any], progress: Progress | None = None) -> None:
    """One fine-tuning process: base weights (+ adapters), engine, SFT loaders, resume, loop."""
    from flows.recipe import Recipe
    from training.parallel import build_engine, init_distributed

    recipe = Recipe.model_validate_json(spec["recipe"])
    base = CheckpointRef.model_validate_json(spec["base"])
    data = SFTManifest.model_validate_json(spec["data"])
    ft, par = recipe.finetune, recipe.parallel
    torch.set_num_threads(par.threads_per_worker or max(1, (os.cpu_count() or 1) // par.world_size))
    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(ft.train.seed)
    model = build_model(base, ft)
    engine = build_engine(model, ft.optim, par, ft.train)
    common = {
        "batch_size": ft.train.micro_batch_size,
        "rank": rank,
        "world_size": world,
        "tokenizer_digest": base.tokenizer_digest,
    }
    loader = SFTLoader(data, "train", seed=ft.train.seed, **common)
    heldout = SFTLoader(data, "heldout", shuffle=False, **common)
    cfg = ModelConfig(**base.model)
    setup = LoopSetup(
        run_dir=Path(spec["run_dir"]),
        rank=rank,
        world_size=world,
        flops_per_token=flops_per_token(cfg, ft.train.seq_len).training,
        peak_flops=peak_flops_for(
            par.precision, ft.train, cfg, rank, next(engine.module.parameters()).device
        ),
        meta={"mlflow_run_id": spec["mlflow_run_id"], "config_digest": spec["config_digest"]},
        progress=progress,
    )
    state = resume(engine, loader, setup)
    tracker = make_tracker(recipe.tracking, recipe.output_dir, spec["mlflow_run_id"], rank)

    train_loop(
        engine,
        loader,
        lambda: heldout.epoch_batches(ft.train.eval_batches),
        ft.train,
        ft.optim,
        setup,
        tracker,
        state,
    )


def heldout_examples(data: SFTManifest, limit: int) -> list[Messages]:
    lines = (Path(data.path) / "heldout.jsonl").read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines[:limit]]


@torch.no_grad()
def exact_match(model: Transformer, tokenizer: Tokenizer, examples: list[Messages]) -> float:
    """Share of held-out prompts whose greedy answer equals the reference answer (whitespace-trimmed)."""
    end_id = tokenizer.token_to_id(END_OF_TURN)
    hits = 0
    for messages in examples:
        reference = messages[-1]["content"]
        prompt = render(messages[:-1])[0] + "<|assistant|>\n"
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        budget = min(len(tokenizer.encode(reference).ids) + 4, model.cfg.max_seq_len - ids.shape[1])
        if budget <= 0:
            continue
        out = generate(model.eval(), ids, budget, eos_id=end_id)[0, ids.shape[1] :].tolist()
        answer = tokenizer.decode(out[: out.index(end_id)] if end_id in out else out)
        hits += answer.strip() == reference.strip()
    return hits / max(len(examples), 1)


def finalize_sft(
    recipe: Any,
    base: CheckpointRef,
    data: SFTManifest,
    run_dir: Path,
    run_id: str | None,
    digest: str,
    tracker: Any,
) -> CheckpointRef:
    """Adapter / merged export (verified), before-and-after metrics, manifest."""
    from training.parallel import fp32_state_dict

    ft = recipe.finetune
    final = ckpt.latest_checkpoint(run_dir / "checkpoints")
    assert final is not None, "fine-tuning ended without a checkpoint"
    cfg = ModelConfig(**base.model)
    state = fp32_state_dict(final, tie_embeddings=False)
    adapter_dir = None
    tokenizer = describe(Path(base.hf_export)).load()
    examples = heldout_examples(data, ft.eval_examples)
    model = base_model(base)  # the base is read once: scored first, then turned into the tuned model
    match_before = exact_match(model, tokenizer, examples)
    tuned = apply_lora(model, ft.lora) if ft.method == "lora" else model
    trainable, total = trainable_counts(tuned)
    if ft.method == "lora":
        tuned.load_state_dict(state, strict=True)
        adapter_dir = run_dir / "adapter"
        save_adapter(tuned, adapter_dir, base.hf_export)
        weights = merged_state_dict(tuned)
    else:
        weights = state
        if cfg.tie_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    verification = export_hf(weights, cfg, base.hf_export, run_dir / "hf")
    tuned_model = Transformer(cfg, seed=None)
    tuned_model.load_state_dict(weights, strict=True)
    val = [m["val/loss"] for m in read_metrics(run_dir) if "val/loss" in m]
    summary = {
        "sft/trainable_params": float(trainable),
        "sft/trainable_fraction": trainable / total,
        "sft/heldout_loss_before": val[0],
        "sft/heldout_loss_after": val[-1],
        "sft/exact_match_before": match_before,
        "sft/exact_match_after": exact_match(tuned_model, tokenizer, examples),
        "export/max_abs_logit_diff": verification["max_abs_logit_diff"],
    }
    meta = ckpt.read_meta(final)
    tracker.log_metrics(summary, int(meta["loop"]["step"]))
    tracker.log_artifact(run_dir / "hf", "hf_export")
    if adapter_dir is not None:
        tracker.log_artifact(adapter_dir, "adapter")
    atomic_write_json(run_dir / "sft_summary.json", summary)
    ref = CheckpointRef(
        run_dir=str(run_dir.resolve()),
        checkpoint=str(final.resolve()),
        hf_export=str((run_dir / "hf").resolve()),
        export_valid=bool(verification["valid"]),
        max_abs_logit_diff=verification["max_abs_logit_diff"],
        step=int(meta["loop"]["step"]),
        final_val_loss=val[-1],
        tokenizer_digest=base.tokenizer_digest,
        mlflow_run_id=run_id,
        config_digest=digest,
        model=base.model,
        adapter=str(adapter_dir.resolve()) if adapter_dir else None,
        base_run_dir=base.run_dir,
        summary=summary,
    )
    atomic_write_json(run_dir / MANIFEST, ref.model_dump(mode="json"))
    return ref
