"""Decoder-only pre-norm transformer (dense, MoE, or mixed) whose state dict is a Hugging Face Llama/Mixtral one.

References: Vaswani et al. 2017 (transformer); Zhang & Sennrich 2019 (RMSNorm); Su et al. 2021 (RoPE, here in
the Hugging Face `rotate_half` layout, so q/k need no permutation on export); Ainslie et al. 2023 (grouped-query
attention); Shazeer 2020 (SwiGLU); Touvron et al. 2023 (Llama block layout). MoE layers: see `training/model/moe.py`.
`attention: linear | favor` swaps softmax attention for causal linear attention (elu + 1 features) or FAVOR+
random features (`training/model/linear_attention.py`, on the rotated q, k), with a fixed-size state for generation;
such a model has no Llama layout (`has_llama_layout`).

Module names are Hugging Face's (`model.layers.{i}.self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...):
export is a key-for-key copy and PEFT adapters trained here load on the export unchanged.
Model code has no device, precision or distributed logic: callers own autocast, DeepSpeed and placement. The
exceptions are kernel choices that leave results within rounding: short bf16 attention on CPUs
(`explicit_attention_pays`) and the MoE's row padding (`moe.gemm_row_multiple`).

Shape letters: B batch, T query length, S key length, C d_model, H query heads, G kv heads, D head_dim, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.model.config import ModelConfig, RopeScaling
from training.model.cross_entropy import cross_entropy
from training.model.feed_forward import FeedForward
from training.model.linear_attention import (
    LinearState,
    causal_linear_attention,
    elu_features,
    favor_features,
    orthogonal_features,
)
from training.model.moe import MoE, RouterStats


def is_hidden(name: str) -> bool:
    """A hidden matrix: one inside the blocks (μP scales its init and learning rate with width)."""
    return name.startswith("model.layers.") and not name.endswith("norm.weight")


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> Tensor:
    """RoPE's angular frequency per channel pair (D/2,), fp32; Llama 3's scaling (`RopeScaling`) as Meta's reference
    computes it: low frequencies (wavelengths past the original context / low_freq_factor) divided by `factor`,
    high ones kept, the band between interpolated."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is None:
        return inv_freq
    context = scaling.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    between = (wavelength >= context / scaling.high_freq_factor) & (
        wavelength <= context / scaling.low_freq_factor
    )
    return torch.where(between, (1 - smooth) * scaled / scaling.factor + smooth * scaled, scaled)


