"""Tiny random checkpoints of each Hugging Face family, written by `transformers` itself (`save_pretrained`: its
config.json, its safetensors layout), as a user's downloaded model directory would be. Nothing is downloaded.

Every parameter is drawn at random, norms and biases included: transformers initialises norms at one and biases at
zero, where a dropped bias or a misplaced norm would change no logit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 101
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
MOE: dict[str, Any] = {"num_experts_per_tok": 2, "moe_intermediate_size": 40, "num_experts": 4}

# (transformers class prefix, config fields): each family with the features that set it apart switched on
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # Llama 3.2-like: tied, llama3 rope scaling whose original context (16) the 32-token probes pass
    "llama3-tied": (
        "Llama",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "llama-untied": ("Llama", {"tie_word_embeddings": False}),
    "mistral": ("Mistral", {"sliding_window": 8, "tie_word_embeddings": False}),
    "qwen2": (
        "Qwen2",
        {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
    ),
    "qwen3": ("Qwen3", {"head_dim": 24, "tie_word_embeddings": True}),
    "olmo2": ("Olmo2", {"tie_word_embeddings": False}),
    "mixtral": ("Mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 40}),
    "qwen2_moe": (
        "Qwen2Moe",
        {**MOE, "shared_expert_intermediate_size": 56, "norm_topk_prob": False, "mlp_only_layers": [0]},
    ),
    "qwen3_moe": ("Qwen3Moe", {**MOE, "head_dim": 24, "norm_topk_prob": True}),
}


def hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A `<Family>ForCausalLM` with every parameter random (fp32, eager attention)."""
    import transformers

    prefix, fields = FAMILIES[name]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if pname.endswith("norm.weight") else 0.05 * noise)
    return model.eval()


def write_checkpoint(name: str, directory: Path, seed: int = 0, **save: Any) -> Path:
    """`name`'s random model saved as a Hugging Face directory (safetensors; `save` passes e.g. max_shard_size)."""
    hf_model(name, seed).save_pretrained(str(directory), **save)
    return directory
