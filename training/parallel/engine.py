"""The DeepSpeed engine behind the loop's `Engine` interface: the generated DeepSpeed config (ZeRO, precision,
accumulation, clipping), the optimiser from `training/optim/optimizers.py`, activation checkpointing and the expert-parallel
swap applied before `deepspeed.initialize`, and checkpoint save/load of module, optimiser and step counters.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from data_pipeline.loader import Batch
from infra.allocator import keep_freed_memory
from training.compile import compiles_optimizer, maybe_compile
from training.config import OptimConfig, ParallelConfig, TrainConfig
from training.model.transformer import ModelOutput, Transformer
from training.optim.master_weights import MasterWeights, uses_master_weights
from training.optim.optimizers import BuiltByDeepSpeed, build_optimizer, param_groups, set_lr
from training.parallel.expert_parallel import swap_in_expert_parallel
from training.parallel.reshard import (
    check_layout_change,
    experts_to_universal,
    partitioned,
    spreads_experts,
    to_universal,
)

log = logging.getLogger(__name__)
DS_TAG = "state"  # DeepSpeed's tag inside each of our checkpoint directories


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = (
            deep_merge(merged[key], value)
            if isinstance(value, dict) and isinstance(merged.get(key), dict)
            else value
        )
    return merged


def deepspeed_config(parallel: ParallelConfig, optim: OptimConfig, train: TrainConfig) -> dict[str, Any]:
    """The DeepSpeed JSON for these slices (the optimiser is passed separately); `parallel.deepspeed` keys are
    merged on top."""
    master_weights = uses_master_weights(
        parallel.precision, parallel.zero_stage, parallel.ep_size, optim.name
    )
    config: dict[str, Any] = {
        "train_batch_size": train.global_batch(parallel.world_size),
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps(parallel.world_size),
        # clipped by the engine (`clips_itself`) or by `MasterWeights`, else by DeepSpeed
        "gradient_clipping": 0.0 if clips_itself(parallel) or master_weights else optim.grad_clip,
        # ZeRO-3's "memory-efficient linear" replaces torch.nn.functional.linear for the whole process and never
        # puts it back: every later model in the process (a pipeline's SFT, compression's torchao tensors) ran
        # through DeepSpeed's wrapper, which quantized weights cannot. `parallel.deepspeed` can turn it back on.
        "zero_optimization": {"stage": parallel.zero_stage, "memory_efficient_linear": False},
        # with `MasterWeights` DeepSpeed sees an fp32 model: the bf16 cast and the fp32 masters are ours
        "bf16": {"enabled": parallel.precision == "bf16" and not master_weights},
        "fp16": {"enabled": parallel.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }
    if master_weights:  # gradients all-reduced in bf16, as with DeepSpeed's bf16 on
        config["communication_data_type"] = "bf16"
    return deep_merge(config, parallel.deepspeed)


def checkpoint_activations(model: Transformer) -> None:
    """Recompute each block's activations in backward instead of storing them (Chen et al. 2016)."""
    from torch.utils.checkpoint import checkpoint

    for block in model.model.layers:
        forward = block.forward
        block.forward = lambda *args, _forward=forward: checkpoint(_forward, *args, use_reentrant=False)


def clips_itself(parallel: ParallelConfig) -> bool:
    """fp32 without ZeRO: p.grad holds the full (reduced) gradient at the step, so the engine clips it with torch's
    `clip_grad_norm_` and keeps the norm (DeepSpeed's own clipping there computes the norm and discards it)."""
    return parallel.zero_stage == 0 and parallel.precision == "fp32"


