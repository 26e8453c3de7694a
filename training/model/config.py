"""The model's configuration: architecture hyper-parameters (dense, MoE, μP, attention kind), validated with
messages that name the fix. Light to import (no torch): recipes, the CLI and accounting read it without the model.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)


class MoEConfig(BaseModel):
    """Which layers are sparse and how they route."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    n_experts: PositiveInt = 8
    top_k: PositiveInt = 2
    d_ff_expert: PositiveInt
    aux_loss_coef: NonNegativeFloat = 0.01
    z_loss_coef: NonNegativeFloat = 0.001
    first_k_dense: NonNegativeInt = 0
    every_n_layers: PositiveInt = 1
    # Hugging Face families (imported checkpoints): Qwen2-MoE keeps the top-k probabilities as they are
    # (`norm_topk_prob: false`); Qwen2-MoE adds a shared SwiGLU expert of this width beside the routed ones, its
    # output scaled by sigmoid(shared_expert_gate · x)
    norm_topk_prob: bool = True
    shared_expert_d_ff: PositiveInt | None = None

    @model_serializer(mode="wrap")
    def _without_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The family fields are dumped only when set, so runs keyed before they existed are still found."""
        return without_defaults(handler(self), {"norm_topk_prob": True, "shared_expert_d_ff": None})

    @model_validator(mode="after")
    def _check_top_k(self) -> MoEConfig:
        if self.top_k > self.n_experts:
            raise ValueError(
                f"top_k={self.top_k} must be <= n_experts={self.n_experts}: lower moe.top_k or raise moe.n_experts"
            )
        return self

    def is_moe_layer(self, layer: int) -> bool:
        """Layers [0, first_k_dense) are dense; after that every `every_n_layers`-th layer is sparse."""
        return layer >= self.first_k_dense and (layer - self.first_k_dense) % self.every_n_layers == 0


class MuPConfig(BaseModel):
    """Maximal-update parametrisation (Yang et al. 2022, "Tensor Programs V"), for Adam: with the width ratio
    m = d_model / base_width, hidden matrices start with variance / m and train at learning rate lr / m, logits
    are multiplied by `output_mult` / m, attention scores use `attn_mult` / head_dim (not 1/sqrt(head_dim)), and
    embeddings, norms and the readout keep the base learning rate. At m = 1 the model is the standard one
    (up to the attention scale), so a learning rate tuned at `base_width` transfers to every width.
    The multipliers fold into the weights at Hugging Face export (`training/model/hf_interop.py`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_width: PositiveInt = 64
    output_mult: PositiveFloat = 1.0
    attn_mult: PositiveFloat = 1.0
    # CompleteP (Dey et al. 2025, depth-μP with α = 1): each block's attention and feed-forward outputs are multiplied
    # by base_depth / n_layers and the residual projections start at the base depth's scale, so a learning rate
    # tuned at `base_depth` layers transfers to other depths; None: the GPT-2 init's 1/sqrt(2·n_layers) alone
    base_depth: PositiveInt | None = None

    @model_serializer(mode="wrap")
    def _without_unset_depth(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """Without CompleteP the dump is μP's as it was before `base_depth` existed, so runs keyed by it (a sweep's
        trials) are still found."""
        data = handler(self)
        if self.base_depth is None:
            data.pop("base_depth", None)
        return data


class RopeScaling(BaseModel):
    """Llama 3's RoPE frequency scaling (`rope_type: llama3`): wavelengths longer than the original context divided
    by `factor`, shorter than it / `high_freq_factor` kept, those between interpolated smoothly."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    factor: PositiveFloat
    low_freq_factor: PositiveFloat = 1.0
    high_freq_factor: PositiveFloat = 4.0
    original_max_position_embeddings: PositiveInt = 8192


# the fields an imported Hugging Face family adds, and their values for lmforge's own (Llama-shaped) models; a dump
# leaves them out at these values so that every run keyed before they existed keeps its key
FAMILY_DEFAULTS: dict[str, Any] = {
    "family": None,
    "explicit_head_dim": None,
    "qkv_bias": False,
    "qk_norm": "none",
    "norm_placement": "pre",
    "rope_scaling": None,
    "sliding_window": None,
}


def without_defaults(data: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if not (k in defaults and v == defaults[k])}


class ModelConfig(BaseModel):
    """Architecture hyper-parameters. `depth` in a recipe derives the widths (see `from_depth`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: PositiveInt = 8192
    d_model: PositiveInt = 256
    n_layers: PositiveInt = 4
    n_heads: PositiveInt = 4
    n_kv_heads: PositiveInt = 4
    d_ff: PositiveInt = 688
    max_seq_len: PositiveInt = 512
    rope_theta: PositiveFloat = 10_000.0
    norm_eps: PositiveFloat = 1e-5
    tie_embeddings: bool = False
    init_std: PositiveFloat = 0.02
    moe: MoEConfig | None = None
    mup: MuPConfig | None = None  # None: standard parametrisation
    attention: Literal["softmax", "linear", "favor"] = "softmax"
    attention_features: int | None = None  # favor: random features per head (None: ⌈head_dim·ln head_dim⌉)
    # What a Hugging Face family adds (`training/model/families.py`); lmforge's own models leave them at their defaults.
    family: str | None = None  # the family it exports as (None: llama, or mixtral when every layer is MoE)
    explicit_head_dim: PositiveInt | None = None  # head_dim when it is not d_model / n_heads (Qwen3)
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    qk_norm: Literal["none", "head", "projection"] = (
        "none"  # RMSNorm on q and k: per head (Qwen3), whole (OLMo 2)
    )
    norm_placement: Literal["pre", "post"] = "pre"  # post: norms on each branch's output (OLMo 2)
    rope_scaling: RopeScaling | None = None
    sliding_window: PositiveInt | None = (
        None  # each query attends to the last `sliding_window` keys (Mistral)
    )

    @model_serializer(mode="wrap")
    def _without_family_defaults(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return without_defaults(handler(self), FAMILY_DEFAULTS)

    @model_validator(mode="before")
    @classmethod
    def _expand_depth(cls, data: Any) -> Any:
        """`depth: 6` (plus optional aspect_ratio, head_dim, kv_ratio) stands for the widths it derives."""
        if not isinstance(data, dict) or "depth" not in data:
            return data
        data = dict(data)
        dial = {k: data.pop(k) for k in ("depth", "aspect_ratio", "head_dim", "kv_ratio") if k in data}
        if dial["depth"] is None:  # `--set model.depth=null` switches the dial off for explicit widths
            return data
        derived = depth_dial(**dial)
        clash = sorted(set(derived) & set(data))
        if clash:
            raise ValueError(
                f"depth={dial['depth']} derives {', '.join(clash)}; remove them from the recipe, "
                "or drop depth (--set model.depth=null) and give every width explicitly"
            )
        return {**derived, **data}

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.explicit_head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must divide d_model={self.d_model} "
                f"(head_dim would be {self.d_model / self.n_heads:.1f}); pick n_heads among {divisors(self.d_model)}"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} for grouped-query attention; "
                f"pick n_kv_heads among {divisors(self.n_heads)}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim=d_model/n_heads={self.head_dim} must be even for RoPE (it rotates pairs of channels); "
                "change d_model or n_heads"
            )
        if self.attention_features is not None and self.attention != "favor":
            raise ValueError(
                f"attention_features={self.attention_features} sets FAVOR+'s random features, but attention="
                f"{self.attention}; remove it or set attention=favor"
            )
        if self.attention_features is not None and self.attention_features < 1:
            raise ValueError(
                f"attention_features={self.attention_features}: FAVOR+ needs at least one random feature per head; "
                f"set a positive count (default {self.favor_features_default()}) or leave it out"
            )
        return self

    def favor_features_default(self) -> int:
        return math.ceil(self.head_dim * math.log(self.head_dim))

    @property
    def feature_dim(self) -> int:
        """Features per head of linear attention: head_dim (elu + 1) or FAVOR+'s random feature count."""
        if self.attention == "favor":
            return self.attention_features or self.favor_features_default()
        return self.head_dim

    def trained_at(self, seq_len: int) -> ModelConfig:
        """This architecture as exported after training on `seq_len`-token windows: `max_seq_len` (the export's
        `max_position_embeddings`, what evaluation windows and generation room follow) is the trained context,
        not the longest the recipe allowed (positions past it were never trained and score worse)."""
        return self.model_copy(update={"max_seq_len": seq_len})

    @property
    def has_llama_layout(self) -> bool:
        """Whether a Hugging Face model of its family computes the same function (softmax attention only)."""
        return self.attention == "softmax"

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.d_model // self.n_heads

    @property
    def width_mult(self) -> float:
        """μP's m = d_model / base_width (1 without μP)."""
        return self.d_model / self.mup.base_width if self.mup else 1.0

    @property
    def attn_scale(self) -> float:
        """Multiplier of q·k: 1/sqrt(head_dim), or μP's attn_mult/head_dim."""
        return self.mup.attn_mult / self.head_dim if self.mup else 1.0 / math.sqrt(self.head_dim)

    @property
    def output_mult(self) -> float:
        """Multiplier of the logits: 1, or μP's output_mult/m."""
        return self.mup.output_mult / self.width_mult if self.mup else 1.0

    @property
    def residual_mult(self) -> float:
        """Multiplier of every residual branch's output: 1, or CompleteP's base_depth / n_layers."""
        return self.mup.base_depth / self.n_layers if self.mup and self.mup.base_depth else 1.0

    @property
    def init_depth(self) -> int:
        """The depth whose GPT-2 scale 1/sqrt(2·depth) the residual projections start at: CompleteP's base depth,
        else the model's."""
        return self.mup.base_depth if self.mup and self.mup.base_depth else self.n_layers

    def hidden_lr_mult(self) -> float:
        """Learning-rate multiplier of the hidden matrices (those inside the blocks): 1, or μP's 1/m."""
        return 1.0 / self.width_mult

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @classmethod
    def from_depth(cls, depth: int, **overrides: Any) -> ModelConfig:
        """nanochat-style size dial: one integer sets width, heads and d_ff; the rest come from `overrides`."""
        dial = {k: overrides.pop(k) for k in ("aspect_ratio", "head_dim", "kv_ratio") if k in overrides}
        return cls(**{**depth_dial(depth, **dial), **overrides})


def depth_dial(depth: int, aspect_ratio: int = 64, head_dim: int = 64, kv_ratio: int = 1) -> dict[str, int]:
    """d_model = depth * aspect_ratio; heads of `head_dim`; kv heads = heads / kv_ratio; SwiGLU d_ff ≈ 8/3 d_model."""
    if depth < 1 or aspect_ratio < 1 or head_dim < 2 or kv_ratio < 1:
        raise ValueError(f"depth dial needs positive values, got depth={depth} aspect_ratio={aspect_ratio}")
    d_model = depth * aspect_ratio
    n_heads = max(1, d_model // head_dim)
    n_kv_heads = max(1, n_heads // kv_ratio)
    d_ff = 32 * math.ceil(8 * d_model / 3 / 32)  # Llama's 2/3 * 4d, rounded up to a multiple of 32
    return {"d_model": d_model, "n_layers": depth, "n_heads": n_heads, "n_kv_heads": n_kv_heads, "d_ff": d_ff}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
