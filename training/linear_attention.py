"""Causal attention in O(T) memory (issue 19's groundwork; no model option uses it yet).

Linear attention (Katharopoulos et al. 2020) replaces softmax(qᵀk) by a kernel φ(q)ᵀφ(k) with a positive feature
map φ, so causal attention becomes running sums: out_t = φ(q_t)ᵀ S_t / φ(q_t)ᵀ z_t with S_t = Σ_{s≤t} φ(k_s) v_sᵀ
and z_t = Σ_{s≤t} φ(k_s). `causal_linear_attention` evaluates that over a sequence in chunks (within a chunk a
masked product, across chunks the carried state), `LinearState` one token at a time for generation: a fixed-size
state instead of a KV cache.

FAVOR+ (Choromanski et al. 2021) picks φ so that φ(q)ᵀφ(k) is an unbiased estimate of the softmax kernel
exp(qᵀk/√d): positive random features φ(x) = exp(Wx − ‖x‖²/2)/√m on x = q·d^(-1/4), with the m rows of W
drawn orthogonal in blocks of d (`orthogonal_features`), which lowers the estimator's variance.

Shapes: q, k (B, H, T, D); v (B, H, T, E); features (B, H, T, M).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

FeatureMap = Callable[[Tensor], Tensor]


def elu_features(x: Tensor) -> Tensor:
    """Katharopoulos et al.'s map: elu(x) + 1 (positive, same width)."""
    return F.elu(x) + 1.0


def orthogonal_features(m: int, d: int, generator: torch.Generator | None = None) -> Tensor:
    """FAVOR+'s projection (m, d): blocks of d orthogonal rows (QR of a Gaussian), each row rescaled to the norm
    of a Gaussian vector, so every row is marginally N(0, I) while rows in a block stay orthogonal."""
    if m < 1:
        raise ValueError(f"FAVOR+ needs at least one random feature, got {m}")
    blocks = []
    for _ in range(-(-m // d)):
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=generator))
        blocks.append(q.T)
    w = torch.cat(blocks)[:m]
    return w * torch.randn(m, d, generator=generator).norm(dim=1, keepdim=True)


def favor_features(x: Tensor, w: Tensor, is_query: bool) -> Tensor:
    """Positive random features of queries or keys x (…, T, D) with projection w (M, D), for the softmax kernel
    exp(qᵀk/√D). A query row's max is subtracted inside exp (it cancels between numerator and denominator);
    keys get none, so no key depends on another (causality stays exact): wᵀx − ‖x‖²/2 ≤ ‖w‖²/2 ≈ D/2 bounds
    the exponent."""
    x = x * x.shape[-1] ** -0.25
    projected = x @ w.T  # (…, T, M)
    exponent = projected - x.square().sum(-1, keepdim=True) / 2
    if is_query:
        exponent = exponent - projected.amax(-1, keepdim=True)
    return torch.exp(exponent) / math.sqrt(w.shape[0])


def causal_linear_attention(
    q_features: Tensor, k_features: Tensor, v: Tensor, chunk: int = 64, eps: float = 1e-6
) -> Tensor:
    """Causal attention with kernel φ(q)ᵀφ(k) given the features (B, H, T, M) and values (B, H, T, E): chunks of
    `chunk` tokens, memory O(T·(M + E) + M·E) instead of O(T²)."""
    b, h, t, m = q_features.shape
    state = q_features.new_zeros(b, h, m, v.shape[-1])
    normaliser = q_features.new_zeros(b, h, m)
    outputs = []
    for start in range(0, t, chunk):
        qf, kf, vc = (x[:, :, start : start + chunk] for x in (q_features, k_features, v))
        mask = torch.ones(qf.shape[2], qf.shape[2], dtype=torch.bool, device=qf.device).tril()
        scores = (qf @ kf.transpose(-1, -2)) * mask  # within the chunk: s ≤ t only
        numerator = scores @ vc + qf @ state
        denominator = scores.sum(-1) + (qf * normaliser.unsqueeze(2)).sum(-1)
        outputs.append(numerator / (denominator.unsqueeze(-1) + eps))
        state = state + kf.transpose(-1, -2) @ vc
        normaliser = normaliser + kf.sum(2)
    return torch.cat(outputs, dim=2)


@dataclass
class LinearState:
    """The running sums of one layer during generation: S (B, H, M, E) and z (B, H, M)."""

    state: Tensor
    normaliser: Tensor

    @classmethod
    def empty(cls, like: Tensor, m: int, e: int) -> LinearState:
        b, h = like.shape[:2]
        return cls(like.new_zeros(b, h, m, e), like.new_zeros(b, h, m))

    def step(self, q_features: Tensor, k_features: Tensor, v: Tensor, eps: float = 1e-6) -> Tensor:
        """Add one token (features (B, H, 1, M), value (B, H, 1, E)) and return its output (B, H, 1, E)."""
        self.state = self.state + k_features.transpose(-1, -2) @ v
        self.normaliser = self.normaliser + k_features.sum(2)
        numerator = q_features @ self.state
        denominator = (q_features * self.normaliser.unsqueeze(2)).sum(-1, keepdim=True)
        return numerator / (denominator + eps)