def rope_tables(
    head_dim: int, positions: Tensor, theta: float, scaling: RopeScaling | None = None
) -> tuple[Tensor, Tensor]:
    """cos, sin (T, D) for absolute positions (T,), channel i paired with i + D/2 (`rotate_half` layout)."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling).to(positions.device)
    angles = positions.float()[:, None] * inv_freq[None, :]  # (T, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, D)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (B, H, T, D) by position: x*cos + rotate_half(x)*sin, in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class LayerKVCache:
    """Keys and values of one layer for incremental decoding, preallocated to `max_len` positions. `padding` (B,):
    how many positions each row's sequence starts after (prompts of different lengths left-padded into one batch):
    those keys are never attended to. Its positions are left shifted: RoPE's scores depend on relative positions
    only, so a row's logits are those of the row alone to float rounding."""

    def __init__(
        self,
        batch: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        like: Tensor,
        padding: Tensor | None = None,
    ) -> None:
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.v = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.length = 0
        self.padding = padding

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append k, v (B, G, T, D); return all cached keys and values (B, G, S, D)."""
        end = self.length + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; cannot extend to {end}")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


Cache = LayerKVCache | LinearState  # per layer: keys and values (softmax) or running sums (linear, favor)


class Attention(nn.Module):
    """Causal grouped-query self-attention: softmax through `scaled_dot_product_attention`, or linear / FAVOR+
    (computed in fp32; a FAVOR+ layer keeps its fixed random projection (M, D) as a buffer)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.scale, self.kind, self.window = cfg.attn_scale, cfg.attention, cfg.sliding_window
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm != "none":  # per head (Qwen3) or over the whole projection (OLMo 2)
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(cfg.head_dim if per_head else cfg.n_heads * cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim if per_head else cfg.n_kv_heads * cfg.head_dim, cfg.norm_eps)
        if self.kind == "favor":
            self.register_buffer("projection", torch.zeros(cfg.feature_dim, cfg.head_dim))

    def features(self, x: Tensor, is_query: bool) -> Tensor:
        """φ of queries or keys (B, H, T, D), in fp32."""
        if self.kind == "favor":
            return favor_features(x.float(), self.projection.float(), is_query, self.scale)
        return elu_features(x.float())

    def linear(self, q: Tensor, k: Tensor, v: Tensor, state: LinearState | None) -> Tensor:
        """Causal linear attention (B, H, T, D); kv heads are shared by their query groups."""
        repeat = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = causal_linear_attention(self.features(q, True), self.features(k, False), v.float(), state=state)
        return y.to(q.dtype)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], cache: Cache | None = None) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, H·D), (B, T, G·D), (B, T, G·D)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, G, T, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, G, T, D)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.kind != "softmax":
            assert cache is None or isinstance(cache, LinearState)
            return self.o_proj(self.linear(q, k, v, cache).transpose(1, 2).reshape(B, T, -1))
        if cache is not None:
            assert isinstance(cache, LayerKVCache)
            k, v = cache.update(k, v)  # (B, G, S, D)
        S = k.shape[2]
        windowed = self.window is not None and self.window < S
        if cache is None and not windowed and explicit_attention_pays(q):
            y = explicit_causal_attention(q, k, v, self.scale)
        else:
            mask = None
            if cache is not None and cache.padding is not None:
                mask = padded_causal_mask(cache.padding, T, S)
            elif 1 < T < S or (windowed and T > 1):  # query t sees keys up to its absolute position
                mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
            if windowed:  # and none more than `window` - 1 positions back (Mistral's sliding window)
                band = torch.ones(T, S, dtype=torch.bool, device=x.device).triu(
                    diagonal=S - T - self.window + 1
                )
                mask = band if mask is None else mask & band
            y = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=mask is None and T == S and T > 1,
                scale=self.scale,
                enable_gqa=self.n_kv_heads != self.n_heads,
            )  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def padded_causal_mask(padding: Tensor, T: int, S: int) -> Tensor:
    """(B, 1, T, S) bool, True where the last T of S positions may attend: causally, to no key of a row's left
    padding (`padding` (B,) positions). A padding position attends to itself alone, so no row of the softmax is
    empty (its output is never read)."""
    keys = torch.arange(S, device=padding.device)
    queries = keys[S - T :, None]  # (T, 1)
    real = keys >= padding[:, None]  # (B, S)
    return ((keys <= queries) & real[:, None, :] | (keys == queries))[:, None]


# Longest sequence for which `explicit_causal_attention` beats PyTorch's CPU flash kernel in bf16 (forward and
# backward, one thread, 2,048 tokens a batch, AMX; `benchmarks/explicit_attention.py`: 2.3-3.3x at 64 tokens,
# 1.4-2.2x at 128, 1.2-1.7x at 160, 0.94-1.06x at 192 (even), 0.34-0.84x at 256, 0.14-0.29x at 2,048).
EXPLICIT_ATTENTION_MAX_LEN = 192


def explicit_attention_pays(q: Tensor) -> bool:
    """Whether q (B, H, T, D) is attended faster explicitly: short sequences in bf16 on a CPU with bf16 matrix units,
    where the flash kernel's backward ran at ~25 GFLOP/s (a kernel choice: the results stay within bf16 rounding).
    Elsewhere (fp16, CPUs that emulate bf16) it was not measured and SDPA stays."""
    short = q.shape[2] <= EXPLICIT_ATTENTION_MAX_LEN
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and short and cpu_has_bf16_matrix_units()


def cpu_has_bf16_matrix_units() -> bool:
    """AMX or AVX-512 BF16 (as PyTorch detects them): bf16 GEMMs run natively, not emulated (~50x slower than fp32)."""
    return _BF16_MATRIX_UNITS


# probed once, at import: a constant inside compiled blocks (Dynamo warned at every compile about a cached probe)
_BF16_MATRIX_UNITS = any(
    getattr(torch.cpu, name, lambda: False)()
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
)


