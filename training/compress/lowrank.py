"""Low-rank factorisation of one weight matrix by truncated SVD (issue 18's core).

W (m, n) ≈ A·B with A = U_r·diag(σ_r) (m, r) and B = V_rᵀ (r, n): the best rank-r approximation in the Frobenius
and spectral norms (Eckart–Young), with ‖W − AB‖_F² = Σ_{i>r} σ_i² and ‖W − AB‖_2 = σ_{r+1}. The rank is given, or
the smallest that keeps a share `energy` of Σσ². Storing the factors pays when r·(m + n) < m·n.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class Factors:
    """W ≈ a @ b, plus the singular values left out (the error bound)."""

    a: Tensor  # (m, r)
    b: Tensor  # (r, n)
    discarded: Tensor  # σ_{r+1}, ..., σ_min(m,n)

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    def frobenius_error_bound(self) -> float:
        return float(self.discarded.double().square().sum().sqrt())

    def spectral_error_bound(self) -> float:
        return float(self.discarded[0]) if len(self.discarded) else 0.0


def rank_for_energy(singular_values: Tensor, energy: float) -> int:
    """The smallest r whose leading singular values hold `energy` of Σσ² (0 < energy ≤ 1)."""
    if not 0.0 < energy <= 1.0:
        raise ValueError(f"retained energy {energy} must lie in (0, 1]")
    share = singular_values.double().square().cumsum(0) / singular_values.double().square().sum()
    return int(torch.searchsorted(share, torch.tensor(energy, dtype=share.dtype) - 1e-12)) + 1


def factorize(
    weight: Tensor, rank: int | None = None, energy: float | None = None, name: str = "layer"
) -> Factors:
    """The rank-`rank` (or `energy`-retaining) truncated SVD of `weight`, as two factors in its dtype."""
    if (rank is None) == (energy is None):
        raise ValueError(f"{name}: give exactly one of rank or energy")
    u, s, vh = torch.linalg.svd(weight.detach().double(), full_matrices=False)
    if rank is None:
        rank = rank_for_energy(s, energy)
    if not 1 <= rank <= min(weight.shape):
        raise ValueError(
            f"{name}: rank {rank} is outside [1, {min(weight.shape)}] for a {tuple(weight.shape)} matrix; pick a rank "
            f"up to min(m, n) = {min(weight.shape)}"
        )
    dtype = weight.dtype if weight.is_floating_point() else torch.float32
    return Factors((u[:, :rank] * s[:rank]).to(dtype), vh[:rank].to(dtype), s[rank:].to(dtype))


class LowRankLinear(nn.Module):
    """y = x·Bᵀ·Aᵀ + bias: a linear layer held as its two factors (`b` then `a`, state-dict keys `a`, `b`) and the
    layer's bias, kept whole (Qwen2's q/k/v projections have one)."""

    def __init__(self, a: Tensor, b: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        # row-major copies: SVD factors come column-major, and a stored-then-loaded variant must run the same kernels
        self.a = nn.Parameter(a.detach().clone(memory_format=torch.contiguous_format), requires_grad=False)
        self.b = nn.Parameter(b.detach().clone(memory_format=torch.contiguous_format), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def in_features(self) -> int:
        return self.b.shape[1]

    @property
    def out_features(self) -> int:
        return self.a.shape[0]

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(nn.functional.linear(x, self.b), self.a, self.bias)

    def dense(self) -> Tensor:
        """The (out, in) weight the factors stand for."""
        return self.a @ self.b
