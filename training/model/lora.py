"""LoRA as a transform of our model through PEFT (Hu et al. 2021): only the adapters train.

Because our module paths are Hugging Face's (`model.layers.N.self_attn.q_proj`), an adapter saved here loads
with `peft.PeftModel.from_pretrained(<the base's Hugging Face export>, <adapter>)` unchanged. Experts are
stacked parameters, not `nn.Linear`s, so they are adapted through PEFT's `target_parameters`.
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from training.config import LoraSettings
from training.model.transformer import Transformer

EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
BASE_FILE = "lmforge_base.json"  # the base export's path relative to the adapter directory


def linear_names(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Leaf names of the model's linear layers and the smallest (in, out) size under each name."""
    sizes: dict[str, tuple[int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            leaf = name.rsplit(".", 1)[-1]
            old = sizes.get(leaf, (module.in_features, module.out_features))
            sizes[leaf] = (min(old[0], module.in_features), min(old[1], module.out_features))
    return sizes


def check_targets(model: Transformer, cfg: LoraSettings) -> None:
    """Refuse target names that match nothing and ranks no target can hold, naming the valid choices."""
    sizes = linear_names(model)
    unknown = [t for t in cfg.target_modules if t not in sizes]
    if unknown:
        raise ValueError(
            f"finetune.lora.target_modules: {unknown} match no linear layer; valid names: {sorted(sizes)}"
        )
    for target in cfg.target_modules:
        smallest = min(sizes[target])
        if cfg.r > smallest:
            raise ValueError(
                f"finetune.lora.r={cfg.r} exceeds the smallest dimension ({smallest}) of {target!r}; "
                f"use r <= {smallest} or leave {target!r} out of target_modules"
            )
    if cfg.experts and model.cfg.moe is None:
        raise ValueError("finetune.lora.experts=true needs a model with MoE layers; set it to false")


def lora_config(cfg: LoraSettings, model: Transformer, chat_tokens: Sequence[int] = ()):  # noqa: ANN201
    """PEFT's LoraConfig: the adapters, and the chat format's special tokens' embedding rows (and, untied, their
    output rows) as trainable token rows when `cfg.train_chat_tokens`."""
    from peft import LoraConfig

    tokens = sorted(set(chat_tokens)) if cfg.train_chat_tokens else []
    rows = {"embed_tokens": tokens} | ({} if model.cfg.tie_embeddings else {"lm_head": tokens})
    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        target_parameters=list(EXPERT_PARAMETERS) if cfg.experts and model.cfg.moe is not None else None,
        trainable_token_indices=rows if tokens else None,
        bias="none",
    )


def apply_lora(model: Transformer, cfg: LoraSettings, chat_tokens: Sequence[int] = ()) -> nn.Module:
    """Wrap `model` in a PEFT model whose only trainable parameters are the adapters and the rows of
    `chat_tokens` (role markers, end-of-turn: `data_pipeline.chat.chat_token_ids`), deterministically."""
    from peft import get_peft_model

    check_targets(model, cfg)
    torch.manual_seed(0)  # PEFT draws lora_A with the global generator: fix it so runs repeat
    show_tied_head(model)
    return get_peft_model(model, lora_config(cfg, model, chat_tokens))


def show_tied_head(model: Transformer) -> None:
    """Give our model what PEFT reads of a transformers model to keep a tied output head tied to the trainable
    token rows (without it the head keeps the old rows while the embedding learns new ones, and the merged model
    differs from the one trained): the input embedding, the tie, and the config's flag."""
    model.get_input_embeddings = types.MethodType(lambda self: self.model.embed_tokens, model)
    model.config = {"model_type": "lmforge", "tie_word_embeddings": model.cfg.tie_embeddings}
    if model.cfg.tie_embeddings:
        model._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}


def start_unseen_rows(model: nn.Module, rows: Sequence[int], seen: np.ndarray, seed: int = 0) -> list[int]:
    """Initialise the chat-token rows (`rows`) whose tokens pretraining never saw (`seen[i]` False), in the trainable
    token rows of a LoRA model or in the weights of a fully tuned one. Pretraining's softmax pushed every unseen
    row the same way (the demo's `<|end|>` shared one direction with ~119 other tokens, cosine > 0.999), so a tuned
    model could not tell end-of-turn from its group. Each starts at the mean of the seen rows plus noise of their
    per-dimension spread (Hewitt 2021): an average logit and a direction of its own. Returns the rows changed."""
    unseen = sorted(i for i in set(rows) if not seen[i])
    generator = torch.Generator().manual_seed(seed)
    for values, tokens, weight in _row_tables(model):
        known = weight[torch.from_numpy(seen[: weight.shape[0]])].float()
        mean, spread = known.mean(0), known.std(0)
        with torch.no_grad():
            for position, token in enumerate(tokens):
                if token in unseen:
                    noise = torch.randn(mean.shape, generator=generator)
                    values[position] = (mean + spread * noise).to(values.dtype)
    return unseen