def explicit_causal_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """softmax(q kᵀ · scale, causal) v for q (B, H, T, D) and k, v (B, G, T, D): the products in the inputs' dtype
    (matrix units), the softmax in fp32, as Hugging Face's eager attention. Memory: the (B, H, T, T) scores."""
    repeat = q.shape[1] // k.shape[1]
    if repeat > 1:  # each kv head serves its group of query heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    positions = torch.arange(q.shape[2], device=q.device)
    scores = (q @ k.transpose(-2, -1)).float() * scale
    # the causal mask as a comparison of positions, which Inductor computes inside its softmax kernels: from a
    # materialised bool mask, a layer's attention forward and backward took 7.0 instead of 4.9 ms compiled (6.7 vs
    # 6.2 eager; bf16, 8 x 6 heads x 128 tokens)
    future = positions[None, :] > positions[:, None]
    return torch.where(future, float("-inf"), scores).softmax(dim=-1).to(q.dtype) @ v


class TransformerBlock(nn.Module):
    """Residual block; the feed-forward is dense or MoE. Pre-norm (Llama: `input_layernorm` before attention,
    `post_attention_layernorm` before the feed-forward), or post-norm inside the residual (OLMo 2:
    `post_attention_layernorm` on attention's output, `post_feedforward_layernorm` on the feed-forward's)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.post_norm = cfg.norm_placement == "post"
        if not self.post_norm:
            self.input_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if self.post_norm:
            self.post_feedforward_layernorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.residual_mult = cfg.residual_mult
        self.mlp: nn.Module
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer):
            self.mlp = MoE(cfg.d_model, cfg.moe)
        else:
            self.mlp = FeedForward(cfg.d_model, cfg.d_ff)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], cache: Cache | None = None
    ) -> tuple[Tensor, RouterStats | None]:
        if self.post_norm:
            return self.post_norm_forward(x, rope, cache)
        h = x + self.branch(self.self_attn(self.input_layernorm(x), rope, cache))
        if isinstance(self.mlp, FeedForward):
            return h + self.branch(self.mlp(self.post_attention_layernorm(h))), None
        y, stats = self.mlp(self.post_attention_layernorm(h))  # MoE, or its expert-parallel stand-in
        return h + self.branch(y), stats

    def post_norm_forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], cache: Cache | None = None
    ) -> tuple[Tensor, RouterStats | None]:
        """OLMo 2's block: each branch reads the stream as it is and is normalised before it joins."""
        h = x + self.branch(self.post_attention_layernorm(self.self_attn(x, rope, cache)))
        if isinstance(self.mlp, FeedForward):
            return h + self.branch(self.post_feedforward_layernorm(self.mlp(h))), None
        y, stats = self.mlp(h)
        return h + self.branch(self.post_feedforward_layernorm(y)), stats

    def branch(self, y: Tensor) -> Tensor:
        """A residual branch's output as it joins the stream (CompleteP's multiplier, when set)."""
        return y * self.residual_mult if self.residual_mult != 1.0 else y


