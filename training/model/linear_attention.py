"""Causal attention in O(T) memory: the cores behind `model.attention: linear | favor` (`training/model/transformer.py`).

Linear attention (Katharopoulos et al. 2020) replaces softmax(qᵀk) by a kernel φ(q)ᵀφ(k) with a positive feature
map φ, so causal attention becomes running sums: out_t = φ(q_t)ᵀ S_t / φ(q_t)ᵀ z_t with S_t = Σ_{s≤t} φ(k_s) v_sᵀ
and z_t = Σ_{s≤t} φ(k_s). `causal_linear_attention` evaluates that over a sequence in chunks (within a chunk a
masked product, across chunks the carried state); given a `LinearState` it starts from and updates that state,
which is how generation runs: a fixed-size state per layer instead of a KV cache.

FAVOR+ (Choromanski et al. 2021) picks φ so that φ(q)ᵀφ(k) is an unbiased estimate of the softmax kernel
exp(s·qᵀk) (s = 1/√d by default): positive random features φ(x) = exp(Wx − ‖x‖²/2)/√m on x = q·√s, with the m
rows of W drawn orthogonal in blocks of d (`orthogonal_features`), which lowers the estimator's variance.

Shapes: q, k (B, H, T, D); v (B, H, T, E); features (B, H, T, M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64  # tokens per chunk of `causal_linear_attention` (training/model/accounting.py counts its FLOPs)


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


def favor_features(x: Tensor, w: Tensor, is_query: bool, scale: float | None = None) -> Tensor:
    """Positive random features of queries or keys x (…, T, D) with projection w (M, D), for the softmax kernel
    exp(scale·qᵀk) (default scale 1/√D). A query row's max is subtracted inside exp (it cancels between numerator
    and denominator); keys get none, so no key depends on another (causality stays exact): wᵀx − ‖x‖²/2 ≤
    ‖w‖²/2 ≈ D/2 bounds the exponent."""
    x = x * math.sqrt(scale if scale is not None else x.shape[-1] ** -0.5)
    projected = x @ w.T  # (…, T, M)
    exponent = projected - x.square().sum(-1, keepdim=True) / 2
    if is_query:
        exponent = exponent - projected.amax(-1, keepdim=True)
    return torch.exp(exponent) / math.sqrt(w.shape[0])


@dataclass
class LinearState:
    """The running sums of one layer: S (B, H, M, E), z (B, H, M), and the positions they hold."""

    state: Tensor
    normaliser: Tensor
    length: int = 0

    @classmethod
    def empty(cls, batch: int, heads: int, m: int, e: int, like: Tensor) -> LinearState:
        return cls(like.new_zeros(batch, heads, m, e), like.new_zeros(batch, heads, m))


def causal_linear_attention(
    q_features: Tensor, k_features: Tensor, v: Tensor, chunk: int = CHUNK, state: LinearState | None = None
) -> Tensor:
    """Causal attention with kernel φ(q)ᵀφ(k) given the features (B, H, T, M) and values (B, H, T, E): chunks of
    `chunk` tokens, memory O(T·(M + E) + M·E) instead of O(T²). With `state`, the sequence continues the one the
    state holds, and the state is advanced past it."""
    b, h, t, m = q_features.shape
    if state is None:
        state = LinearState.empty(b, h, m, v.shape[-1], q_features)
    running, normaliser = state.state, state.normaliser
    tiny = torch.finfo(q_features.dtype).tiny  # features are positive: only an underflow can leave a zero
    outputs = []
    for start in range(0, t, chunk):
        qf, kf, vc = (x[:, :, start : start + chunk] for x in (q_features, k_features, v))
        mask = torch.ones(qf.shape[2], qf.shape[2], dtype=torch.bool, device=qf.device).tril()
        scores = (qf @ kf.transpose(-1, -2)) * mask  # within the chunk: s ≤ t only
        numerator = scores @ vc + qf @ running
        denominator = scores.sum(-1) + (qf * normaliser.unsqueeze(2)).sum(-1)
        outputs.append(numerator / denominator.clamp_min(tiny).unsqueeze(-1))
        running = running + kf.transpose(-1, -2) @ vc
        normaliser = normaliser + kf.sum(2)
    state.state, state.normaliser, state.length = running, normaliser, state.length + t
    return torch.cat(outputs, dim=2)
