"""One compressed variant of a model: what it is (`VariantConfig`), how it is made from the uncompressed model
(`build_variant`), written (`save_variant`: a verified Hugging Face export plus lmforge's own compact storage:
bit-packed codes for intx weights, the two factors for low-rank) and read back into lmforge (`load_variant`).

Methods: torchao's `int8-weight`, `int8-dynamic` and group-wise `int4`; lmforge's `rtn` and `gptq` at 2/3/4/8
bits (held as torchao intx tensors); `lowrank` (truncated SVD per layer, by retained energy, a fixed rank or a
global parameter budget); `magnitude` and `wanda` pruning (unstructured at a sparsity, or 2:4). Quantized
variants export as torchao-quantized Hugging Face models (`save_pretrained`, loadable with torchao installed);
pruned ones as ordinary dense exports; low-rank ones export the product of the factors (a Llama layout has no
place for two factors), while lmforge loads the factors themselves.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from infra.storage import file_records
from training.compress import prune
from training.compress.config import QUANTIZED, VariantConfig
from training.compress.lowrank import LowRankLinear, rank_for_energy
from training.compress.model_level import (
    factorize_model,
    intx_config,
    layer_hessians,
    linear_layers,
    quantize_model,
    torchao_config,
    torchao_model,
)
from training.compress.quantize import pack_codes, unpack_codes
from training.model.config import ModelConfig
from training.model.export import (
    TOLERANCE,
    copy_tokenizer_files,
    export_hf,
    fresh_staging,
    probe_tokens,
    publish_export,
)
from training.model.hf_interop import load_export, load_hf_config, load_weights
from training.model.transformer import Transformer

FACTORS = "factors.safetensors"
PACKED = "packed.safetensors"
DYNAMIC_TOLERANCE = (
    0.05  # mean |Δlogit| allowed for a dynamically quantized export (its codes must match exactly)
)


# ---- making a variant -----------------------------------------------------------------------------------


def check_shapes(cfg: ModelConfig, variants: list[VariantConfig]) -> None:
    """Refuse, before any work, a setting some layer's shape cannot take (naming the variant and the layer):
    a group size that does not divide its input columns, 2:4 on inputs not divisible by 4, a rank above
    min(m, n)."""
    with torch.device("meta"):
        shapes = {
            name: tuple(layer.weight.shape)
            for name, layer in linear_layers(Transformer(cfg, seed=None)).items()
        }
    for variant in variants:
        for name, (m, n) in shapes.items():
            if problem := shape_problem(variant.settings(), m, n):
                raise ValueError(f"compress.variants {variant.name}: {name}: {problem}")


def shape_problem(settings: dict[str, Any], m: int, n: int) -> str | None:
    """What a (m, n) weight cannot take of a variant's settings, with the fix, or None."""
    if "group_size" in settings and n % settings["group_size"]:
        return f"group size {settings['group_size']} does not divide its {n} input columns; pick a divisor of {n}"
    if settings.get("pattern") == "2:4" and n % 4:
        return f"2:4 pruning needs the input dimension ({n}) divisible by 4"
    if settings.get("rank", 0) > min(m, n):
        return (
            f"lowrank rank {settings['rank']} is above min(m, n) = {min(m, n)} of its {m}x{n} weight; pick a rank "
            f"up to {min(m, n)}"
        )
    return None


def lowrank_ranks(model: nn.Module, settings: dict[str, Any]) -> dict[str, int | None]:
    """The rank of each layer (None: stays dense, because its factors would not be smaller).

    `energy`: per layer, the smallest rank keeping that share of Σσ². `rank`: the same everywhere (refused above a
    layer's min(m, n)). `budget`: one global choice keeping the singular values with the most energy per stored
    parameter (σ²/(m+n)) until that share of the layers' parameters is spent."""
    layers = linear_layers(model)
    ranks: dict[str, int | None] = {}
    if "budget" in settings:
        candidates, total = [], 0
        for name, layer in layers.items():
            m, n = layer.weight.shape
            total += m * n
            s = torch.linalg.svdvals(layer.weight.double())
            candidates += [(float(v) ** 2 / (m + n), name, m + n) for v in s]
        chosen: dict[str, int] = dict.fromkeys(layers, 0)
        spent = 0
        for _, name, cost in sorted(candidates, reverse=True):
            if spent + cost > settings["budget"] * total:
                break
            chosen[name] += 1
            spent += cost
        ranks = {name: max(rank, 1) for name, rank in chosen.items()}
    for name, layer in layers.items():
        m, n = layer.weight.shape
        if "rank" in settings:
            if problem := shape_problem(settings, m, n):
                raise ValueError(f"{name}: {problem}")
            ranks[name] = settings["rank"]
        elif "energy" in settings:
            ranks[name] = rank_for_energy(torch.linalg.svdvals(layer.weight.double()), settings["energy"])
        if ranks[name] * (m + n) >= m * n:
            ranks[name] = None
    return ranks


