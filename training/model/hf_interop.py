"""Mapping between our model and Hugging Face Llama (dense) / Mixtral (MoE): configs and state dicts.

Our module tree uses Hugging Face names and the `rotate_half` RoPE layout, so the state-dict mapping is the
identity: `model.embed_tokens.weight`, `model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
`model.layers.{i}.mlp.{gate,up,down}_proj.weight` (dense) or `model.layers.{i}.mlp.gate.weight`,
`mlp.experts.gate_up_proj` (E, 2I, H; gate rows first) and `mlp.experts.down_proj` (E, H, I) (MoE, transformers
v5 layout), `input_layernorm`, `post_attention_layernorm`, `model.norm.weight`, `lm_head.weight`.
A model that mixes dense and MoE layers has no Mixtral equivalent and is refused, as is one with linear or
FAVOR+ attention (`ModelConfig.has_llama_layout`): those are exported in lmforge's own layout (`NATIVE_CONFIG`
beside the safetensors, no config.json), which lmforge loads and Hugging Face does not.
"""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from data_pipeline.sources import DataError
from training.model.config import ModelConfig, MoEConfig
from training.model.transformer import Transformer

log = logging.getLogger(__name__)

SUPPORTED_HF_TYPES = ("llama", "mixtral")
NATIVE_CONFIG = "lmforge_model.json"  # an export in lmforge's own layout: our ModelConfig, no config.json


def no_llama_layout(cfg: ModelConfig) -> str:
    return (
        f"model.attention={cfg.attention} has no Hugging Face Llama layout (Llama computes softmax attention); "
        "its export is in lmforge's own layout, loadable by lmforge only"
    )


def hf_config_kwargs(cfg: ModelConfig) -> tuple[str, dict[str, Any]]:
    """(model_type, keyword arguments for LlamaConfig or MixtralConfig) equivalent to `cfg`."""
    if not cfg.has_llama_layout:
        raise ValueError(no_llama_layout(cfg))
    common: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
    }
    if cfg.moe is None:
        return "llama", {**common, "intermediate_size": cfg.d_ff, "attention_bias": False, "mlp_bias": False}
    if not all(cfg.is_moe_layer(i) for i in range(cfg.n_layers)):
        raise ValueError(
            "Mixtral has an MoE feed-forward in every layer; this model mixes dense and MoE layers "
            f"(moe.first_k_dense={cfg.moe.first_k_dense}, moe.every_n_layers={cfg.moe.every_n_layers}), so it has "
            "no Hugging Face Mixtral equivalent"
        )
    return "mixtral", {
        **common,
        "intermediate_size": cfg.moe.d_ff_expert,
        "num_local_experts": cfg.moe.n_experts,
        "num_experts_per_tok": cfg.moe.top_k,
        "router_aux_loss_coef": cfg.moe.aux_loss_coef,
        "router_jitter_noise": 0.0,
    }


def build_hf_model(cfg: ModelConfig, head: str = "CausalLM", **config: Any) -> nn.Module:
    """An uninitialised `LlamaFor<head>` / `MixtralFor<head>` (`CausalLM`, `SequenceClassification`) with `cfg`'s
    architecture (fp32, eager attention); `config` adds fields to its config (e.g. `num_labels`)."""
    import transformers

    model_type, kwargs = hf_config_kwargs(cfg)
    family = "Llama" if model_type == "llama" else "Mixtral"
    hf_config = getattr(transformers, f"{family}Config")(**kwargs, **config)
    hf_config._attn_implementation = "eager"
    return getattr(transformers, f"{family}For{head}")(hf_config)


def query_fold(cfg: ModelConfig) -> float:
    """Factor folded into q_proj so that Hugging Face's 1/sqrt(head_dim) equals our attention scale (μP: ≠ 1)."""
    return cfg.attn_scale * math.sqrt(cfg.head_dim)


def weight_folds(cfg: ModelConfig) -> dict[str, float]:
    """The factor folded into each projection's weight at export (those ≠ 1), by the projection's name in a block:
    μP's attention scale into q_proj (RoPE is linear in q), CompleteP's residual multiplier into the projections
    that end each branch (o_proj, and down_proj or the experts' stacked down projections)."""
    folds = {"self_attn.q_proj": query_fold(cfg)}
    folds |= dict.fromkeys(("self_attn.o_proj", "mlp.down_proj", "mlp.experts.down_proj"), cfg.residual_mult)
    return {name: factor for name, factor in folds.items() if factor != 1.0}


