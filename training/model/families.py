"""Hugging Face model families as lmforge's ModelConfig and back: a `config.json` read into the one model (so
DeepSpeed, LoRA, checkpoints, the sampler, evaluation and compression apply unchanged), and a ModelConfig written
as the config of the family it came from (same `model_type`, `architectures`, names).

Each family's differences to lmforge's Llama-shaped decoder (checked against transformers' `modeling_<family>.py`,
`../shared/notes/hf-families.md`): Mistral's sliding window; Qwen2's q/k/v biases; Qwen3's per-head q/k RMSNorm and
explicit head_dim; Mixtral's top-k-then-renormalise router; Qwen2-MoE's un-normalised top-k weights and sigmoid-gated
shared expert; Qwen3-MoE's normalised top-k; OLMo 2's norms after each branch and q/k norms over the whole projection.
What none of them can represent is refused before anything runs, in one line naming the field and the families read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

from training.model.config import ModelConfig, MoEConfig, RopeScaling

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """What a family (`model_type`) is made of, in lmforge's terms."""

    model_type: str
    prefix: str  # transformers' class prefix: `<prefix>Config`, `<prefix>ForCausalLM`
    moe: bool = False
    qkv_bias: bool | str = False  # always, never, or the config key that says
    qk_norm: Literal["none", "head", "projection"] = "none"
    norm_placement: Literal["pre", "post"] = "pre"
    sliding_window: bool = False  # every layer attends through `sliding_window` (Mistral, Mixtral)
    shared_expert: bool = False
    bias_key: str | None = (
        None  # the config key for biases lmforge does not carry (o_proj, MLP), which must be off
    )


FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("llama", "Llama", bias_key="attention_bias"),
        Family("mistral", "Mistral", sliding_window=True),
        Family("qwen2", "Qwen2", qkv_bias=True),
        Family("qwen3", "Qwen3", qk_norm="head", bias_key="attention_bias"),
        Family("olmo2", "Olmo2", qk_norm="projection", norm_placement="post", bias_key="attention_bias"),
        Family("mixtral", "Mixtral", moe=True, sliding_window=True),
        Family("qwen2_moe", "Qwen2Moe", moe=True, qkv_bias="qkv_bias", shared_expert=True),
        Family("qwen3_moe", "Qwen3Moe", moe=True, qk_norm="head", bias_key="attention_bias"),
    )
}


class UnsupportedModel(ValueError):
    """A checkpoint lmforge cannot represent exactly (one line naming the field and the families read)."""


def supported() -> str:
    return ", ".join(FAMILIES)


def refuse(field: str, why: str) -> UnsupportedModel:
    return UnsupportedModel(f"config.json {field}: {why}; lmforge reads the families {supported()}")


def family_of(config: dict[str, Any]) -> Family:
    """The config's family, or a refusal (remote code, an unknown `model_type`)."""
    if config.get("auto_map"):
        raise refuse(
            "auto_map",
            "the model needs its own Python code (trust_remote_code), which lmforge never runs; "
            "convert it to one of the families transformers implements",
        )
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise refuse("model_type", f"{model_type!r} is not supported")
    return FAMILIES[model_type]


