"""Hugging Face export, verified when written: safetensors + config.json + tokenizer files.

The export is loaded back with `AutoModelForCausalLM.from_pretrained` and its logits on a fixed probe batch are
compared with our model's; the maximum absolute difference is recorded in `export.json`, and an export above the
tolerance is marked invalid (and must never be registered). That comparison starts from the same state dict, so
it cannot see a wrong ZeRO gather or expert reassembly: with an `EngineCheck`, the exported weights must also
reproduce the trained engine's own validation loss on the same batches. A model without a Llama layout (linear
or FAVOR+ attention) is exported in lmforge's own layout instead (`export_native`), verified the same way with
lmforge loading it back.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from data_pipeline.chat import chat_format
from data_pipeline.loader import IGNORE_INDEX, Batch
from data_pipeline.tokenizer import describe
from infra.storage import atomic_write_json, damaged_file, file_records
from training.model.config import ModelConfig
from training.model.hf_interop import NATIVE_CONFIG, build_hf_model, load_export, to_hf_state_dict
from training.model.transformer import Transformer

TOLERANCE = 1e-4  # fp32 logits; the parity tests see ~1e-7
# relative difference allowed between the engine's validation loss (in its precision) and the fp32 export's;
# measured on CPU: fp32 5e-8, bf16 4e-5
ENGINE_TOLERANCE = {"fp32": 1e-4, "bf16": 5e-3, "fp16": 5e-3}


@dataclass(frozen=True)
class EngineCheck:
    """The validation loss the trained engine measured at its last step, the batches it measured it on (every
    rank's), and the relative difference the export may show (the engine's precision sets it)."""

    loss: float
    batches: list[Batch]
    tolerance: float


def mean_loss(model: torch.nn.Module, batches: list[Batch]) -> float:
    """Token-weighted next-token cross-entropy of `model` over `batches` (fp32, the loop's `evaluate` rule)."""
    total, units = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(batch.inputs).logits.float()
            total += float(
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
                )
            )
            units += batch.n_targets()
    return total / units


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def probe_tokens(cfg: ModelConfig, seed: int = 0) -> Tensor:
    length = min(32, cfg.max_seq_len)
    return torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(seed))


def set_special_tokens(hf_model: torch.nn.Module, tokenizer_dir: Path) -> None:
    """The tokenizer's ids in config.json and generation_config.json (not Llama's defaults, bos 1 / eos 2). A model
    directory's own generation settings are kept (an imported model's begin-of-text, its end-of-text list); lmforge's
    tokenizers get theirs: generation stops at end-of-text or end-of-turn, padding is the tokenizer's pad, documents
    start after an end-of-text. Either way the chat format's end-of-turn stops generation."""
    from transformers import GenerationConfig

    tok = describe(tokenizer_dir)
    end_of_turn = tok.load().token_to_id(chat_format(tok).end_of_turn)
    if (tokenizer_dir / "generation_config.json").is_file():
        hf_model.generation_config = GenerationConfig.from_pretrained(str(tokenizer_dir))
        source = json.loads((tokenizer_dir / "config.json").read_text())
        bos, eos, pad = (source.get(f"{name}_token_id") for name in ("bos", "eos", "pad"))
        eos = hf_model.generation_config.eos_token_id or eos
        pad = tok.pad_id if pad is None else pad
    else:
        bos, eos, pad = tok.eos_id, tok.eos_id, tok.pad_id
    stops = list(dict.fromkeys([*(eos if isinstance(eos, list) else [eos]), end_of_turn]))
    stops = [stop for stop in stops if stop is not None]
    for config in (hf_model.config, hf_model.generation_config):
        config.bos_token_id, config.eos_token_id, config.pad_token_id = bos, stops, pad


