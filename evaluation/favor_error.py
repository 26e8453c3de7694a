"""How well FAVOR+ would stand in for a trained softmax model's own attention, layer by layer.

On held-out text, every softmax layer's queries and keys (after RoPE) and values are taken from the model's
forward pass; FAVOR+ (`training/model/linear_attention.py`) with m random features replaces the exact causal softmax
attention on those same inputs, and the relative error ‖FAVOR+ − exact‖_F / ‖exact‖_F of the attention outputs
is averaged over independent draws of the projection. Errors fall roughly like m^(-1/2) until the model's
attention is too peaked for the positive features (large ‖q‖·‖k‖ inflates the estimator's variance).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from training.model.linear_attention import causal_linear_attention, favor_features, orthogonal_features
from training.model.transformer import Attention, Transformer, apply_rope


def attention_inputs(model: Transformer, batches: list[Tensor]) -> list[list[tuple[Tensor, Tensor, Tensor]]]:
    """Per layer, per batch: (q, k, v) of shape (B, H, T, D) as the layer computes them (kv heads repeated)."""
    captured: list[list[tuple[Tensor, Tensor, Tensor]]] = [[] for _ in model.model.layers]

    def hook(index: int, attn: Attention):
        def capture(_module: Attention, args: tuple, _output: Tensor) -> None:
            x, rope = args[0], args[1]
            b, t, _ = x.shape
            q = attn.q_proj(x).view(b, t, attn.n_heads, attn.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
            repeat = attn.n_heads // attn.n_kv_heads
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            captured[index].append(
                (q.float(), k.repeat_interleave(repeat, 1).float(), v.repeat_interleave(repeat, 1).float())
            )

        return capture

    handles = [
        layer.self_attn.register_forward_hook(hook(i, layer.self_attn))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            for batch in batches:
                model(batch)
    finally:
        for handle in handles:
            handle.remove()
    return captured


def favor_error(
    model: Transformer, batches: list[Tensor], features: list[int], draws: int = 4, seed: int = 0
) -> dict[str, dict[int, float]]:
    """{"layer<i>": {m: mean relative error over `draws` projections}} of a softmax model."""
    if model.cfg.attention != "softmax":
        raise ValueError(f"FAVOR+'s error is measured against softmax attention, not {model.cfg.attention}")
    scale, d = model.cfg.attn_scale, model.cfg.head_dim
    errors: dict[str, dict[int, float]] = {}
    with torch.no_grad():
        for index, inputs in enumerate(attention_inputs(model, batches)):
            exact = [
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale) for q, k, v in inputs
            ]
            per_m = {}
            for m in features:
                total = 0.0
                for draw in range(draws):
                    w = orthogonal_features(m, d, torch.Generator().manual_seed(seed + 1000 * index + draw))
                    approx = [
                        causal_linear_attention(
                            favor_features(q, w, True, scale), favor_features(k, w, False, scale), v
                        )
                        for q, k, v in inputs
                    ]
                    difference = sum(
                        float((a - e).square().sum()) for a, e in zip(approx, exact, strict=True)
                    )
                    norm = sum(float(e.square().sum()) for e in exact)
                    total += (difference / norm) ** 0.5
                per_m[m] = total / draws
            errors[f"layer{index}"] = per_m
    return errors
