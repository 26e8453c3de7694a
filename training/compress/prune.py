"""Weight pruning of linear layers: magnitude (`torch.nn.utils.prune`) and activation-aware Wanda (torchao's
`WandaSparsifier`), unstructured at a sparsity or semi-structured n:m (2:4 keeps the 2 largest of every 4
consecutive input weights of a row, the pattern sparse tensor cores run).

Magnitude ranks weights by |W| within each layer; Wanda (Sun et al. 2023) by |W|·‖X_j‖₂, the weight times the
norm of its input feature over calibration tokens, so a small weight on a loud input survives. The zeros are
written into the weights (masks removed): the model stays an ordinary dense model.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.utils import prune

from training.compress.config import check_sparsity

Pattern = Literal["unstructured", "2:4"]


def n_m_mask(score: Tensor, n: int = 2, m: int = 4, name: str = "layer") -> Tensor:
    """Keep the `n` highest-scoring of every `m` consecutive input columns of each row (score (out, in))."""
    if score.shape[1] % m:
        raise ValueError(
            f"{name}: {n}:{m} pruning needs the input dimension ({score.shape[1]}) divisible by {m}"
        )
    groups = score.reshape(score.shape[0], -1, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(2, groups.topk(n, dim=2).indices, True)
    return keep.reshape(score.shape)


@torch.no_grad()
def magnitude(layers: dict[str, nn.Linear], sparsity: float, pattern: Pattern) -> None:
    """Zero the smallest-|W| weights of each layer (`sparsity` of them, or 2 of every 4)."""
    check_sparsity(sparsity)
    for name, layer in layers.items():
        if pattern == "2:4":
            prune.custom_from_mask(layer, "weight", n_m_mask(layer.weight.abs(), name=name))
        else:
            prune.l1_unstructured(layer, "weight", amount=sparsity)
        prune.remove(layer, "weight")


@torch.no_grad()
def wanda(
    model: nn.Module,
    layers: dict[str, nn.Linear],
    batches: Iterable[Tensor],
    sparsity: float,
    pattern: Pattern,
) -> None:
    """torchao's Wanda: observe each layer's input-feature norms on the calibration batches, then prune by
    |W|·‖X_j‖ (per layer, or per 4 consecutive inputs for 2:4)."""
    from torchao.sparsity import WandaSparsifier

    check_sparsity(sparsity)
    if pattern == "2:4":
        for name, layer in layers.items():
            if layer.in_features % 4:
                raise ValueError(
                    f"{name}: 2:4 pruning needs the input dimension ({layer.in_features}) divisible by 4"
                )
    with warnings.catch_warnings():  # it warns that 2:4 fixes the sparsity at 50%, which is what 2:4 means
        warnings.simplefilter("ignore")
        sparsifier = WandaSparsifier(
            sparsity_level=0.5 if pattern == "2:4" else sparsity,
            semi_structured_block_size=4 if pattern == "2:4" else None,
        )
        sparsifier.prepare(model, [{"tensor_fqn": f"{name}.weight"} for name in layers])
        model.eval()
        for tokens in batches:
            model(tokens)
        sparsifier.step()
        sparsifier.squash_mask()


def density(layers: dict[str, nn.Linear]) -> float:
    """The share of non-zero weights over `layers`."""
    nonzero = sum(int(layer.weight.count_nonzero()) for layer in layers.values())
    return nonzero / sum(layer.weight.numel() for layer in layers.values())