class DeepSpeedEngine:
    """The loop's `Engine` over a DeepSpeed engine (DeepSpeed counts micro-batches in its own `step()` calls).
    `grad_clip` is applied here when `clips_itself`, else by the optimiser (DeepSpeed's or `MasterWeights`)."""

    def __init__(self, ds: Any, layout: dict[str, int], grad_clip: float | None = None) -> None:
        self.ds, self.layout = ds, layout
        self.module: nn.Module = ds.module
        self.accumulation_steps: int = ds.gradient_accumulation_steps()
        self.device = next(ds.module.parameters()).device
        self._micro = 0
        self._grad_clip = grad_clip  # None: DeepSpeed's optimiser clips and reports the norm
        if ds.zero_optimization_stage() == 0 and ds.dp_world_size == 1:
            # one rank: flatten, all-reduce, copy back was 3% of an fp32 step and ~5% of a bf16 MoE one (d_model 384)
            ds.enable_backward_allreduce = False

    def forward(self, batch: Batch, with_loss: bool = True, logits_grad: bool = True) -> ModelOutput:
        targets = batch.targets.to(self.device) if with_loss else None
        return self.ds(batch.inputs.to(self.device), targets=targets, logits_grad=logits_grad)

    def backward(self, loss: Tensor) -> None:
        self.ds.backward(loss)
        self._micro += 1
        if self._micro < self.accumulation_steps:
            self.ds.step()  # not a boundary: DeepSpeed only advances its micro-step counter

    def step(self, lr: float) -> float:
        set_lr(self.ds.optimizer, lr)
        local = float("nan") if self._grad_clip is None else _clip_grad_norm(self.module, self._grad_clip)
        self.ds.step()
        self._micro = 0
        reported = self.ds.get_global_grad_norm()
        return float(reported) if reported is not None else local

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    def save(self, directory: Path) -> None:
        """All ranks: module, optimizer and step counters (without DeepSpeed's `latest` pointer)."""
        self.ds.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False)

    def saved(self) -> dict[Path, dict[str, Any]]:
        return self.ds.checkpoint_engine.wait()  # a `CheckpointWriter`

    def load(self, directory: Path, saved_on: dict[str, int] | None = None) -> None:
        """`saved_on`: the layout that wrote `directory` when it is not this engine's (training/parallel/reshard.py)."""
        if saved_on is not None:
            check_layout_change(directory / DS_TAG, saved_on, self.layout)
        if saved_on is None or not partitioned(directory / DS_TAG):
            return self._load(directory)
        # next to the checkpoint (`ckpt.commit` clears what a crash leaves): one conversion per node (a run directory
        # on object storage is local to each), or with experts spread, one per rank (each owns other experts)
        rank = torch.distributed.get_rank()
        if spreads_experts(saved_on, self.layout):
            universal, converts = directory.with_name(f".tmp-universal-{directory.name}-rank{rank}"), True
            parameters = dict(self.ds.module.named_parameters())
            experts_to_universal(
                directory / DS_TAG,
                universal / DS_TAG,
                saved_on,
                self.layout,
                rank,
                parameters,
                self.ds.optimizer.optimizer.param_groups,
            )
        else:
            universal = directory.with_name(f".tmp-universal-{directory.name}-{socket.gethostname()}")
            converts = int(os.environ.get("LOCAL_RANK", "0")) == 0
            if converts:
                to_universal(directory / DS_TAG, universal / DS_TAG)
        torch.distributed.barrier()
        self.ds._config.load_universal_checkpoint = True  # DeepSpeed reads it at each load, not only at start
        try:
            self._load(universal)
        finally:
            self.ds._config.load_universal_checkpoint = False
        torch.distributed.barrier()
        if converts:
            shutil.rmtree(universal)

    def _load(self, directory: Path) -> None:
        path, _ = self.ds.load_checkpoint(str(directory), tag=DS_TAG, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{directory}: DeepSpeed found no checkpoint to load")


def _clip_grad_norm(module: nn.Module, max_norm: float) -> float:
    """The total gradient norm before clipping to `max_norm` (no clipping when 0)."""
    params = [p for p in module.parameters() if p.grad is not None]
    if not params:
        return float("nan")
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.nn.utils.get_total_norm([p.grad for p in params]))


def build_engine(
    model: nn.Module, optim: OptimConfig, parallel: ParallelConfig, train: TrainConfig
) -> DeepSpeedEngine:
    """deepspeed.initialize over our parameter groups and the optimiser `training/optim/optimizers.py` builds.
    The process's allocator keeps large blocks from here on (`infra.allocator`: a step's tensors reuse them)."""
    import deepspeed

    keep_freed_memory()
    if parallel.ep_size > 1:
        swap_in_expert_parallel(model, parallel.ep_size)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[parallel.precision]
    # eager: DeepSpeed's expert-parallel layer (all-to-all), and K-FAC (its module hooks read every layer)
    if parallel.ep_size == 1 and optim.name != "kfac":
        maybe_compile(model, parallel.compile, train.micro_batch_size, train.seq_len, dtype)
    if parallel.activation_checkpointing:
        checkpoint_activations(model)
    groups = param_groups(model, optim, model.cfg.hidden_lr_mult() if isinstance(model, Transformer) else 1.0)
    if parallel.ep_size > 1:  # expert weights are reduced within their expert-data-parallel group only
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    config = deepspeed_config(parallel, optim, train)
    grad_scale = float(train.grad_accum_steps(parallel.world_size))
    if uses_master_weights(parallel.precision, parallel.zero_stage, parallel.ep_size, optim.name):
        for p in model.parameters():  # parameters only, as DeepSpeed casts (buffers such as RoPE's stay fp32)
            p.data = p.data.to(dtype)
        optimizer = MasterWeights(
            groups,
            lambda masters: build_optimizer(masters, optim, model, grad_scale),
            optim.grad_clip,
            compiled=isinstance(model, Transformer)
            and compiles_optimizer(parallel.compile, next(model.parameters()).device, model.cfg),
        )
    else:
        optimizer = build_optimizer(groups, optim, model, grad_scale)
    if isinstance(optimizer, BuiltByDeepSpeed):
        config["optimizer"] = optimizer.config
        ds, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    else:
        ds, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    from training.parallel.checkpoint_writer import CheckpointWriter  # imports DeepSpeed

    ds.checkpoint_engine = CheckpointWriter(background=train.async_checkpoint)
    return DeepSpeedEngine(ds, parallel.layout(), optim.grad_clip if clips_itself(parallel) else None)
