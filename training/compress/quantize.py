"""Weight quantization of one linear layer: round-to-nearest and GPTQ, group-wise, asymmetric (issue 18's core).

Shapes: W (out, in) as `nn.Linear` stores it; X (n, in) calibration inputs; H = 2·XᵀX/n (in, in). Groups are
`group_size` consecutive input columns of a row; each has a scale and a zero point on a `bits`-bit grid
(min-max). GPTQ (Frantar et al. 2022) quantizes columns left to right and spreads each column's error over the
columns not yet quantized through the inverse Hessian: with U the upper Cholesky factor of (H + λI)⁻¹, column q's
error (w_q − Q(w_q)) / U[q,q] times U[q, q:] is subtracted from the remaining weights (the OBS update), in blocks
so the trailing update is one matrix product per block. Both return the dequantized weights (what the layer
computes with) and the integer codes, scales and zero points.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from training.compress.config import SUPPORTED_BITS


@dataclass(frozen=True)
class Quantized:
    """A layer's quantized weights: `weight` = scales · (codes − zeros), group by group."""

    weight: Tensor  # (out, in) dequantized, float32
    codes: Tensor  # (out, in) uint8 in [0, 2^bits)
    scales: Tensor  # (out, in / group_size)
    zeros: Tensor  # (out, in / group_size)
    bits: int
    group_size: int


def check_shape(name: str, weight: Tensor, bits: int, group_size: int) -> None:
    """Refuse what the grid cannot represent, naming the layer."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{name}: {bits}-bit quantization is not supported; use one of {SUPPORTED_BITS}")
    if group_size < 1 or weight.shape[1] % group_size:
        raise ValueError(
            f"{name}: group size {group_size} does not divide its {weight.shape[1]} input columns; pick a divisor "
            f"of {weight.shape[1]}"
        )


def grid(columns: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Per-row scale and zero point of a min-max `bits`-bit grid over `columns` (out, g)."""
    low, high = columns.min(dim=1).values, columns.max(dim=1).values
    scale = ((high - low) / (2**bits - 1)).clamp_min(1e-8)
    return scale, torch.round(-low / scale)


def quantize_columns(w: Tensor, scale: Tensor, zero: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """(codes, dequantized) of columns `w` (out,) or (out, k) on the grid (scale, zero) (out,)."""
    if w.dim() == 2:
        scale, zero = scale[:, None], zero[:, None]
    codes = torch.clamp(torch.round(w / scale) + zero, 0, 2**bits - 1)
    return codes, scale * (codes - zero)


def rtn(weight: Tensor, bits: int, group_size: int, name: str = "layer") -> Quantized:
    """Round-to-nearest: every group on its own min-max grid, no error feedback."""
    check_shape(name, weight, bits, group_size)
    w = weight.detach().float()
    groups = w.shape[1] // group_size
    codes, deq, scales, zeros = torch.empty_like(w), torch.empty_like(w), [], []
    for g in range(groups):
        cols = slice(g * group_size, (g + 1) * group_size)
        scale, zero = grid(w[:, cols], bits)
        codes[:, cols], deq[:, cols] = quantize_columns(w[:, cols], scale, zero, bits)
        scales.append(scale)
        zeros.append(zero)
    return Quantized(
        deq, codes.to(torch.uint8), torch.stack(scales, 1), torch.stack(zeros, 1), bits, group_size
    )


def hessian(inputs: Tensor) -> Tensor:
    """H = 2·XᵀX/n of calibration inputs X (n, in), in float64 for the factorisations that follow."""
    x = inputs.detach().reshape(-1, inputs.shape[-1]).double()
    return 2.0 * x.T @ x / x.shape[0]


def gptq(
    weight: Tensor,
    h: Tensor,
    bits: int,
    group_size: int,
    damp: float = 0.01,
    block: int = 128,
    name: str = "layer",
) -> Quantized:
    """GPTQ with damping λ = `damp`·mean(diag H), column order as stored, lazy block updates. A group's grid is
    set from its (error-updated) weights when its first column comes up."""
    check_shape(name, weight, bits, group_size)
    w = weight.detach().double().clone()
    h = h.double().clone()
    dead = torch.diag(h) == 0  # inputs that never fire carry no information: their weights go to zero
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    block = max(group_size, block // group_size * group_size)  # groups never straddle blocks
    codes = torch.empty_like(w)
    scales, zeros = [], []
    for start in range(0, w.shape[1], block):
        end = min(start + block, w.shape[1])
        w_block, errors = w[:, start:end].clone(), torch.empty(w.shape[0], end - start, dtype=w.dtype)
        u_block = u[start:end, start:end]
        for i in range(end - start):
            if (start + i) % group_size == 0:
                scale, zero = grid(w_block[:, i : i + group_size], bits)
                scales.append(scale)
                zeros.append(zero)
            c, q = quantize_columns(w_block[:, i], scale, zero, bits)
            codes[:, start + i] = c
            errors[:, i] = (w_block[:, i] - q) / u_block[i, i]
            w_block[:, i:] -= errors[:, i : i + 1] * u_block[i : i + 1, i:]
        w[:, end:] -= errors @ u[start:end, end:]
    scales_f, zeros_f = torch.stack(scales, 1).float(), torch.stack(zeros, 1).float()
    # the weights as stored compute them: float32 scales times (codes − zeros), not the float64 working copy
    weight = (codes.float() - zeros_f.repeat_interleave(group_size, 1)) * scales_f.repeat_interleave(
        group_size, 1
    )
    return Quantized(weight, codes.to(torch.uint8), scales_f, zeros_f, bits, group_size)


def pack_codes(codes: Tensor, bits: int) -> Tensor:
    """`codes` (any shape, values in [0, 2^bits)) as a flat uint8 tensor holding `bits` bits per code."""
    flat = codes.reshape(-1).to(torch.int32)
    planes = ((flat[:, None] >> torch.arange(bits)) & 1).reshape(-1)  # least significant bit first
    planes = torch.cat([planes, planes.new_zeros(-len(planes) % 8)]).reshape(-1, 8)
    return (planes << torch.arange(8)).sum(1).to(torch.uint8)


def unpack_codes(packed: Tensor, bits: int, shape: tuple[int, ...]) -> Tensor:
    """The inverse of `pack_codes`: uint8 codes of `shape`."""
    n = int(torch.tensor(shape).prod())
    planes = ((packed.to(torch.int32)[:, None] >> torch.arange(8)) & 1).reshape(-1)[: n * bits]
    return (planes.reshape(n, bits) << torch.arange(bits)).sum(1).to(torch.uint8).reshape(shape)
