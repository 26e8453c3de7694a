"""Optimisers, built in one place: parameter groups, the optimiser itself, its state size, and learning-rate
schedules as pure functions of the config. A new optimiser touches `OptimConfig.name` and this module only.

AdamW (Loshchilov & Hutter 2019) with decoupled weight decay on matrices only: no decay on norms, biases or the
embedding. Muon (Jordan et al. 2024) is DeepSpeed's: it takes every matrix but the embedding and the head
(DeepSpeed tags them itself) and runs AdamW on the rest, keeping these two groups' weight decay. The matrix
optimisers (SOAP, Shampoo, PSGD-Kron, K-FAC: `training/optim/matrix.py`) take the blocks' 2-D weights as a
`matrix` group at `matrix_lr`, with AdamW on the rest. Schedules: linear warmup, then cosine decay to
`min_lr_ratio · lr` (Loshchilov & Hutter 2017), or warmup-stable-decay with a linear decay over the last
`decay_fraction` of steps (Hu et al. 2024, MiniCPM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from training.config import MATRIX_OPTIMIZERS, OptimConfig
from training.model.transformer import is_hidden
from training.optim.matrix import MATRIX_GROUP, build_chain


def no_decay(name: str, param: nn.Parameter) -> bool:
    """Norm gains, biases and the token embedding are not weight-decayed."""
    return param.ndim < 2 or "norm" in name or "embed_tokens" in name


def is_block_matrix(name: str, param: nn.Parameter) -> bool:
    """A 2-D weight inside the blocks (also under a PEFT wrapper's prefix): what matrix optimisers take."""
    return param.ndim == 2 and ".layers." in f".{name}"


def param_groups(model: nn.Module, cfg: OptimConfig, hidden_lr_mult: float = 1.0) -> list[dict]:
    """Weight-decayed matrices and everything else (no decay); with `hidden_lr_mult` ≠ 1 (μP), the matrices
    inside the blocks form a third group whose `lr_mult` scales the schedule's learning rate; a matrix optimiser's
    matrices form the `matrix` group at `matrix_lr`."""
    hidden, decay, plain, matrix = [], [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if no_decay(name, param):
            plain.append(param)
        elif cfg.name in MATRIX_OPTIMIZERS and is_block_matrix(name, param):
            matrix.append(param)
        else:
            (hidden if hidden_lr_mult != 1.0 and is_hidden(name) else decay).append(param)
    groups = [
        {
            "name": MATRIX_GROUP,
            "params": matrix,
            "weight_decay": cfg.weight_decay,
            "lr_mult": cfg.matrix_lr_mult(),
        },
        {"name": "hidden", "params": hidden, "weight_decay": cfg.weight_decay, "lr_mult": hidden_lr_mult},
        {"name": "decay", "params": decay, "weight_decay": cfg.weight_decay, "lr_mult": 1.0},
        {"name": "no_decay", "params": plain, "weight_decay": 0.0, "lr_mult": 1.0},
    ]
    return [g for g in groups if g["params"]]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's learning rate on every group, times the group's `lr_mult` (μP)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


# fp32 bytes of elementwise optimiser state per trained parameter (AdamW: two moments; Muon, Kron, K-FAC: one
# momentum on the matrices they own, which are nearly all of a model's parameters; SOAP: Adam's two moments;
# Shampoo: momentum and the RMSProp graft's second moment). Matrix optimisers add per-matrix factors
# (`training.model.accounting.preconditioner_bytes`).
STATE_BYTES: dict[str, int] = {"adamw": 8, "muon": 4, "soap": 8, "shampoo": 8, "kron": 4, "kfac": 4}


@dataclass(frozen=True)
class BuiltByDeepSpeed:
    """An optimiser DeepSpeed constructs itself from its config section (it owns Muon's orthogonalisation)."""

    config: dict[str, Any]


def build_optimizer(
    groups: list[dict], cfg: OptimConfig, model: nn.Module | None = None, grad_scale: float = 1.0
) -> torch.optim.Optimizer | BuiltByDeepSpeed:
    """The optimiser over `groups` (from `param_groups`, possibly split further by the engine); matrix
    optimisers also need the `model` (K-FAC hooks its layers) and the gradient accumulation (`grad_scale`)."""
    if cfg.name in MATRIX_OPTIMIZERS:
        if model is None:
            raise ValueError(f"optim.name={cfg.name} needs the model to build its optimiser")
        if any(g.get("lr_mult", 1.0) != 1.0 for g in groups if g["name"] != MATRIX_GROUP):
            raise ValueError(f"μP's per-width learning rates need optim.name=adamw, not {cfg.name}")
        return build_chain(groups, cfg, model, grad_scale)
    if cfg.name == "adamw":
        # fused: one kernel over all tensors (CPU and CUDA); the default for-loop was 11% of a CPU step
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
    if cfg.name == "muon":
        if any(g.get("lr_mult", 1.0) != 1.0 for g in groups):
            raise ValueError(
                "μP's per-width learning rates need optim.name=adamw (DeepSpeed's Muon groups its own)"
            )
        params = {"lr": cfg.lr, "betas": list(cfg.betas), "eps": cfg.eps, "weight_decay": cfg.weight_decay}
        # torch_adam: the embedding, head and gains get torch's AdamW (as optim.name=adamw does) instead of
        # DeepSpeed's FusedAdam, whose C++ op is compiled on first use (45-76 s on a 2-vCPU machine, per install)
        return BuiltByDeepSpeed({"type": "Muon", "params": {**params, "torch_adam": True}})
    raise ValueError(f"optim.name={cfg.name!r} has no builder in training/optim/optimizers.py")


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimiser step `step` (0-based) of `max_steps`."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        span = max(1, max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
    start = decay_start(max_steps, cfg.decay_fraction)  # WSD
    if step < start:
        return peak
    return peak + (floor - peak) * min(1.0, (step - start + 1) / (max_steps - start))


def decay_start(horizon: int, decay_fraction: float) -> int:
    """The step at which a WSD run of `horizon` steps leaves its stable phase."""
    return horizon - max(1, round(decay_fraction * horizon))