def build_variant(
    base: Transformer, variant: VariantConfig, calibration: Callable[[], list[Tensor]]
) -> tuple[Transformer, dict[str, Any]]:
    """A compressed copy of `base` (left untouched) and what the method reports per layer; `calibration()`
    gives the calibration token batches (only the activation-aware methods call it)."""
    model = copy.deepcopy(base).eval()
    s = variant.settings()
    details: dict[str, Any] = {}
    with torch.no_grad():
        if variant.method in ("int8-weight", "int8-dynamic", "int4"):
            torchao_model(model, variant.method, s.get("group_size"))
        elif variant.method in ("rtn", "gptq"):
            hessians = layer_hessians(model, calibration()) if variant.method == "gptq" else None
            quantize_model(model, variant.method, s["bits"], s["group_size"], hessians)
        elif variant.method == "lowrank":
            details["layers"] = factorize_model(model, lowrank_ranks(model, s))
        else:
            layers = linear_layers(model)
            if variant.method == "magnitude":
                prune.magnitude(layers, s["sparsity"], s["pattern"])
            else:
                prune.wanda(model, layers, calibration(), s["sparsity"], s["pattern"])
            details["density"] = prune.density(layers)
    return model, details


# ---- writing and reading one ----------------------------------------------------------------------------


def dense_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's weights with every `LowRankLinear` multiplied out into `<name>.weight`."""
    state = {}
    for key, value in model.state_dict().items():
        module, _, param = key.rpartition(".")
        if isinstance(model.get_submodule(module), LowRankLinear):
            if param == "a":
                state[f"{module}.weight"] = model.get_submodule(module).dense()
            elif param == "bias":
                state[key] = value
        else:
            state[key] = value
    return state


def export_quantized(model: Transformer, hf_config: Any, base_export: Path, out: Path) -> dict[str, Any]:
    """Write `model`'s torchao weights as a Hugging Face model quantized with `hf_config` (TorchAoConfig's
    inner config) and verify it: reloaded with `from_pretrained`, its logits must match `model`'s."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    staging = fresh_staging(out)
    hf = AutoModelForCausalLM.from_pretrained(
        str(base_export), dtype=torch.float32, quantization_config=TorchAoConfig(hf_config)
    )
    for name, layer in linear_layers(
        model
    ).items():  # ours, not a re-quantization (GPTQ's codes are not RTN's)
        hf.get_submodule(name).weight = nn.Parameter(layer.weight.detach(), requires_grad=False)
    hf.save_pretrained(str(staging), safe_serialization=True)
    copy_tokenizer_files(base_export, staging, model.cfg.max_seq_len)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(staging), dtype=torch.float32, attn_implementation="eager"
    )
    tokens = probe_tokens(model.cfg)
    with torch.no_grad():
        difference = (model.eval()(tokens).logits - loaded.eval()(tokens).logits).abs()
    layers = linear_layers(model).items()
    same = all(same_quantized(layer.weight, loaded.get_submodule(name).weight) for name, layer in layers)
    # with quantized activations two correct implementations differ: their ~1e-6 float differences flip int8
    # roundings, which cascade through attention; there the stored codes must match and the logits stay close
    dynamic = "DynamicActivation" in type(hf_config).__name__
    checked = float(difference.mean() if dynamic else difference.max())
    verification = {
        "max_abs_logit_diff": float(difference.max()),
        "mean_abs_logit_diff": float(difference.mean()),
        "tolerance": TOLERANCE,
        "weights_identical": same,
        "valid": same and checked <= (DYNAMIC_TOLERANCE if dynamic else TOLERANCE),
        "architecture": type(loaded).__name__,
        "quantization": type(hf_config).__name__,
        "files": file_records(staging),
    }
    return publish_export(staging, out, verification)


def same_quantized(ours: Tensor, theirs: Tensor) -> bool:
    """Whether two (torchao) tensors hold the same codes, scales and zero points, bit for bit."""
    names = getattr(ours, "tensor_data_names", None)
    if not names:
        return torch.equal(ours, theirs)
    return type(ours) is type(theirs) and all(
        torch.equal(getattr(ours, n), getattr(theirs, n)) for n in names
    )


def hf_quantization(variant: VariantConfig) -> Any:
    """The torchao config a Hugging Face loader needs for `variant`'s tensors (quantized methods only)."""
    s = variant.settings()
    if variant.method in ("rtn", "gptq"):
        return intx_config(s["bits"], s["group_size"])
    return torchao_config(variant.method, s.get("group_size"))


def is_intx(weight: Tensor) -> bool:
    return type(weight).__name__ == "IntxUnpackedToInt8Tensor"


