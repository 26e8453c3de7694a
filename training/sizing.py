"""The sizing rules a scaling ladder runs by, shared by the sweep's trials and the rung the fit sizes: a model at
another depth and width (`sized_model`), N under a parameter-count convention (`count_n`), and a run's batch,
horizons, warmup and evaluation size at a budget (`run_shape`)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

from training.config import PretrainSpec, SweepConfig
from training.model.accounting import count_parameters
from training.model.config import ModelConfig, depth_dial


class RunShape(BaseModel):
    """Batch, horizons, warmup and evaluation size of one run, from the sweep's rules (shared by the trials
    and the rung)."""

    batch: int
    micro_batch: int
    steps: list[int]
    warmup: int
    tokens_per_step: int
    eval_batches: int  # so that every run is validated on the same sequences, whatever its micro-batch
    lr_scale: float = 1.0  # the learning rate at this batch over the rate at the recipe's batch

    def overrides(self, lr: float) -> dict[str, Any]:
        """The training settings this shape fixes, `lr` being the rate at the recipe's batch (the horizons and
        evaluation cadence are the caller's)."""
        return {
            "train.global_batch_size": self.batch,
            "train.micro_batch_size": self.micro_batch,
            "train.eval_batches": self.eval_batches,
            "optim.warmup_steps": self.warmup,
            "optim.lr": lr * self.lr_scale,
        }


def sized_model(base: ModelConfig, depth: int, width: int | None = None) -> ModelConfig:
    """The recipe's architecture at another depth (and width, default depth × its aspect ratio), keeping its
    head size and kv grouping."""
    head_dim, kv_ratio = base.head_dim, base.n_heads // base.n_kv_heads
    fields = base.model_dump(exclude={"d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"})
    if width is None:
        dial = depth_dial(depth, base.d_model // base.n_layers, head_dim, kv_ratio)
    elif width % head_dim or (width // head_dim) % kv_ratio:
        raise ValueError(
            f"sweep size width={width} must be a multiple of the head size {head_dim} times the kv grouping "
            f"{kv_ratio} (n_heads / n_kv_heads), i.e. of {head_dim * kv_ratio}"
        )
    else:
        dial = {**depth_dial(1, width, head_dim, kv_ratio), "n_layers": depth}
    return ModelConfig(**dial, **fields)


def count_n(model: ModelConfig, convention: str) -> int:
    """N under a parameter-count convention: `matmul` (every matrix multiply per token, the head included) or
    `non_embedding` (Kaplan et al. 2020: without the embedding and the head)."""
    counts = count_parameters(model)
    if convention == "matmul":
        return counts.matmul_active
    return counts.matmul_active - (counts.lm_head or counts.embedding)


def run_shape(base: PretrainSpec, sweep: SweepConfig, n: int, budgets: list[float]) -> RunShape:
    """The global batch (∝ D^batch_exponent at the largest budget, a power of two) and the learning rate's scale
    with it (∝ batch^lr_batch_exponent), each budget's step count, the warmup (a share of the shortest horizon, or
    the recipe's warmup capped at a tenth of it; at least `min_warmup_steps`, at most half that horizon) and the
    evaluation batches that cover the recipe's validation sequences."""
    train, world = base.train, base.parallel.world_size
    batch = reference = train.global_batch(world)
    if sweep.batch_exponent and sweep.reference_tokens:
        raw = batch * (max(budgets) / (6.0 * n) / sweep.reference_tokens) ** sweep.batch_exponent
        batch = max(1, 2 ** round(math.log2(raw)))
    micro = min(train.micro_batch_size, max(1, batch // world))
    batch = math.ceil(batch / (micro * world)) * micro * world
    tokens_per_step = batch * train.seq_len
    steps = [max(1, round(c / (6.0 * n) / tokens_per_step)) for c in budgets]
    if sweep.warmup_fraction:
        warmup = max(1, round(sweep.warmup_fraction * min(steps)))
    else:
        warmup = min(base.optim.warmup_steps, max(1, min(steps) // 10))
    warmup = max(warmup, min(sweep.min_warmup_steps, min(steps) // 2))
    return RunShape(
        batch=batch,
        micro_batch=micro,
        steps=steps,
        warmup=warmup,
        tokens_per_step=tokens_per_step,
        eval_batches=math.ceil(train.eval_batches * train.micro_batch_size / micro),
        lr_scale=(batch / reference) ** sweep.lr_batch_exponent,
    )
