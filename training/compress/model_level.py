"""Model-level compression over `training/compress/quantize.py`, `training/compress/lowrank.py` and `training/compress/prune.py`.

`layer_hessians` collects H = 2·XᵀX/n of every transformer linear layer's inputs from calibration batches in
one pass of the unquantized model (the common one-shot simplification; the paper feeds each layer the already
quantized layers' outputs). `quantize_model` replaces those layers' weights with RTN or GPTQ weights held as
torchao `IntxUnpackedToInt8Tensor`s (int8 codes, group scales and zero points: what torchao's own int4 holds, so
Hugging Face saves and loads them); `torchao_model` applies torchao's own configs; `factorize_model` swaps
layers for `LowRankLinear`. The embeddings, the LM head and MoE routers stay in full precision; MoE experts
(stacked parameters, not `nn.Linear`) are left alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import Tensor, nn

from training.compress.lowrank import LowRankLinear, factorize
from training.compress.quantize import Quantized, check_shape, gptq, rtn


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The transformer blocks' linear layers by module name (not the LM head)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.split(".")[-1] not in ("lm_head", "gate")
    }


@torch.no_grad()
def layer_hessians(model: nn.Module, batches: Iterable[Tensor]) -> dict[str, Tensor]:
    """2·XᵀX/n (float64) of each linear layer's inputs over the calibration token batches (B, T)."""
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str):
        def collect(_module: nn.Module, args: tuple[Tensor, ...], _output: Tensor) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]

        return collect

    handles = [m.register_forward_hook(hook(name)) for name, m in linear_layers(model).items()]
    try:
        model.eval()
        for tokens in batches:
            model(tokens)
    finally:
        for handle in handles:
            handle.remove()
    return {name: 2.0 * sums[name] / counts[name] for name in sums}


def torchao_weight(q: Quantized) -> Tensor:
    """`q` as torchao's unpacked intx tensor: codes shifted to the signed range of torch.int{bits}, so
    (qdata − zero_point)·scale is exactly `q.weight`."""
    from torchao.quantization import IntxUnpackedToInt8Tensor

    shift = 2 ** (q.bits - 1)
    return IntxUnpackedToInt8Tensor(
        (q.codes.to(torch.int16) - shift).to(torch.int8),
        q.scales.float(),
        (q.zeros - shift).float(),
        getattr(torch, f"int{q.bits}"),
        (1, q.group_size),
        torch.float32,
        None,
    )


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    method: Literal["rtn", "gptq"],
    bits: int,
    group_size: int,
    hessians: dict[str, Tensor] | None = None,
) -> dict[str, Quantized]:
    """Quantize every transformer linear layer of `model` in place (torchao tensors, see `torchao_weight`);
    GPTQ needs `layer_hessians` first. All layers are checked before any is changed."""
    if method == "gptq" and hessians is None:
        raise ValueError("GPTQ needs calibration: pass layer_hessians(model, batches)")
    layers = linear_layers(model)
    for name, layer in layers.items():
        check_shape(name, layer.weight, bits, group_size)
    results = {}
    for name, layer in layers.items():
        if method == "rtn":
            q = rtn(layer.weight, bits, group_size, name)
        else:
            q = gptq(layer.weight, hessians[name], bits, group_size, name=name)
        layer.weight = nn.Parameter(torchao_weight(q), requires_grad=False)
        results[name] = q
    return results


TorchaoKind = Literal["int8-weight", "int8-dynamic", "int4"]


def torchao_config(kind: TorchaoKind, group_size: int | None = None) -> Any:
    """torchao's config for `kind`: int8 weight-only or dynamic-activation int8 (per channel), or int4
    weight-only in groups of `group_size` input columns (its CPU path)."""
    from torchao.quantization import (
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
    )
    from torchao.quantization.granularity import PerGroup

    if kind == "int8-weight":
        return Int8WeightOnlyConfig()
    if kind == "int8-dynamic":
        return Int8DynamicActivationInt8WeightConfig()
    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(group_size))


def intx_config(bits: int, group_size: int) -> Any:
    """The torchao config whose tensors `torchao_weight` builds (asymmetric group-wise intx, weight only): what a
    loader needs to know to read RTN/GPTQ weights back."""
    from torchao.quantization import IntxWeightOnlyConfig, MappingType
    from torchao.quantization.granularity import PerGroup

    return IntxWeightOnlyConfig(
        weight_dtype=getattr(torch, f"int{bits}"),
        granularity=PerGroup(group_size),
        mapping_type=MappingType.ASYMMETRIC,
    )


@torch.no_grad()
def torchao_model(model: nn.Module, kind: TorchaoKind, group_size: int | None = None) -> None:
    """Apply torchao's `kind` to the transformer linear layers of `model` in place."""
    from torchao.quantization import quantize_

    layers = linear_layers(model)
    if kind == "int4":
        for name, layer in layers.items():
            check_shape(name, layer.weight, 4, group_size)
    quantize_(model, torchao_config(kind, group_size), filter_fn=lambda module, fqn: fqn in layers)


@torch.no_grad()
def factorize_model(model: nn.Module, ranks: dict[str, int | None]) -> dict[str, dict[str, float | int]]:
    """Replace each named layer by its rank-r truncated SVD (`LowRankLinear`), or keep it dense (rank None);
    returns per layer the rank and the Frobenius error with its Eckart–Young bound."""
    layers = linear_layers(model)
    details = {}
    for name, rank in ranks.items():
        layer = layers[name]
        if rank is None:
            details[name] = {"rank": min(layer.weight.shape), "dense": True}
            continue
        factors = factorize(layer.weight, rank=rank, name=name)
        error = float(
            torch.linalg.matrix_norm(layer.weight.double() - factors.a.double() @ factors.b.double())
        )
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LowRankLinear(factors.a, factors.b, layer.bias))
        details[name] = {"rank": rank, "error": error, "bound": factors.frobenius_error_bound()}
    return details


def tensor_bytes(tensor: Tensor) -> int:
    """Bytes a tensor holds: a torchao tensor's components (codes, scales, zero points), else numel × itemsize."""
    names = getattr(tensor, "tensor_data_names", None)
    if names:
        parts = [getattr(tensor, n) for n in names + list(getattr(tensor, "optional_tensor_data_names", []))]
        return sum(tensor_bytes(p) for p in parts if p is not None)
    return tensor.numel() * tensor.element_size()


def model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers in memory (a tied embedding counted once)."""
    seen = {id(p): p for p in model.parameters()} | {id(b): b for b in model.buffers()}
    return sum(tensor_bytes(t) for t in seen.values())