def save_packed(model: Transformer, path: Path) -> None:
    """lmforge's storage of an intx-quantized model: each quantized weight's codes bit-packed at its width
    (`pack_codes`), its group scales as they are and its integer zero points as int8 (exact); other tensors as
    they are (a tied head once). What a 4-bit variant weighs on disk."""
    state, layout = {}, {}
    for name, layer in linear_layers(model).items():
        w = layer.weight
        bits = int(str(w.target_dtype).removeprefix("torch.int"))
        zero = w.zero_point
        small = bool((zero == zero.round()).all() and zero.abs().max() <= 127)
        state[f"{name}.weight.codes"] = pack_codes(w.qdata.to(torch.int16) + 2 ** (bits - 1), bits)
        state[f"{name}.weight.scale"] = w.scale.contiguous()
        state[f"{name}.weight.zero_point"] = zero.to(torch.int8) if small else zero.contiguous()
        layout[name] = {
            "bits": bits,
            "shape": list(w.shape),
            "block": list(w.block_size),
            "zero": str(zero.dtype),
        }
    # biases of quantized layers (Qwen2's q/k/v) stay as they are
    for key, value in model.state_dict().items():
        quantized = key.endswith(".weight") and key.removesuffix(".weight") in layout
        if not quantized and not (key == "lm_head.weight" and model.cfg.tie_embeddings):
            state[key] = value.contiguous()
    save_file(state, str(path), metadata={"layout": json.dumps(layout)})


def load_packed(directory: Path) -> Transformer:
    """The model `save_packed` wrote, its quantized weights as torchao intx tensors again (bit for bit)."""
    from safetensors import safe_open
    from torchao.quantization import IntxUnpackedToInt8Tensor

    with safe_open(str(directory / PACKED), "pt") as f:
        layout = json.loads(f.metadata()["layout"])
    state = load_file(str(directory / PACKED))
    for name, info in layout.items():
        bits = info["bits"]
        codes = unpack_codes(state.pop(f"{name}.weight.codes"), bits, tuple(info["shape"]))
        state[f"{name}.weight"] = IntxUnpackedToInt8Tensor(
            (codes.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8),
            state.pop(f"{name}.weight.scale"),
            state.pop(f"{name}.weight.zero_point").to(getattr(torch, info["zero"].removeprefix("torch."))),
            getattr(torch, f"int{bits}"),
            tuple(info["block"]),
            torch.float32,
            None,
        )
    model = Transformer(load_hf_config(directory / "hf"), seed=None)
    return load_weights(model, state, directory / PACKED, assign=True)


def save_variant(model: Transformer, variant: VariantConfig, base_export: Path, out: Path) -> dict[str, Any]:
    """`out/hf` (the verified export) and lmforge's own storage where it is smaller: `factors.safetensors` for
    low-rank, `packed.safetensors` for intx codes (what lmforge loads, and the variant's size); returns the
    export's verification."""
    out.mkdir(parents=True, exist_ok=True)
    if variant.method in QUANTIZED:
        verification = export_quantized(model, hf_quantization(variant), base_export, out / "hf")
        if all(is_intx(layer.weight) for layer in linear_layers(model).values()):
            save_packed(model, out / PACKED)
        return verification
    if variant.method == "lowrank":
        state = {
            k: v.contiguous()
            for k, v in model.state_dict().items()
            if k != "lm_head.weight" or not model.cfg.tie_embeddings
        }
        save_file(state, str(out / FACTORS))
    tokenizer = base_export if (base_export / "tokenizer.json").is_file() else None
    return export_hf(dense_state_dict(model), model.cfg, tokenizer, out / "hf")


def weight_files(directory: Path) -> list[Path]:
    """The files that hold a variant's weights: its factors for low-rank, else its export's safetensors."""
    for own in (FACTORS, PACKED):
        if (directory / own).is_file():
            return [directory / own]
    return sorted((directory / "hf").glob("*.safetensors"))


def load_variant(directory: str | Path, method: str) -> Transformer:
    """The variant in `directory` as our Transformer, weights as stored (torchao tensors, factors or zeros)."""
    directory = Path(directory)
    if method == "lowrank":
        state = load_file(str(directory / FACTORS))
        model = Transformer(load_hf_config(directory / "hf"), seed=None)
        for name in {k.rpartition(".")[0] for k in state if k.endswith(".a")}:
            parent, _, child = name.rpartition(".")
            setattr(
                model.get_submodule(parent),
                child,
                LowRankLinear(state[f"{name}.a"], state[f"{name}.b"], state.get(f"{name}.bias")),
            )
        return load_weights(model, state, directory / FACTORS)
    if method not in QUANTIZED:
        return load_export(directory / "hf")
    if (directory / PACKED).is_file():
        return load_packed(directory)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory / "hf"), dtype=torch.float32)
    model = Transformer(load_hf_config(directory / "hf"), seed=None)
    return load_weights(model, dict(hf.state_dict()), directory / "hf", assign=True)
