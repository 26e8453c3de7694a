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


def hf_model(name: str, seed: int = 0, **config_fields: Any) -> torch.nn.Module:
    """A `<Family>ForCausalLM` with every parameter random (fp32, eager attention); `config_fields` override the
    family's (e.g. `vocab_size`)."""
    import transformers

    prefix, fields = FAMILIES[name]
    config = getattr(transformers, f"{prefix}Config")(**{**COMMON, **fields, **config_fields})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if pname.endswith("norm.weight") else 0.05 * noise)
    return model.eval()


def write_checkpoint(
    name: str, directory: Path, seed: int = 0, config: dict[str, Any] | None = None, **save: Any
) -> Path:
    """`name`'s random model saved as a Hugging Face directory (safetensors; `config` overrides config fields,
    `save` passes e.g. max_shard_size)."""
    hf_model(name, seed, **(config or {})).save_pretrained(str(directory), **save)
    return directory


# Chat templates as model families ship them, with transformers' `{% generation %}` markers around what an answer
# trains on (the content and its end-of-turn token): the oracle `return_assistant_tokens_mask` reads them.
CHATML = (  # Qwen2.5: a default system turn, `<|im_end|>` ends every turn
    "{%- if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    "{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}{%- else %}{{ m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (  # Llama 3: begin-of-text from the template, headers, trimmed contents, `<|eot_id|>`
    "{{ bos_token }}{%- for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}{{ '<|eot_id|>' }}"
    "{% endgeneration %}{%- else %}{{ m['content'] | trim }}{{ '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
# (specials, eos, pad, template, begin-of-text added by the tokenizer itself)
TOKENIZERS: dict[str, tuple[list[str], str, str | None, str, str | None]] = {
    "chatml": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", "<|endoftext|>", CHATML, None),
    "llama3": (
        ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        "<|eot_id|>",
        None,
        LLAMA3,
        "<|begin_of_text|>",
    ),
}
TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. What is 2+2? Four. And 3+3? Six, of course.",
    "def add(a, b):\n    return a + b\n",
] * 20


def write_tokenizer(style: str, directory: Path) -> Path:
    """A byte-level BPE with `style`'s special tokens, end-of-text, padding and chat template (Llama 3's also
    prepends begin-of-text to every encoding, as its post-processor does), saved as transformers saves one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials, eos, pad, template, bos = TOKENIZERS[style]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TOKENIZER_TEXT, trainer=trainer)
    if bos is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=eos, pad_token=pad, chat_template=template
    )
    fast.save_pretrained(str(directory))
    return directory
