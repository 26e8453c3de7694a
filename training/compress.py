"""Model-level compression over `training/quantize.py` and `training/lowrank.py` (issue 18's groundwork).

`layer_hessians` collects H = 2·XᵀX/n of every transformer linear layer's inputs from calibration batches in
one pass of the unquantized model (the common one-shot simplification; the paper feeds each layer the already
quantized layers' outputs). `quantize_model` replaces those layers' weights in place with RTN or GPTQ weights.
The embeddings and the LM head stay in full precision; MoE experts (stacked parameters, not `nn.Linear`) are
left alone for now.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch
from torch import Tensor, nn

from training.quantize import Quantized, gptq, rtn


def linear_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The transformer blocks' linear layers by module name (not the LM head)."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.split(".")[-1] != "lm_head"
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


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    method: Literal["rtn", "gptq"],
    bits: int,
    group_size: int,
    hessians: dict[str, Tensor] | None = None,
) -> dict[str, Quantized]:
    """Quantize every transformer linear layer of `model` in place; GPTQ needs `layer_hessians` first."""
    if method == "gptq" and hessians is None:
        raise ValueError("GPTQ needs calibration: pass layer_hessians(model, batches)")
    results = {}
    for name, layer in linear_layers(model).items():
        if method == "rtn":
            q = rtn(layer.weight, bits, group_size, name)
        else:
            q = gptq(layer.weight, hessians[name], bits, group_size, name=name)
        layer.weight.copy_(q.weight.to(layer.weight.dtype))
        results[name] = q
    return results
