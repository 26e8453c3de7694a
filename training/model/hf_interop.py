"""Mapping between our model and Hugging Face models (Llama and Mixtral for lmforge's own; every family of
`training/model/families.py` for imported ones): configs and state dicts.

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
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from data_pipeline.sources import DataError
from training.model.checkpoint_files import read_state_dict
from training.model.config import ModelConfig
from training.model.families import FAMILIES, hf_config_kwargs, model_config_from_hf
from training.model.transformer import Transformer

log = logging.getLogger(__name__)

NATIVE_CONFIG = "lmforge_model.json"  # an export in lmforge's own layout: our ModelConfig, no config.json


def no_llama_layout(cfg: ModelConfig) -> str:
    return (
        f"model.attention={cfg.attention} has no Hugging Face Llama layout (Llama computes softmax attention); "
        "its export is in lmforge's own layout, loadable by lmforge only"
    )


def build_hf_model(cfg: ModelConfig, head: str = "CausalLM", **config: Any) -> nn.Module:
    """An uninitialised `<Family>For<head>` (`CausalLM`, `SequenceClassification`) of `cfg`'s family (Llama or
    Mixtral for lmforge's own models) with its architecture (fp32, eager attention); `config` adds fields to its
    config (e.g. `num_labels`)."""
    import transformers

    if not cfg.has_llama_layout:
        raise ValueError(no_llama_layout(cfg))
    model_type, kwargs = hf_config_kwargs(cfg)
    family = FAMILIES[model_type]
    hf_config = getattr(transformers, f"{family.prefix}Config")(**kwargs, **config)
    hf_config._attn_implementation = "eager"
    return getattr(transformers, f"{family.prefix}For{head}")(hf_config)


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


def load_hf_config(path: str | Path) -> ModelConfig:
    """Read a Hugging Face `config.json` (or a directory holding one, or an export in lmforge's own layout) into a
    ModelConfig; `UnsupportedModel` (a ValueError) names the field lmforge cannot represent."""
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
    try:
        return model_config_from_hf(data)
    except KeyError as error:
        raise ValueError(
            f"{path}: no {error.args[0]!r}, which every Hugging Face decoder config has"
        ) from None


def load_export(export_dir: str | Path, dtype: torch.dtype | None = torch.float32) -> Transformer:
    """Our Transformer with the weights of a Hugging Face model directory (an export of ours or anyone's: see
    `checkpoint.read_state_dict` for the files it reads and refuses), in `dtype` (None: the checkpoint's)."""
    export_dir = Path(export_dir)
    cfg = load_hf_config(export_dir)
    with torch.device("meta"):
        model = Transformer(cfg, seed=None)
    state = read_state_dict(export_dir, dtype)
    return load_weights(model, state, export_dir, assign=True)


def load_weights(
    model: Transformer, state: dict[str, Tensor], where: str | Path, assign: bool = False
) -> Transformer:
    """`model` with `state` loaded (a tied head may be absent; `assign` keeps the tensors themselves, e.g. torchao
    ones), in eval mode; weights that do not fit its config are refused naming `where`."""
    try:
        missing, unexpected = model.load_state_dict(state, strict=False, assign=assign)
    except RuntimeError as error:  # shapes that differ from the config's
        raise DataError(
            f"{where}: weights do not match its config.json ({str(error).splitlines()[-1].strip()})"
        ) from None
    if unexpected or [k for k in missing if not (model.cfg.tie_embeddings and k == "lm_head.weight")]:
        raise DataError(
            f"{where}: weights do not match its config (missing {missing}, unexpected {unexpected})"
        )
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