def rope_of(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE's base and Llama 3 scaling from either layout: v5's `rope_parameters`, v4's `rope_theta` +
    `rope_scaling` (whose type key was `type` before `rope_type`)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10_000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse("partial_rotary_factor", "rotary embeddings on part of each head are not modelled")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise refuse(
            "rope_scaling.rope_type", f"{kind!r} is not modelled (lmforge applies default and llama3)"
        )
    return theta, RopeScaling(
        factor=rope["factor"],
        low_freq_factor=rope.get("low_freq_factor", 1.0),
        high_freq_factor=rope.get("high_freq_factor", 4.0),
        original_max_position_embeddings=rope.get("original_max_position_embeddings", 8192),
    )


def sparse_layers(config: dict[str, Any], family: Family) -> tuple[int, int]:
    """(first_k_dense, every_n_layers) of the Qwen MoE layer rule (`mlp_only_layers`, `decoder_sparse_step`:
    layer i is sparse when i is not listed and (i + 1) % step == 0), or a refusal where lmforge's rule (layers from
    k on, every n-th) selects other layers."""
    if family.model_type == "mixtral":
        return 0, 1
    n_layers, step = config["num_hidden_layers"], config.get("decoder_sparse_step", 1)
    listed = set(config.get("mlp_only_layers") or [])
    sparse = [i for i in range(n_layers) if i not in listed and (i + 1) % step == 0]
    if sparse:
        first, every = sparse[0], step
        if sparse == list(range(first, n_layers, every)):
            return first, every
    raise refuse(
        "mlp_only_layers",
        f"sparse layers {sparse} (decoder_sparse_step={step}) are not 'every n-th layer from the k-th on'",
    )


def model_config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """A Hugging Face `config.json` (as a dict) as lmforge's ModelConfig, or `UnsupportedModel` naming the field."""
    family = family_of(config)
    if config.get("hidden_act", "silu") != "silu":
        raise refuse("hidden_act", f"{config['hidden_act']!r}: lmforge's feed-forward is SwiGLU (silu)")
    if family.bias_key and config.get(family.bias_key):
        raise refuse(family.bias_key, "true: biases on o_proj are not modelled")
    if config.get("mlp_bias"):
        raise refuse("mlp_bias", "true: biases in the feed-forward are not modelled")
    if config.get("use_sliding_window"):
        raise refuse("use_sliding_window", "true: sliding windows on some layers only are not modelled")
    n_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    theta, scaling = rope_of(config)
    qkv_bias = (
        family.qkv_bias if isinstance(family.qkv_bias, bool) else bool(config.get(family.qkv_bias, True))
    )
    moe = None
    if family.moe:
        if config.get("router_jitter_noise"):
            log.warning(
                "router_jitter_noise=%s is not applied (lmforge routes deterministically)",
                config["router_jitter_noise"],
            )
        first_k_dense, every = sparse_layers(config, family)
        top_k = config["num_experts_per_tok"]
        moe = MoEConfig(
            n_experts=config.get("num_local_experts") or config["num_experts"],
            top_k=top_k,
            d_ff_expert=config.get("moe_intermediate_size") or config["intermediate_size"],
            aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
            first_k_dense=first_k_dense,
            every_n_layers=every,
            norm_topk_prob=config.get("norm_topk_prob", True) if family.model_type != "mixtral" else True,
            shared_expert_d_ff=config.get("shared_expert_intermediate_size")
            if family.shared_expert
            else None,
        )
    window = config.get("sliding_window") if family.sliding_window else None
    return ModelConfig(
        vocab_size=config["vocab_size"],
        d_model=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        d_ff=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=theta,
        norm_eps=config.get("rms_norm_eps", 1e-6),
        tie_embeddings=config.get("tie_word_embeddings", False),
        init_std=config.get("initializer_range", 0.02),
        moe=moe,
        # Llama and Mixtral are lmforge's own export families: left unnamed, their configs stay those of lmforge's runs
        family=None if family.model_type in ("llama", "mixtral") else family.model_type,
        explicit_head_dim=head_dim if head_dim * n_heads != config["hidden_size"] else None,
        qkv_bias=qkv_bias,
        qk_norm=family.qk_norm,
        norm_placement=family.norm_placement,
        rope_scaling=scaling,
        sliding_window=window,
    )


def family_for(cfg: ModelConfig) -> Family:
    """The family `cfg` exports as: its own (imported), else Llama, or Mixtral when every layer is MoE."""
    if cfg.family is not None:
        return FAMILIES[cfg.family]
    if cfg.moe is None:
        return FAMILIES["llama"]
    if not all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
        raise ValueError(
            "Mixtral has an MoE feed-forward in every layer; this model mixes dense and MoE layers "
            f"(moe.first_k_dense={cfg.moe.first_k_dense}, moe.every_n_layers={cfg.moe.every_n_layers}), so it has "
            "no Hugging Face Mixtral equivalent"
        )
    return FAMILIES["mixtral"]


def hf_config_kwargs(cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """(model_type, keyword arguments for `<Family>Config`) equivalent to `cfg`, in the family it came from."""
    family = family_for(cfg)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **cfg.rope_scaling.model_dump()}
    kwargs: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.d_ff,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": rope,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
    }
    if family.bias_key:
        kwargs[family.bias_key] = False
    if family.model_type == "llama":
        kwargs["mlp_bias"] = False
    if family.sliding_window:
        kwargs["sliding_window"] = cfg.sliding_window
    if family.model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        kwargs["use_sliding_window"] = False
    if isinstance(family.qkv_bias, str):
        kwargs[family.qkv_bias] = cfg.qkv_bias
    moe = cfg.moe
    if moe is None:
        return family.model_type, kwargs
    kwargs |= {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.aux_loss_coef}
    if family.model_type == "mixtral":
        return family.model_type, kwargs | {
            "intermediate_size": moe.d_ff_expert,
            "num_local_experts": moe.n_experts,
            "router_jitter_noise": 0.0,
        }
    every = moe.every_n_layers
    kwargs |= {
        "num_experts": moe.n_experts,
        "moe_intermediate_size": moe.d_ff_expert,
        "norm_topk_prob": moe.norm_topk_prob,
        # lmforge's rule as Qwen's: sparse where (i + 1) % step == 0, minus the listed dense layers
        "decoder_sparse_step": every,
        "mlp_only_layers": [
            i for i in range(cfg.n_layers) if (i + 1) % every == 0 and not cfg.is_moe_layer(i)
        ],
    }
    if family.shared_expert:
        kwargs["shared_expert_intermediate_size"] = moe.shared_expert_d_ff or 0
    return family.model_type, kwargs
