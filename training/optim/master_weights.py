"""fp32 master weights for a model trained in bf16: the model's weights and gradients stay bf16 (what the forward
and backward pass compute in); the optimiser steps fp32 copies and writes them back rounded (Micikevicius et al.
2018, "Mixed precision training"; without loss scaling, which bf16's exponent range does not need).

DeepSpeed's own wrapper for this case (ZeRO-0 with bf16: `FP16_UnfusedOptimizer`) works tensor by tensor: an
overflow scan (amax and amin of every gradient), an fp32 copy of every gradient for its norm and another for the
step, an unscale multiply by 1.0, the step, a copy back: 117 ms of a 770 ms step for a top-2-of-8 MoE at d_model
384 on one CPU core, 6× what torch's fused AdamW on the same parameters takes. Here: one foreach conversion of the
gradients into fp32 buffers, one foreach norm (which also detects a non-finite gradient), the clip on the fp32
gradients, the fused step, one foreach copy back (49 ms there).

Compiled (`compiled=True`, as `training.compile.compiles_optimizer` decides): Inductor fuses each tensor's step
into one loop that reads the bf16 gradient, clips it, steps AdamW on the fp32 master and writes the bf16 weight,
one pass over memory instead of five, and no fp32 gradient copies are kept: 22 vs 42 ms for the 13.4M parameters
of d_model 384 on one CPU core, the gradients' norm (a compiled sum of squares of the bf16 gradients) included.
It compiles on the first step (15 s from a cold Inductor cache at d_model 384, 3 s warm); should that fail, it
steps eagerly, with a warning. The inner optimiser keeps the state (`exp_avg`, `exp_avg_sq`, `step`), so
checkpoints move between the two paths.

The steps are DeepSpeed's wrapper's bit for bit but for one thing: that wrapper takes a step with zero gradients
when it is built (to create the optimiser's state), which decays the weights once and counts one Adam step more
for the bias correction; this one does not. Its state dict has that wrapper's two keys (`optimizer_state_dict`,
`fp32_groups`), so checkpoints load either way.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def uses_master_weights(precision: str, zero_stage: int, ep_size: int, optimizer: str) -> bool:
    """Whether the engine steps with `MasterWeights`: bf16 AdamW without ZeRO on one expert-parallel rank. With
    experts spread, the clipping norm would need their ranks' sums (DeepSpeed's wrapper leaves expert gradients
    out of it); ZeRO partitions fp32 copies of its own; the matrix optimisers keep DeepSpeed's wrapper."""
    return precision == "bf16" and zero_stage == 0 and ep_size == 1 and optimizer == "adamw"


def _sum_of_squares(grads: list[Tensor]) -> Tensor:
    """Σ of the squared entries of all `grads`, in fp32."""
    return torch.stack([g.float().square().sum() for g in grads]).sum()


def _adamw(
    weights: list[Tensor],
    grads: list[Tensor],
    masters: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    scalars: Tensor,
) -> None:
    """A group's clipped AdamW step on its fp32 `masters`, written back into the low-precision `weights`, as
    torch's fused AdamW computes it. `scalars`: clip factor, lr, weight decay, β1, β2, ε, 1 − β1^t, √(1 − β2^t)."""
    clip, lr, weight_decay, beta1, beta2, eps, bias1, bias2_sqrt = scalars.unbind()
    for weight, grad, master, exp_avg, exp_avg_sq in zip(
        weights, grads, masters, exp_avgs, exp_avg_sqs, strict=True
    ):
        g = grad.float() * clip
        master.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).add_((1 - beta2) * g * g)
        master.sub_(lr / bias1 * exp_avg / (exp_avg_sq.sqrt() / bias2_sqrt + eps))
        weight.copy_(master)


@functools.cache
def _kernels() -> tuple[Callable[..., Tensor], Callable[..., None]]:
    """`_sum_of_squares` and `_adamw` compiled: one graph per group's list of shapes, each tensor's work fused
    into one loop (static shapes: a graph per tensor of symbolic size ran 27 vs 20 ms, its calls' overhead)."""
    return (
        torch.compile(_sum_of_squares, dynamic=False, fullgraph=True),
        torch.compile(_adamw, dynamic=False, fullgraph=True),
    )


