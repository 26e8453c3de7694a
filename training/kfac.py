"""K-FAC preconditioning of linear layers (Martens & Grosse 2015; issue 19's groundwork, not an optimiser option
yet).

For a linear layer s = W·a (a with a trailing 1 when it has a bias) the Fisher block is approximated by the
Kronecker product A ⊗ G of the input second moment A = E[a aᵀ] and the output-gradient second moment
G = E[(∂ℓ/∂s)(∂ℓ/∂s)ᵀ] over tokens. A forward hook per layer keeps its input and, through a hook on its output,
the output's gradient; `update_factors` folds both into exponential moving averages after each backward;
`precondition` replaces each layer's gradient [∂W | ∂b] by (G + λ_G I)⁻¹ [∂W | ∂b] (A + λ_A I)⁻¹, with the
damping split by Martens' π = √((tr A / dim A) / (tr G / dim G)): λ_A = π√λ, λ_G = √λ/π. The inverses are
refreshed every `update_every` calls. The loss is taken to be a mean over the n tokens of the batch, so the
per-token gradient is n·∂L/∂s.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class KFAC:
    """Collects Kronecker factors of `layers` through hooks and preconditions their gradients in place."""

    def __init__(
        self, layers: dict[str, nn.Linear], damping: float = 1e-3, decay: float = 0.95, update_every: int = 10
    ) -> None:
        if damping <= 0 or not 0 <= decay < 1 or update_every < 1:
            raise ValueError(
                f"K-FAC needs damping > 0, decay in [0, 1) and update_every >= 1 (got {damping}, {decay}, "
                f"{update_every})"
            )
        self.layers, self.damping, self.decay, self.update_every = layers, damping, decay, update_every
        self.inputs: dict[str, Tensor] = {}
        self.output_grads: dict[str, Tensor] = {}
        self.a: dict[str, Tensor] = {}
        self.g: dict[str, Tensor] = {}
        self.inverses: dict[str, tuple[Tensor, Tensor]] = {}
        self.calls = 0
        self.handles = [layer.register_forward_hook(self._collect(name)) for name, layer in layers.items()]

    def _collect(self, name: str):
        """A forward hook keeping the layer's input and, through a hook on its output, the output's gradient."""

        def save_grad(grad: Tensor) -> None:
            self.output_grads[name] = grad.detach().reshape(-1, grad.shape[-1])

        def hook(_layer: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            if output.requires_grad:
                self.inputs[name] = args[0].detach().reshape(-1, args[0].shape[-1])
                output.register_hook(save_grad)

        return hook

    def homogeneous(self, name: str) -> Tensor:
        """The layer's inputs (n, in), with a column of ones when it has a bias."""
        a = self.inputs[name]
        return torch.cat([a, a.new_ones(a.shape[0], 1)], 1) if self.layers[name].bias is not None else a

    @torch.no_grad()
    def update_factors(self) -> None:
        """Fold the last forward/backward's factors into the running averages (call after `backward`)."""
        for name in self.layers:
            a = self.homogeneous(name).double()
            g = self.output_grads[name].double()
            n = a.shape[0]
            a_new, g_new = a.T @ a / n, n * (g.T @ g)  # n·Σ gᵢgᵢᵀ = E[(n·gᵢ)(n·gᵢ)ᵀ], n·gᵢ = ∂ℓᵢ/∂s
            if name in self.a:
                self.a[name] = self.decay * self.a[name] + (1 - self.decay) * a_new
                self.g[name] = self.decay * self.g[name] + (1 - self.decay) * g_new
            else:
                self.a[name], self.g[name] = a_new, g_new

    def damped(self, name: str) -> tuple[Tensor, Tensor]:
        """(A + π√λ I, G + √λ/π I) of a layer."""
        a, g = self.a[name], self.g[name]
        pi = math.sqrt(float(torch.trace(a) / a.shape[0]) / max(float(torch.trace(g) / g.shape[0]), 1e-30))
        root = math.sqrt(self.damping)
        eye_a = torch.eye(a.shape[0], dtype=a.dtype)
        eye_g = torch.eye(g.shape[0], dtype=g.dtype)
        return a + pi * root * eye_a, g + root / pi * eye_g

    @torch.no_grad()
    def precondition(self) -> None:
        """Replace every layer's gradient by its K-FAC-preconditioned one (inverses refreshed every
        `update_every` calls)."""
        if self.calls % self.update_every == 0:
            self.inverses = {
                name: tuple(torch.linalg.inv(m) for m in self.damped(name)) for name in self.layers
            }
        self.calls += 1
        for name, layer in self.layers.items():
            a_inv, g_inv = self.inverses[name]
            grad = layer.weight.grad
            if layer.bias is not None:
                grad = torch.cat([grad, layer.bias.grad.unsqueeze(1)], 1)
            new = (g_inv @ grad.double() @ a_inv).to(layer.weight.grad.dtype)
            layer.weight.grad.copy_(new[:, : layer.weight.shape[1]])
            if layer.bias is not None:
                layer.bias.grad.copy_(new[:, -1])

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
