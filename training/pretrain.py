"""Stage 2: pretraining. `run_pretrain(recipe, data) -> CheckpointRef` on one in-process worker or N Ray Train
workers, each running DeepSpeed; resumable, tracked in MLflow, ending with a verified Hugging Face export.

The run directory `<output_dir>/pretrain/<name>-<hash>/` is named by the recipe (minus data and tracking
settings) and the dataset's digests. Relaunching the same recipe resumes from its newest complete checkpoint
and keeps logging into the same MLflow run; a finished run (its manifest.json exists) is returned as is.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from data_pipeline.loader import PackedLoader
from data_pipeline.shards import DatasetManifest
from data_pipeline.sources import DataError
from infra.storage import MANIFEST, atomic_write_json, digest_of, stage_dir
from infra.tracking import finish_run, make_tracker, start_run
from training import checkpoint as ckpt
from training.accounting import flops_per_token
from training.export import export_hf
from training.launch import run_stage_workers
from training.loop import LoopSetup, resume, train_loop
from training.model import Transformer
from training.perf import measure_matmul_peak, published_peak

log = logging.getLogger(__name__)
PRETRAIN_VERSION = 1
Progress = Callable[[int, float, float], None]


class CheckpointRef(BaseModel):
    """A finished training run: its final checkpoint, verified Hugging Face export and headline numbers."""

    model_config = ConfigDict(frozen=True)

    run_dir: str
    checkpoint: str
    hf_export: str | None
    export_valid: bool
    max_abs_logit_diff: float | None
    step: int
    final_val_loss: float | None
    tokenizer_digest: str
    mlflow_run_id: str | None
    config_digest: str
    model: dict[str, Any]
    adapter: str | None = None  # fine-tuning with LoRA: the PEFT adapter directory
    base_run_dir: str | None = None  # fine-tuning: the pretraining run it started from
    summary: dict[str, float] = {}  # fine-tuning: held-out loss and exact match before and after

    @classmethod
    def load(cls, run_dir: str | Path) -> CheckpointRef:
        path = Path(run_dir) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(
                f"{run_dir}: no {MANIFEST}; the run has not finished (rerun to resume it)"
            )
        return cls.model_validate_json(path.read_text())


def data_digest(data: DatasetManifest) -> str:
    return digest_of(
        {
            "tokenizer": data.tokenizer.digest,
            "shards": {s: [i.sha256 for i in v.shards] for s, v in data.splits.items()},
        }
    )


def run_key(recipe: Any, data: DatasetManifest) -> dict[str, Any]:
    """What determines the trained weights: everything but data, fine-tuning, tracking and output settings."""
    config = recipe.model_dump(
        mode="json", exclude={"data", "tracking", "output_dir", "name", "finetune", "sweep", "eval"}
    )
    for how_not_what in ("threads_per_worker", "max_failures", "placement"):  # never change the weights
        config["parallel"].pop(how_not_what, None)
    return {"version": PRETRAIN_VERSION, "config": config, "data": data_digest(data)}


def git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def run_pretrain(
    recipe: Any, data: DatasetManifest, workers: int | None = None, progress: Progress | None = None
) -> CheckpointRef:
    """Train (or resume, or return) the recipe's model on `data`; `workers` overrides parallel.world_size."""
    from flows.recipe import validate_recipe  # the Recipe type lives with the CLI's config tree

    if workers is not None and workers != recipe.parallel.world_size:
        recipe = validate_recipe(
            {
                **recipe.model_dump(mode="json"),
                "parallel": {**recipe.parallel.model_dump(mode="json"), "world_size": workers},
            }
        )
    if data.tokenizer.vocab_size > recipe.model.vocab_size:
        raise DataError(
            f"the dataset's tokenizer has {data.tokenizer.vocab_size} tokens but model.vocab_size="
            f"{recipe.model.vocab_size}; raise model.vocab_size or re-tokenize with a smaller vocabulary"
        )
    run_dir = stage_dir(recipe.output_dir, "pretrain", recipe.name, run_key(recipe, data))
    if (run_dir / MANIFEST).is_file():
        return CheckpointRef.load(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    previous_run = ckpt.read_meta(latest).get("mlflow_run_id") if latest else None
    digest = recipe.digest()
    tags = {
        "lmforge.stage": "pretrain",
        "lmforge.config_digest": digest,
        "lmforge.git": git_revision(),
        "lmforge.data_digest": data_digest(data),
        "lmforge.run_dir": str(run_dir.resolve()),
    }
    run_id = start_run(recipe.tracking, recipe.output_dir, f"pretrain-{recipe.name}", previous_run, tags)
    spec = {
        "recipe": recipe.model_dump_json(),
        "data": data.model_dump_json(),
        "run_dir": str(run_dir.resolve()),
        "mlflow_run_id": run_id,
        "config_digest": digest,
    }
    tracker = make_tracker(recipe.tracking, recipe.output_dir, run_id, rank=0)
    if previous_run is None:
        tracker.log_params(recipe.model_dump(mode="json"))
        atomic_write_json(run_dir / "recipe.json", recipe.model_dump(mode="json"))
        tracker.log_artifact(run_dir / "recipe.json")
        tracker.log_artifact(Path(data.path) / MANIFEST, "data")
    try:
        run_stage_workers(pretrain_worker, spec, recipe.parallel, run_dir, "train", progress)
    except BaseException:
        finish_run(recipe.tracking, recipe.output_dir, run_id, status="FAILED")
        raise
    ref = finalize(recipe, data, run_dir, run_id, digest, tracker)
    finish_run(recipe.tracking, recipe.output_dir, run_id)
    return ref


def finalize(
    recipe: Any, data: DatasetManifest, run_dir: Path, run_id: str | None, digest: str, tracker: Any
) -> CheckpointRef:
    """Export the final checkpoint to Hugging Face format, verify it, and write the run's manifest."""
    from training.parallel import fp32_state_dict

    final = ckpt.latest_checkpoint(run_dir / "checkpoints")
    assert final is not None, "training ended without a checkpoint"
    meta = ckpt.read_meta(final)
    export_dir = run_dir / "hf"
    state = fp32_state_dict(final, recipe.model.tie_embeddings)
    verification = export_hf(state, recipe.model, data.tokenizer.path, export_dir)
    val_losses = [m["val/loss"] for m in read_metrics(run_dir) if "val/loss" in m]
    ref = CheckpointRef(
        run_dir=str(run_dir.resolve()),
        checkpoint=str(final.resolve()),
        hf_export=str(export_dir.resolve()),
        export_valid=bool(verification["valid"]),
        max_abs_logit_diff=verification["max_abs_logit_diff"],
        step=int(meta["loop"]["step"]),
        final_val_loss=val_losses[-1] if val_losses else None,
        tokenizer_digest=data.tokenizer.digest,
        mlflow_run_id=run_id,
        config_digest=digest,
        model=recipe.model.model_dump(mode="json"),
    )
    tracker.log_metrics({"export/max_abs_logit_diff": verification["max_abs_logit_diff"]}, ref.step)
    tracker.log_artifact(export_dir, "hf_export")
    tracker.log_artifact(run_dir / "metrics.jsonl")
    atomic_write_json(run_dir / MANIFEST, ref.model_dump(mode="json"))
    return ref


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    """Every record of the run's metrics.jsonl, in logging order (a resumed run re-logs the steps it redoes)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def peak_flops_for(precision: str, train: Any, cfg: Any, rank: int, device: torch.device) -> float:
    """Per-device peak for MFU: configured, else the published GPU peak, else a GEMM measured at the model's
    shapes in the training dtype (rank 0 only: it alone logs MFU)."""
    peak = train.peak_flops or published_peak(device)
    if peak is not None:
        return peak
    if rank != 0:
        return 1.0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    return measure_matmul_peak(dtype, device, train.micro_batch_size * train.seq_len, cfg.d_model, cfg.d_ff)


def pretrain_worker(spec: dict[str, Any], progress: Progress | None = None) -> None:
    """One training process: DeepSpeed engine, this rank's loaders, resume, loop. Runs in-process or under Ray."""
    from flows.recipe import Recipe
    from training.parallel import build_engine, init_distributed

    recipe = Recipe.model_validate_json(spec["recipe"])
    data = DatasetManifest.model_validate_json(spec["data"])
    par, train, model_cfg = recipe.parallel, recipe.train, recipe.model
    torch.set_num_threads(par.threads_per_worker or max(1, (os.cpu_count() or 1) // par.world_size))
    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(train.seed)
    model = Transformer(model_cfg, seed=train.seed)
    engine = build_engine(model, recipe.optim, par, train)
    device = next(engine.module.parameters()).device
    common = {
        "seq_len": train.seq_len,
        "batch_size": train.micro_batch_size,
        "tokenizer_digest": data.tokenizer.digest,
    }
    loader = PackedLoader(data, "train", rank=rank, world_size=world, seed=train.seed, **common)
    val_loader = (
        PackedLoader(data, "val", rank=rank, world_size=world, shuffle=False, **common)
        if data.splits["val"].n_docs
        else None
    )
    setup = LoopSetup(
        run_dir=Path(spec["run_dir"]),
        rank=rank,
        world_size=world,
        flops_per_token=flops_per_token(model_cfg, train.seq_len).training,
        peak_flops=peak_flops_for(par.precision, train, model_cfg, rank, device),
        meta={"mlflow_run_id": spec["mlflow_run_id"], "config_digest": spec["config_digest"]},
        progress=progress,
    )
    state = resume(engine, loader, setup)
    tracker = make_tracker(recipe.tracking, recipe.output_dir, spec["mlflow_run_id"], rank)
    val = (lambda: val_loader.epoch_batches(train.eval_batches)) if val_loader is not None else None
    train_loop(engine, loader, val, train, recipe.optim, setup, tracker, state)