def to_hf_state_dict(state_dict: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Our state dict in Hugging Face keys (the identity, see the module docstring) with μP's and CompleteP's
    multipliers folded into the weights (`weight_folds`), the logit multiplier into the final norm's gain (so a
    tied embedding stays shared)."""
    out = dict(state_dict)
    for name, factor in weight_folds(cfg).items():
        for key in [k for k in out if k.endswith((f".{name}.weight", f".{name}"))]:
            out[key] = out[key] * factor
    if cfg.output_mult != 1.0:
        out["model.norm.weight"] = out["model.norm.weight"] * cfg.output_mult
    return out


def model_config_from_hf(config: dict[str, Any]) -> ModelConfig:
    """A `config.json` of a Llama or Mixtral model as our ModelConfig (for sizing with `lmforge model summary`)."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_HF_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is not supported; lmforge reads {', '.join(SUPPORTED_HF_TYPES)} config.json files"
        )
    n_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    if head_dim * n_heads != config["hidden_size"]:
        raise ValueError(
            f"head_dim={head_dim} x num_attention_heads={n_heads} != hidden_size={config['hidden_size']}; "
            "lmforge derives head_dim as hidden_size / num_attention_heads"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        log.warning(
            "rope_type=%s is not modelled; it changes no parameter, FLOP or memory count", rope["rope_type"]
        )
    moe = None
    if model_type == "mixtral":
        moe = MoEConfig(
            n_experts=config["num_local_experts"],
            top_k=config["num_experts_per_tok"],
            d_ff_expert=config["intermediate_size"],
            aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
        )
    return ModelConfig(
        vocab_size=config["vocab_size"],
        d_model=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        d_ff=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10_000.0)),
        norm_eps=config.get("rms_norm_eps", 1e-5),
        tie_embeddings=config.get("tie_word_embeddings", False),
        init_std=config.get("initializer_range", 0.02),
        moe=moe,
    )


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read a Hugging Face `config.json` (or a directory holding one, or an export in lmforge's own layout) into a
    ModelConfig."""
    path = Path(path)
    if path.is_dir() and (path / NATIVE_CONFIG).is_file():
        return ModelConfig.model_validate_json((path / NATIVE_CONFIG).read_text())
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{path}: no such file; pass a Hugging Face config.json or the directory holding it"
        ) from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    return model_config_from_hf(data)


def load_export(export_dir: str | Path) -> Transformer:
    """Our Transformer with the weights of an export (Hugging Face names are ours; tied heads re-tied; Mixtral's
    per-expert checkpoint names, which `save_pretrained` writes, stacked back)."""
    export_dir = Path(export_dir)
    cfg = load_hf_config(export_dir)
    state: dict[str, torch.Tensor] = {}
    for file in sorted(export_dir.glob("*.safetensors")):
        state.update(load_file(file))
    return load_weights(Transformer(cfg, seed=None), stacked_experts(state), export_dir)


LEGACY_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


def stacked_experts(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A Mixtral state dict in the checkpoint layout transformers v5 saves (`block_sparse_moe.gate`,
    `block_sparse_moe.experts.{e}.w1/w3/w2`: gate, up and down projections per expert) in the stacked layout of
    the modelling code and ours (`mlp.gate`, `mlp.experts.gate_up_proj` (E, 2I, H), gate rows first, and
    `mlp.experts.down_proj` (E, H, I)) — the same conversion transformers applies when it loads them. Other
    keys pass through."""
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[str, dict[int, Tensor]]] = {}
    for key, tensor in state.items():
        match = LEGACY_EXPERT.match(key)
        if match:
            layer, index, which = match.groups()
            experts.setdefault(layer, {}).setdefault(which, {})[int(index)] = tensor
        else:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = tensor
    for layer, parts in experts.items():
        stack = {w: torch.stack([parts[w][e] for e in sorted(parts[w])]) for w in ("w1", "w2", "w3")}
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack["w1"], stack["w3"]], dim=1)
        out[f"{layer}.mlp.experts.down_proj"] = stack["w2"]
    return out


def load_weights(
    model: Transformer, state: dict[str, Tensor], where: str | Path, assign: bool = False
) -> Transformer:
    """`model` with `state` loaded (a tied head may be absent; `assign` keeps the tensors themselves, e.g. torchao
    ones), in eval mode; weights that do not fit its config are refused naming `where`."""
    missing, unexpected = model.load_state_dict(state, strict=False, assign=assign)
    if unexpected or [k for k in missing if not (model.cfg.tie_embeddings and k == "lm_head.weight")]:
        raise DataError(
            f"{where}: weights do not match its config (missing {missing}, unexpected {unexpected})"
        )
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
