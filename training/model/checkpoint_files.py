"""A Hugging Face model directory's weights, read safely and lazily: safetensors only (one file or shards named by
`model.safetensors.index.json`), one tensor at a time, so importing needs memory for the weights and little more.

lmforge never unpickles a checkpoint it did not write (`.bin`/`.pt` files run code when loaded); GGUF files are
llama.cpp's quantised format, not a training checkpoint. Both are refused in one line saying how to convert.
MoE experts stored one module per expert (what `save_pretrained` writes for Mixtral and the Qwen MoE families) are
stacked into the layout of the modelling code and ours (`mlp.experts.gate_up_proj` (E, 2I, H), gate rows first;
`mlp.experts.down_proj` (E, H, I)), the conversion transformers applies when it loads them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from data_pipeline.sources import DataError

INDEX = "model.safetensors.index.json"
PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt")
# one expert's projection per key: Mixtral's w1 (gate), w3 (up), w2 (down); the Qwen MoE families' names
PER_EXPERT = re.compile(
    r"^(.*)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
GATE, UP, DOWN = ("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")

CONVERT = (
    "convert it once with transformers where you trust the file: "
    "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT, safe_serialization=True)"
)


def refuse_gguf(path: Path) -> None:
    """A GGUF file (or a directory of them) refused, naming what to give instead."""
    if path.is_file() and path.suffix == ".gguf" or path.is_dir() and list(path.glob("*.gguf")):
        raise DataError(
            f"{path}: a GGUF file is llama.cpp's quantised inference format, not a checkpoint lmforge trains; "
            "give the Hugging Face model directory it was converted from (config.json + *.safetensors)"
        )


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files holding the model's weights: the index's shards (each must exist) or the directory's
    `*.safetensors`; a refusal naming the fix for pickled or GGUF weights, missing shards or no weights."""
    refuse_gguf(directory)
    index = directory / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, AttributeError) as error:
            raise DataError(
                f"{index}: not a safetensors index ({error}); restore it from the source"
            ) from None
        missing = [name for name in shards if not (directory / name).is_file()]
        if missing:
            raise DataError(
                f"{directory}: shards {', '.join(missing)} named in {INDEX} are missing; download or copy them "
                "again (every shard the index names)"
            )
        return [directory / name for name in shards]
    files = sorted(directory.glob("*.safetensors"))
    if files:
        return files
    pickled = sorted(p.name for pattern in PICKLED for p in directory.glob(pattern))
    if pickled:
        raise DataError(
            f"{directory}: weights only in pickled files ({', '.join(pickled)}); lmforge never unpickles a "
            f"checkpoint it did not write (loading one runs code); {CONVERT}"
        )
    raise DataError(f"{directory}: no *.safetensors weights; give a Hugging Face model directory")


def read_state_dict(directory: str | Path, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """Every tensor of the directory's weights in our keys, in `dtype` (None: as stored), read one at a time;
    per-expert MoE keys stacked layer by layer."""
    directory = Path(directory)
    state: dict[str, Tensor] = {}
    experts: dict[str, dict[str, dict[int, Tensor]]] = {}  # layer -> projection -> expert -> (out, in)
    for file in weight_files(directory):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensor = handle.get_tensor(key)
                    tensor = tensor if dtype is None else tensor.to(dtype)
                    match = PER_EXPERT.match(key)
                    if match:
                        layer, expert, which = match.groups()
                        experts.setdefault(layer, {}).setdefault(which, {})[int(expert)] = tensor
                    else:
                        state[key.replace(".block_sparse_moe.", ".mlp.")] = tensor
        except Exception as error:  # safetensors raises its own error types for truncated or damaged files
            if isinstance(error, DataError):
                raise
            raise DataError(f"{file}: unreadable safetensors ({error}); download or copy it again") from None
    for layer in list(experts):
        state |= stacked(layer, experts.pop(layer))
    return state


def stacked(layer: str, parts: dict[str, dict[int, Tensor]]) -> dict[str, Tensor]:
    """One layer's per-expert projections as the stacked `gate_up_proj` and `down_proj`."""

    def stack(names: tuple[str, str]) -> Tensor:
        (which,) = [name for name in names if name in parts]
        per_expert = parts.pop(which)
        return torch.stack([per_expert.pop(e) for e in sorted(per_expert)])

    gate, up, down = stack(GATE), stack(UP), stack(DOWN)
    return {
        f"{layer}.mlp.experts.gate_up_proj": torch.cat([gate, up], dim=1),
        f"{layer}.mlp.experts.down_proj": down,
    }