def served_dtype(model_dir: Path) -> torch.dtype:
    """The weights' type a model directory declares (config.json's `dtype`, or `torch_dtype` before
    transformers 5); fp32 when it names none."""
    config = model_dir / "config.json"
    named = json.loads(config.read_text()) if config.is_file() else {}
    name = named.get("dtype") or named.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def export_hf(
    state_dict: dict[str, Tensor],
    cfg: ModelConfig,
    tokenizer_dir: str | Path | None,
    out: Path,
    engine: EngineCheck | None = None,
) -> dict:
    """Write a Hugging Face model directory from our fp32 state dict and verify it (against the trained engine's
    validation loss too, when given); returns the verification. A model directory given as `tokenizer_dir` (an
    imported model, or a run tuned from one) also gives its generation settings and its weights' type: a bf16
    checkpoint is tuned in fp32 and given back in bf16, verified against our model on the same rounded weights."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per tiny shard only clutters the logs

    staging = fresh_staging(out)
    dtype = served_dtype(Path(tokenizer_dir)) if tokenizer_dir is not None and cfg.has_llama_layout else None
    if dtype is not None and dtype != torch.float32:
        state_dict = {k: v.to(dtype).float() if v.is_floating_point() else v for k, v in state_dict.items()}
    if cfg.has_llama_layout:
        hf_model = build_hf_model(cfg)
        hf_model.load_state_dict(to_hf_state_dict(state_dict, cfg), strict=True)
        if tokenizer_dir is not None:
            set_special_tokens(hf_model, Path(tokenizer_dir))
        hf_model.to(dtype or torch.float32).save_pretrained(str(staging), safe_serialization=True)
    else:
        export_native(state_dict, cfg, staging)
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), staging, cfg.max_seq_len)

    ours = Transformer(cfg, seed=None)
    ours.load_state_dict(state_dict, strict=True)
    if cfg.has_llama_layout:
        loaded = AutoModelForCausalLM.from_pretrained(
            str(staging), dtype=torch.float32, attn_implementation="eager"
        )
    else:
        loaded = load_export(staging)
    tokens = probe_tokens(cfg)
    with torch.no_grad():
        difference = float((ours.eval()(tokens).logits - loaded.eval()(tokens).logits).abs().max())
    verification = verified(difference, loaded, staging, "huggingface" if cfg.has_llama_layout else "lmforge")
    if engine is not None:
        measured = mean_loss(loaded.eval(), engine.batches)
        relative = abs(measured - engine.loss) / abs(engine.loss)
        verification |= {
            "engine_val_loss": engine.loss,
            "export_val_loss": measured,
            "engine_rel_diff": relative,
            "engine_tolerance": engine.tolerance,
            "valid": verification["valid"] and relative <= engine.tolerance,
        }
    return publish_export(staging, out, verification)


def verified(difference: float, loaded: torch.nn.Module, staging: Path, layout: str) -> dict:
    """An export's verification record: how far the loaded export's outputs are from ours on the probe (valid
    within TOLERANCE), what loaded it, and its files' digests (checked by `export_damage` before anyone loads it)."""
    return {
        "max_abs_logit_diff": difference,
        "tolerance": TOLERANCE,
        "valid": difference <= TOLERANCE,
        "architecture": type(loaded).__name__,
        "layout": layout,
        "files": file_records(staging),
    }


def export_native(state_dict: dict[str, Tensor], cfg: ModelConfig, staging: Path) -> None:
    """lmforge's own layout, for models Hugging Face cannot express: the ModelConfig and the state dict (FAVOR+
    projections included) as safetensors."""
    from safetensors.torch import save_file

    staging.mkdir(parents=True)
    save_file({k: v.detach().clone() for k, v in state_dict.items()}, str(staging / "model.safetensors"))
    atomic_write_json(staging / NATIVE_CONFIG, cfg.model_dump(mode="json"))


def fresh_staging(out: Path) -> Path:
    """`<out>.tmp`, emptied: where an export is written before it is verified and moved into place."""
    staging = out.with_name(out.name + ".tmp")
    if staging.exists():
        shutil.rmtree(staging)
    return staging


def copy_tokenizer_files(tokenizer_dir: Path, staging: Path, context: int) -> None:
    """The tokenizer's files beside the weights, its `model_max_length` the model's trained context (transformers
    reads 1e30 without one)."""
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, staging / name)
    settings = staging / "tokenizer_config.json"
    if settings.is_file():
        atomic_write_json(settings, json.loads(settings.read_text()) | {"model_max_length": context})


def publish_export(staging: Path, out: Path, verification: dict) -> dict:
    """Record the verification in the staged export, then move it to `out` (replacing an older one): an export
    directory without `export.json` is never one that finished. Every file is readable by the users who can
    read the directory (transformers writes its weights 0600, which a shared model store cannot serve)."""
    for file in staging.iterdir():
        if file.is_file():
            file.chmod(0o644)
    atomic_write_json(staging / "export.json", verification)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return verification


def read_verification(export_dir: str | Path) -> dict:
    return json.loads((Path(export_dir) / "export.json").read_text())


def export_damage(export_dir: str | Path) -> str | None:
    """What is wrong with an export directory (missing, or a file that differs from when it was written)."""
    try:
        files = read_verification(export_dir).get("files")
    except (OSError, ValueError) as error:
        return f"{Path(export_dir) / 'export.json'}: unreadable ({error})"
    return damaged_file(Path(export_dir), files) if files is not None else None