class MasterWeights(torch.optim.Optimizer):
    """Steps fp32 masters of low-precision parameters with the fp32 optimiser `build` makes over their groups.
    `param_groups` are the model's (set the learning rate there); each step copies their hyperparameters to the
    inner optimiser's. The gradients are clipped to `max_grad_norm` (0: not clipped); their norm before clipping
    is `_global_grad_norm` (the name DeepSpeed reads), and a non-finite norm skips the step (`overflow`).
    `compiled`: step torch AdamW's math in one compiled pass per tensor (module docstring); the inner optimiser
    must then be a `torch.optim.AdamW` (not amsgrad, not maximize)."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer],
        max_grad_norm: float = 0.0,
        compiled: bool = False,
    ) -> None:
        super().__init__(groups, {})
        self.masters = [[p.detach().float() for p in g["params"]] for g in self.param_groups]
        self.optimizer = build(
            [{**g, "params": ms} for g, ms in zip(self.param_groups, self.masters, strict=True)]
        )
        self.max_grad_norm = max_grad_norm
        self._global_grad_norm = float("nan")
        self.overflow = False
        self.compiled = compiled
        self._compiles = compiled  # until the compiled step first ran: its failures are the compiler's
        if compiled:
            inner = self.optimizer
            if not isinstance(inner, torch.optim.AdamW) or any(
                g["amsgrad"] or g["maximize"] for g in inner.param_groups
            ):
                raise ValueError("MasterWeights(compiled=True) steps AdamW's math: build a torch.optim.AdamW")
        else:
            self._keep_fp32_grads()

    def _keep_fp32_grads(self) -> None:
        """fp32 gradient buffers for the eager step, kept between steps: allocated per step they cost more than
        the step's own work on a CPU (first-touch page faults: 60 vs 14 ms per step for 27M parameters);
        `training_memory` counts them."""
        for master in itertools.chain.from_iterable(self.masters):
            master.grad = torch.empty_like(master)

    def _flat(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The model's parameters and their masters, in the same order."""
        low = [p for g in self.param_groups for p in g["params"]]
        return low, list(itertools.chain.from_iterable(self.masters))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # noqa: ARG002 (no closures)
        if self.compiled:
            self._compiled_step()
            return
        low, masters = self._flat()
        grads = [m.grad for m in masters]
        given = [(g, p.grad) for p, g in zip(low, grads, strict=True) if p.grad is not None]
        for p, grad in zip(low, grads, strict=True):
            if p.grad is None:  # a parameter the loss did not reach: a zero gradient, as DeepSpeed's wrapper
                grad.zero_()
        if given:
            torch._foreach_copy_(*map(list, zip(*given, strict=True)))
        norm = float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))) if grads else 0.0
        if (clip := self._clip_factor(norm)) is None:
            return
        if clip < 1:
            torch._foreach_mul_(grads, clip)
        for outer, inner in zip(self.param_groups, self.optimizer.param_groups, strict=True):
            inner.update({k: v for k, v in outer.items() if k != "params"})
        self.optimizer.step()
        torch._foreach_copy_(low, masters)

    def _compiled_step(self) -> None:
        """`step` through the compiled kernels, from the low-precision gradients. A group's parameters step
        together (a missing gradient is a zero one), so one step count serves the group. Should the kernels
        fail to compile on the first step before a group stepped, this step and the later ones run eagerly."""
        sum_of_squares, adamw = _kernels()
        # per group; a parameter the loss did not reach has a zero gradient, as with DeepSpeed's wrapper
        grads = [
            [torch.zeros_like(p) if p.grad is None else p.grad for p in g["params"]]
            for g in self.param_groups
        ]
        flat = list(itertools.chain.from_iterable(grads))
        stepped = False
        try:
            if (clip := self._clip_factor(float(sum_of_squares(flat).sqrt()) if flat else 0.0)) is None:
                return
            for outer, inner, masters, group_grads in zip(
                self.param_groups, self.optimizer.param_groups, self.masters, grads, strict=True
            ):
                inner.update({k: v for k, v in outer.items() if k != "params"})
                if not masters:
                    continue
                states = [self._state(m) for m in masters]
                t = float(states[0]["step"]) + 1
                beta1, beta2 = inner["betas"]
                scalars = [clip, inner["lr"], inner["weight_decay"], beta1, beta2, inner["eps"]]
                scalars += [1 - beta1**t, math.sqrt(1 - beta2**t)]
                adamw(
                    [p.detach() for p in outer["params"]],
                    group_grads,
                    masters,
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    torch.tensor(scalars, device=masters[0].device),
                )
                torch._foreach_add_([s["step"] for s in states], 1.0)
                stepped = True
            self._compiles = False
        except Exception as error:  # on the first step, a compiler failure: the eager step is as correct
            if not self._compiles or stepped:
                raise
            first_line = (str(error).strip().splitlines() or [""])[0][:200]
            warnings.warn(
                f"MasterWeights: compiling the step failed ({first_line}); stepping eagerly", stacklevel=3
            )
            self.compiled = False
            self._keep_fp32_grads()
            self.step()

    def _clip_factor(self, norm: float) -> float | None:
        """Records the gradients' `norm` and whether it is not finite (`overflow`: None, no step), and returns the
        factor that clips them to `max_grad_norm` by DeepSpeed's rule (1: not clipped)."""
        self._global_grad_norm = norm
        self.overflow = not math.isfinite(norm)
        if self.overflow:
            return None
        excess = (norm + 1e-6) / self.max_grad_norm if self.max_grad_norm > 0 else 1.0
        return 1.0 / excess if excess > 1 else 1.0

    def _state(self, master: Tensor) -> dict[str, Tensor]:
        """The inner AdamW's state for `master`, created as torch creates it."""
        state = self.optimizer.state[master]
        if not state:
            state["step"] = torch.tensor(0.0, device=master.device)
            state["exp_avg"] = torch.zeros_like(master)
            state["exp_avg_sq"] = torch.zeros_like(master)
        return state

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