def _row_tables(model: nn.Module) -> list[tuple[Tensor, list[int], Tensor]]:
    """(rows to write, the token of each row, the full table they come from): each PEFT trainable-token table
    (a tied head shares its embedding's), else the model's embedding and untied head themselves."""
    tables = [
        (m.trainable_tokens_delta["default"], list(m.token_indices["default"]), m.base_layer.weight)
        for m in model.modules()
        if hasattr(m, "trainable_tokens_delta") and getattr(m, "tied_adapter", None) is None
    ]
    if tables:
        return tables
    weights = [model.model.embed_tokens.weight]
    if not model.cfg.tie_embeddings:
        weights.append(model.lm_head.weight)
    return [(w.data, list(range(w.shape[0])), w.data.clone()) for w in weights]


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def save_adapter(
    peft_model: nn.Module, out: Path, base_export: str | None, folds: dict[str, float] | None = None
) -> None:
    """PEFT's adapter directory, pointing at the base's Hugging Face export; `folds` (the factors the export folded
    into projections, `hf_interop.weight_folds`: μP's attention scale, CompleteP's residual multiplier) scale
    those projections' adapters' B the same way. Its config reads as one PEFT wrote on a transformers model (a
    causal LM, no `auto_mapping` naming lmforge's own class), so `AutoPeftModelForCausalLM.from_pretrained(adapter)`
    loads it; `BASE_FILE` also holds the base's path relative to the adapter, found again after the outputs move."""
    peft_model.save_pretrained(str(out))
    if folds:
        from safetensors.torch import load_file, save_file

        path = out / "adapter_model.safetensors"
        weights = load_file(str(path))
        save_file({k: v * _fold(k, folds) for k, v in weights.items()}, str(path))
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text()) | {"auto_mapping": None, "task_type": "CAUSAL_LM"}
    if base_export is not None:
        config["base_model_name_or_path"] = base_export
        (out / BASE_FILE).write_text(json.dumps({"relative": os.path.relpath(base_export, out)}) + "\n")
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def adapter_base(adapter: Path) -> str | None:
    """The adapter's base export: where its config says, else where it lies relative to the adapter (the
    outputs moved together), else None."""
    named = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if named and Path(named).is_dir():
        return named
    if (adapter / BASE_FILE).is_file():
        relative = adapter / json.loads((adapter / BASE_FILE).read_text())["relative"]
        if relative.is_dir():
            return str(relative.resolve())
    return None


def _fold(key: str, folds: dict[str, float]) -> float:
    """The factor of an adapter tensor: its projection's fold for a B matrix, else 1."""
    return next((f for name, f in folds.items() if f".{_adapter_module(name)}.lora_B" in key), 1.0)


def _adapter_module(name: str) -> str:
    """Where PEFT keeps a projection's adapter: the module's own name, but for the stacked experts' parameters
    the wrappers `target_parameters` nests in `EXPERT_PARAMETERS`' order (the last one outermost)."""
    if name not in EXPERT_PARAMETERS:
        return name
    module, nesting = "mlp.experts", len(EXPERT_PARAMETERS) - 1 - EXPERT_PARAMETERS.index(name)
    return module + ".base_layer" * nesting


def merged_state_dict(peft_model: nn.Module) -> dict[str, Tensor]:
    """Our model's state dict with the adapters folded into the weights (W + BA · alpha/r)."""
    merged = peft_model.merge_and_unload()
    return {k: v.detach().clone() for k, v in merged.state_dict().items()}


def merge_adapter_export(adapter: Path, out: Path, base: str | None = None) -> Path:
    """`PeftModel.from_pretrained(base, adapter).merge_and_unload()` saved with the base's tokenizer files."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config_path = adapter / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"{adapter}: no adapter_config.json; give a PEFT adapter directory")
    base = base or adapter_base(adapter)
    if not base or not Path(base).is_dir():
        raise ValueError(
            f"{adapter}: base model {base!r} not found locally; pass --base <hf export directory>"
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(str(out), safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (Path(base) / name).is_file():
            shutil.copy(Path(base) / name, out / name)
    return out
