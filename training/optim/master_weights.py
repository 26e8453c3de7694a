"""fp32 master weights for a model trained in bf16: the model's weights and gradients stay bf16 (what the forward
and backward pass compute in); the optimiser steps fp32 copies and writes them back rounded (Micikevicius et al.
2018, "Mixed precision training"; without loss scaling, which bf16's exponent range does not need).

DeepSpeed's own wrapper for this case (ZeRO-0 with bf16: `FP16_UnfusedOptimizer`) works tensor by tensor: an
overflow scan (amax and amin of every gradient), an fp32 copy of every gradient for its norm and another for the
step, an unscale multiply by 1.0, the step, a copy back: 117 ms of a 770 ms step for a top-2-of-8 MoE at d_model
384 on one CPU core, 6× what torch's fused AdamW on the same parameters takes. Here: one foreach conversion of the
gradients into fp32 buffers, one foreach norm (which also detects a non-finite gradient), the clip on the fp32
gradients, the fused step, one foreach copy back (49 ms there).

The steps are DeepSpeed's wrapper's bit for bit but for one thing: that wrapper takes a step with zero gradients
when it is built (to create the optimiser's state), which decays the weights once and counts one Adam step more
for the bias correction; this one does not. Its state dict has that wrapper's two keys (`optimizer_state_dict`,
`fp32_groups`), so checkpoints load either way.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import torch


def uses_master_weights(precision: str, zero_stage: int, ep_size: int, optimizer: str) -> bool:
    """Whether the engine steps with `MasterWeights`: bf16 AdamW without ZeRO on one expert-parallel rank. With
    experts spread, the clipping norm would need their ranks' sums (DeepSpeed's wrapper leaves expert gradients
    out of it); ZeRO partitions fp32 copies of its own; the matrix optimisers keep DeepSpeed's wrapper."""
    return precision == "bf16" and zero_stage == 0 and ep_size == 1 and optimizer == "adamw"


class MasterWeights(torch.optim.Optimizer):
    """Steps fp32 masters of low-precision parameters with the fp32 optimiser `build` makes over their groups.
    `param_groups` are the model's (set the learning rate there); each step copies their hyperparameters to the
    inner optimiser's. The gradients are clipped to `max_grad_norm` (0: not clipped); their norm before clipping
    is `_global_grad_norm` (the name DeepSpeed reads), and a non-finite norm skips the step (`overflow`)."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        max_grad_norm: float = 0.0,
    ) -> None:
        super().__init__(groups, {})
        self.masters = [[p.detach().float() for p in g["params"]] for g in self.param_groups]
        # fp32 gradients, kept between steps: allocated per step they cost more than the step's own work on a CPU
        # (first-touch page faults: 60 vs 14 ms per step for 27M parameters); `training_memory` counts them
        for master in itertools.chain.from_iterable(self.masters):
            master.grad = torch.empty_like(master)
        self.optimizer = build(
            [{**g, "params": ms} for g, ms in zip(self.param_groups, self.masters, strict=True)]
        )
        self.max_grad_norm = max_grad_norm
        self._global_grad_norm = float("nan")
        self.overflow = False

    def _flat(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The model's parameters and their masters, in the same order."""
        low = [p for g in self.param_groups for p in g["params"]]
        return low, list(itertools.chain.from_iterable(self.masters))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # noqa: ARG002 (no closures)
        low, masters = self._flat()
        grads = [m.grad for m in masters]
        given = [(g, p.grad) for p, g in zip(low, grads, strict=True) if p.grad is not None]
        for p, grad in zip(low, grads, strict=True):
            if p.grad is None:  # a parameter the loss did not reach: a zero gradient, as DeepSpeed's wrapper
                grad.zero_()
        if given:
            torch._foreach_copy_(*map(list, zip(*given, strict=True)))
        norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) if grads else 0.0
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        if self.overflow:
            return
        if self.max_grad_norm > 0 and (excess := (norm + 1e-6) / self.max_grad_norm) > 1:  # DeepSpeed's rule
            torch._foreach_mul_(grads, 1.0 / excess)
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.optimizer.step()
        torch._foreach_copy_(low, masters)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def refresh_fp32_params(self) -> None:
        """After the model's weights were loaded without optimiser state (DeepSpeed calls it by this name)."""
        low, masters = self._flat()
        with torch.no_grad():
            torch._foreach_copy_(masters, low)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer_state_dict": self.optimizer.state_dict(), "fp32_groups": self.masters}

    def load_state_dict(self, state_dict: dict[str, Any], load_optimizer_states: bool = True) -> None:
        if load_optimizer_states:
            self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for masters, saved in zip(self.masters, state_dict["fp32_groups"], strict=True):
                torch._foreach_copy_(masters, [s.to(m.device) for m, s in zip(masters, saved, strict=True)])
