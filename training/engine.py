"""The interface between the training loop and whatever owns the optimiser step (DeepSpeed, or plain PyTorch).

Per optimiser step the loop calls `forward` and `backward` once per micro-batch (`accumulation_steps` times),
then `step(lr)` once. DeepSpeed implements it in `training/parallel/engine.py`; `PlainEngine` below is the same contract
in plain PyTorch, one process, used by unit tests of the loop and as the baseline in benchmarks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from data_pipeline.loader import Batch
from training.model.transformer import ModelOutput
from training.optim.optimizers import set_lr


class Engine(Protocol):
    """What the loop needs from a training engine."""

    module: nn.Module
    accumulation_steps: int
    device: torch.device

    def forward(self, batch: Batch, with_loss: bool = True, logits_grad: bool = True) -> ModelOutput:
        """Logits of the batch's inputs, and (`with_loss`) the mean cross-entropy over its targets; with
        `logits_grad=False` only the loss is differentiable (`Transformer.forward`)."""
        ...

    def backward(self, loss: Tensor) -> None: ...

    def step(self, lr: float) -> float:
        """Clip, update and zero the gradients at learning rate `lr`; returns the gradient norm before clipping."""
        ...

    def train(self, mode: bool = True) -> None: ...

    def save(self, directory: Path) -> None:
        """Module, optimiser and step counters into `directory` (every rank calls it); the files may still be
        being written when it returns (see `saved`)."""
        ...

    def saved(self) -> dict[Path, dict[str, Any]]:
        """Block until every file of the last `save` is on disk; {path: {bytes, sha256}} of those the engine
        hashed as it wrote them (empty when `save` wrote synchronously)."""
        ...

    def load(self, directory: Path, saved_on: dict[str, int] | None = None) -> None:
        """Everything `save` wrote; `saved_on`: the layout (`ParallelConfig.layout`) that wrote it, when it is not
        this engine's (the state is resharded, or the one-line `LayoutError` says why it cannot be)."""
        ...


def loss_scale(n_micro: int, n_global: int, accumulation: int, world_size: int) -> float:
    """Factor that turns a micro-batch's mean loss into its share of the step's global token mean.

    Engines average gradients over micro-batches and ranks, so a micro-batch with `n_micro` of the step's
    `n_global` loss-carrying tokens contributes mean · n_micro · accumulation · world / n_global. It is exactly 1
    when every micro-batch carries the same number of tokens (pretraining), so the mean of means is unchanged.
    """
    return n_micro * accumulation * world_size / n_global


class PlainEngine:
    """One process, a torch optimiser, gradient accumulation and clipping: the Engine contract without DeepSpeed."""

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, accumulation_steps: int, grad_clip: float
    ) -> None:
        self.module, self.optimizer = module, optimizer
        self.accumulation_steps, self.grad_clip = accumulation_steps, grad_clip
        self.device = next(module.parameters()).device

    def forward(self, batch: Batch, with_loss: bool = True, logits_grad: bool = True) -> ModelOutput:
        targets = batch.targets.to(self.device) if with_loss else None
        return self.module(batch.inputs.to(self.device), targets=targets, logits_grad=logits_grad)

    def backward(self, loss: Tensor) -> None:
        (loss / self.accumulation_steps).backward()

    def step(self, lr: float) -> float:
        set_lr(self.optimizer, lr)
        params = [p for p in self.module.parameters() if p.grad is not None]
        clip = self.grad_clip if self.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(
            {"module": self.module.state_dict(), "optimizer": self.optimizer.state_dict()},
            directory / "engine.pt",
        )

    def saved(self) -> dict[Path, dict[str, Any]]:
        return {}

    def load(self, directory: Path, saved_on: dict[str, int] | None = None) -> None:
        state = torch.load(directory / "engine.pt", weights_only=False)  # one process: whole on any layout
        self.module.load_state_dict(state["module"])
        self.optimizer.load_state_dict(state["optimizer"])
