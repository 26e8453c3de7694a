"""K-FAC (Martens & Grosse 2015) as an optimiser for the weights of bias-free linear layers.

For a linear layer s = W·a the Fisher block is approximated by the Kronecker product A ⊗ G of the input second
moment A = E[a aᵀ] and the output-gradient second moment G = E[(∂ℓ/∂s)(∂ℓ/∂s)ᵀ] over tokens (ℓ a token's own
loss: the batch loss is taken to be a mean over the n tokens of a micro-batch, so ∂ℓ/∂s = n·∂L/∂s, and the
gradient accumulation's 1/k is undone by `grad_scale`). A forward hook per layer keeps its input and, through a
hook on its output, folds both moments into the micro-batch sums; `step` turns them into moving averages
(averaged over data-parallel ranks), refreshes the damped inverses every `update_every` steps and replaces each
gradient ∇ by (G + λ_G I)⁻¹ ∇ (A + λ_A I)⁻¹, with the damping split by Martens' π = √((tr A / dim A) /
(tr G / dim G)): λ_A = π√λ, λ_G = √λ/π. The step itself is SGD with momentum and decoupled weight decay on the
preconditioned gradients, scaled down when the predicted change of the model, Σ lr²⟨P, ∇⟩, exceeds `kl_clip`
(Ba et al. 2017).

Factors and inverses are optimiser state (fp32, so a checkpoint round trip is exact); the parameters may be
DeepSpeed's fp32 copies of the layers' weights: parameter i of the groups belongs to layer i.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

KL_CLIP = 1e-3


class KFAC(torch.optim.Optimizer):
    """K-FAC-preconditioned SGD with momentum over `groups`, whose parameters are the weights of `layers` in
    order."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        layers: list[nn.Linear],
        *,
        lr: float = 1e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        damping: float = 1e-3,
        decay: float = 0.95,
        update_every: int = 10,
        grad_scale: float = 1.0,
    ) -> None:
        if damping <= 0 or not 0 <= decay < 1 or update_every < 1:
            raise ValueError(
                f"K-FAC needs damping > 0, decay in [0, 1) and update_every >= 1 (got {damping}, {decay}, "
                f"{update_every})"
            )
        params = [p for g in groups for p in g["params"]]
        if [id(p) for p in params] != [id(layer.weight) for layer in layers]:
            raise ValueError("K-FAC's parameters must be the weights of its layers, in the same order")
        if any(layer.bias is not None for layer in layers):
            raise ValueError("K-FAC here preconditions bias-free linear layers only")
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay}
        super().__init__(groups, defaults)
        self.layers, self.damping, self.decay = layers, damping, decay
        self.update_every, self.grad_scale = update_every, grad_scale
        self.pending: dict[int, list[Any]] = {}  # layer → [Σ A, Σ G, micro-batches] since the last step
        self.handles = [layer.register_forward_hook(self._collect(i)) for i, layer in enumerate(layers)]

    def _collect(self, index: int):
        """A forward hook keeping the layer's input and, on its output's gradient, adding both moments."""

        def hook(_layer: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            if not output.requires_grad:
                return
            a = args[0].detach().reshape(-1, args[0].shape[-1]).double()

            def add_moments(grad: Tensor) -> None:
                g = grad.detach().reshape(-1, grad.shape[-1]).double() * self.grad_scale
                n = a.shape[0]
                sums = self.pending.setdefault(index, [0.0, 0.0, 0])
                sums[0] = sums[0] + a.T @ a / n
                sums[1] = sums[1] + n * (g.T @ g)  # E[(n·gᵢ)(n·gᵢ)ᵀ] = n·Σ gᵢgᵢᵀ
                sums[2] += 1

            output.register_hook(add_moments)

        return hook

    def params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    @torch.no_grad()
    def update_factors(self) -> None:
        """Fold the micro-batches since the last step into the moving averages A, G (averaged over ranks)."""
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        for index, p in enumerate(self.params()):
            if index not in self.pending:
                continue
            a_sum, g_sum, count = self.pending.pop(index)
            a_new, g_new = (a_sum / count).to(p.dtype), (g_sum / count).to(p.dtype)
            if distributed:
                for factor in (a_new, g_new):
                    dist.all_reduce(factor)
                    factor /= dist.get_world_size()
            state = self.state[p]
            if "a" in state:
                state["a"].mul_(self.decay).add_(a_new, alpha=1 - self.decay)
                state["g"].mul_(self.decay).add_(g_new, alpha=1 - self.decay)
            else:
                state["a"], state["g"] = a_new, g_new

    def damped(self, p: Tensor) -> tuple[Tensor, Tensor]:
        """(A + π√λ I, G + √λ/π I) of a parameter's layer, in float64."""
        a, g = self.state[p]["a"].double(), self.state[p]["g"].double()
        pi = math.sqrt(float(torch.trace(a) / a.shape[0]) / max(float(torch.trace(g) / g.shape[0]), 1e-30))
        root = math.sqrt(self.damping)
        eye_a = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
        eye_g = torch.eye(g.shape[0], dtype=g.dtype, device=g.device)
        return a + pi * root * eye_a, g + root / pi * eye_g

    @torch.no_grad()
    def precondition(self) -> float:
        """Replace every gradient by its K-FAC-preconditioned one P (inverses refreshed every `update_every`
        calls); returns the predicted change Σ lr²⟨P, ∇⟩."""
        first = self.param_groups[0]
        refresh = first.get("kfac_step", 0) % self.update_every == 0
        first["kfac_step"] = first.get("kfac_step", 0) + 1
        change = 0.0
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if p.grad is None or "a" not in state:
                    continue
                if refresh or "a_inv" not in state:
                    a_damped, g_damped = self.damped(p)
                    state["a_inv"] = torch.linalg.inv(a_damped).to(p.dtype)
                    state["g_inv"] = torch.linalg.inv(g_damped).to(p.dtype)
                grad = p.grad.double()
                new = state["g_inv"].double() @ grad @ state["a_inv"].double()
                change += group["lr"] ** 2 * float((new * grad).sum())
                p.grad.copy_(new.to(p.grad.dtype))
        return change

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Precondition, then SGD with momentum and decoupled weight decay, KL-clipped."""
        self.update_factors()
        change = self.precondition()
        scale = min(1.0, math.sqrt(KL_CLIP / change)) if change > 0 else 1.0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.get("momentum")
                if buf is None:
                    buf = state["momentum"] = torch.zeros_like(p)
                buf.mul_(group["momentum"]).add_(p.grad, alpha=scale)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(buf, alpha=-group["lr"])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
