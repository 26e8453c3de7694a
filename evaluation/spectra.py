"""The model as linear algebra: singular-value spectra and effective rank of attention and MLP weights, of LoRA
updates ΔW = (α/r)·B·A, and the expert-load distribution of MoE layers.

Effective rank is exp(entropy of the normalised singular values) (Roy & Vetterli, 2007): n for a flat spectrum,
1 for a rank-one matrix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from training.model.transformer import Transformer

MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def effective_rank(singular_values: torch.Tensor) -> float:
    s = singular_values.double().clamp_min(0)
    p = s / s.sum()
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def weight_spectra(model: Transformer) -> dict[str, dict[str, object]]:
    """{"layers.<i>.<matrix>": {"singular_values": [...], "effective_rank": r, "shape": [out, in]}} for dense
    projections (MoE experts are reported per layer by their mean effective rank)."""
    out: dict[str, dict[str, object]] = {}
    for name, param in model.named_parameters():
        parts = name.split(".")
        if param.ndim == 2 and len(parts) >= 2 and parts[-2] in MATRICES:
            s = torch.linalg.svdvals(param.detach().float())
            out[f"layers.{parts[2]}.{parts[-2]}"] = {
                "singular_values": s.tolist(),
                "effective_rank": effective_rank(s),
                "shape": list(param.shape),
            }
        elif param.ndim == 3 and "experts" in parts:  # stacked experts (E, out, in)
            ranks = [effective_rank(torch.linalg.svdvals(w.float())) for w in param.detach()]
            out[f"layers.{parts[2]}.experts.{parts[-1]}"] = {
                "effective_rank": sum(ranks) / len(ranks),
                "shape": list(param.shape),
            }
    return out


def lora_spectra(adapter_dir: str | Path) -> dict[str, dict[str, object]]:
    """Spectra of each LoRA update ΔW = (alpha/r)·B·A in a PEFT adapter directory."""
    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    state = load_file(adapter_dir / "adapter_model.safetensors")
    out: dict[str, dict[str, object]] = {}
    for key, a in state.items():
        if ".lora_A." not in key:
            continue
        b = state[key.replace(".lora_A.", ".lora_B.")]
        delta = scale * (b.float() @ a.float())
        s = torch.linalg.svdvals(delta)
        name = key.removeprefix("base_model.model.").split(".lora_A.")[0].removeprefix("model.")
        out[name] = {
            "singular_values": s[: config["r"]].tolist(),
            "effective_rank": effective_rank(s[: config["r"]]),
            "frobenius_norm": float(delta.norm()),
        }
    return out


def expert_load(model: Transformer, batches: list[torch.Tensor]) -> dict[str, list[float]]:
    """Share of token-assignments each expert receives, per MoE layer, over `batches` of token ids."""
    totals: list[torch.Tensor] = []
    with torch.inference_mode():
        for tokens in batches:
            for i, stats in enumerate(model(tokens).router_stats):
                counts = stats.tokens_per_expert.double()
                if i == len(totals):
                    totals.append(counts)
                else:
                    totals[i] += counts
    return {f"layer{i}": (t / t.sum()).tolist() for i, t in enumerate(totals)}


def load_imbalance(shares: list[float]) -> float:
    """max share / mean share: 1.0 is perfectly balanced."""
    return max(shares) * len(shares) if shares and not math.isnan(shares[0]) else float("nan")