class Decoder(nn.Module):
    """Embedding, blocks and final norm: Hugging Face's `model.` submodule."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.cfg = cfg

    def forward(self, tokens: Tensor, cache: list[Cache] | None = None) -> tuple[Tensor, list[RouterStats]]:
        """tokens (B, T) -> the final norm's output (B, T, C) and each MoE layer's router statistics."""
        start = cache[0].length if cache else 0
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        rope = rope_tables(self.cfg.head_dim, positions, self.cfg.rope_theta, self.cfg.rope_scaling)
        x = self.embed_tokens(tokens)  # (B, T, C)
        stats: list[RouterStats] = []
        for i, layer in enumerate(self.layers):
            x, layer_stats = layer(x, rope, cache[i] if cache else None)
            if layer_stats is not None:
                stats.append(layer_stats)
        return self.norm(x), stats


@dataclass
class ModelOutput:
    """Forward result. `loss` is the training objective: cross-entropy plus the weighted router losses."""

    logits: Tensor  # (B, T, V)
    loss: Tensor | None = None  # ce_loss + aux_loss
    ce_loss: Tensor | None = None  # mean over the positions that carry loss
    aux_loss: Tensor | float = 0.0  # weighted router losses (0 for dense models)
    router_stats: list[RouterStats] = field(default_factory=list)  # one per MoE layer


def router_loss(cfg: ModelConfig, stats: list[RouterStats]) -> Tensor | float:
    """Load-balancing and z-losses averaged over MoE layers (so coefficients do not depend on depth)."""
    if not stats or cfg.moe is None:
        return 0.0
    aux = torch.stack([s.aux_loss for s in stats]).mean()
    z = torch.stack([s.z_loss for s in stats]).mean()
    return cfg.moe.aux_loss_coef * aux + cfg.moe.z_loss_coef * z


class Transformer(nn.Module):
    """The language model: tokens (B, T) -> next-token logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig, seed: int | None = 0) -> None:
        """Builds and, unless `seed` is None (meta-device sizing), initialises the weights from `seed`."""
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if seed is not None:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """N(0, init_std) everywhere, residual outputs scaled by 1/sqrt(2·n_layers) (GPT-2; CompleteP: the base
        depth's, its multiplier scaling the rest), norms at one; under μP hidden matrices (inside the blocks) get
        variance init_std² / m.

        Values are drawn on the CPU in fp32 from one generator in parameter order, so the same seed gives the
        same weights on any device, dtype or number of workers.
        """
        generator = torch.Generator().manual_seed(seed)
        hidden_std = self.cfg.init_std / math.sqrt(self.cfg.width_mult)
        residual_std = hidden_std / math.sqrt(2 * self.cfg.init_depth)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            is_residual_out = name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj"))
            std = residual_std if is_residual_out else hidden_std if is_hidden(name) else self.cfg.init_std
            values = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
            param.copy_(values)
        # FAVOR+ projections from their own generator: the weights stay those of a softmax model of this seed
        projections = torch.Generator().manual_seed(seed + 1)
        for layer in self.model.layers:
            if layer.self_attn.kind == "favor":
                m, d = layer.self_attn.projection.shape
                layer.self_attn.projection.copy_(orthogonal_features(m, d, projections))

    def forward(
        self,
        tokens: Tensor,
        targets: Tensor | None = None,
        cache: list[Cache] | None = None,
        logits_grad: bool = True,
    ) -> ModelOutput:
        """tokens (B, T); targets (B, T) with IGNORE_INDEX where no loss; cache for incremental decoding.
        `logits_grad=False` (with targets): the logits come back detached, for a caller that differentiates the loss
        alone (see `logits_and_loss`)."""
        hidden, stats = self.model(tokens, cache)
        aux = router_loss(self.cfg, stats)
        if targets is None:
            return ModelOutput(logits=self.logits(hidden), aux_loss=aux, router_stats=stats)
        logits, ce = self.logits_and_loss(hidden, targets, logits_grad)
        return ModelOutput(logits=logits, loss=ce + aux, ce_loss=ce, aux_loss=aux, router_stats=stats)

    def logits(self, hidden: Tensor) -> Tensor:
        """The output head: hidden states (B, T, C) -> logits (B, T, V)."""
        logits = self.lm_head(hidden)
        return logits * self.cfg.output_mult if self.cfg.output_mult != 1.0 else logits

    def logits_and_loss(
        self, hidden: Tensor, targets: Tensor, logits_grad: bool = True
    ) -> tuple[Tensor, Tensor]:
        """The logits (detached unless `logits_grad`) and their mean cross-entropy (in fp32,
        `training/model/cross_entropy.py`) over the targets that are not IGNORE_INDEX: one region for
        `training/compile.py`. Compiled, a differentiable logits output gets a gradient of its own in the region's
        backward, a zero-filled tensor the size of the logits when only the loss is used (at d_model 384, vocab
        8,192, 1,024 tokens in bf16: the head and loss forward and backward 64 -> 53 ms)."""
        logits = self.logits(hidden)
        loss = cross_entropy(logits.flatten(0, 1), targets.flatten())
        return (logits if logits_grad else logits.detach()), loss

    def new_cache(self, batch: int, max_len: int | None = None, padding: Tensor | None = None) -> list[Cache]:
        """Empty per-layer KV caches on this model's device and dtype (linear attention: fp32 running sums,
        whose size does not depend on the length). `padding` (B,): each row's left padding (`LayerKVCache`;
        softmax attention only)."""
        like = self.lm_head.weight
        length = max_len or self.cfg.max_seq_len
        if padding is not None and self.cfg.attention != "softmax":
            raise ValueError(
                f"left-padded batches need softmax attention; this model's is {self.cfg.attention}"
            )
        if self.cfg.attention != "softmax":
            m, h = self.cfg.feature_dim, self.cfg.n_heads
            return [
                LinearState.empty(batch, h, m, self.cfg.head_dim, like.float()) for _ in self.model.layers
            ]
        return [
            LayerKVCache(batch, self.cfg.n_kv_heads, self.cfg.head_dim, length, like, padding)
            for _ in self.model.layers
        ]
