"""Matrix (second-order) optimisers on the blocks' 2-D weights, AdamW on everything else, as one torch optimiser.

SOAP (Vyas et al. 2024: Adam in the eigenbasis of Shampoo's preconditioner), Shampoo (Gupta et al. 2018, in the
scalable form of Anil et al. 2020 with RMSProp grafting for the step size) and PSGD-Kron (Li 2018) come from the
`pytorch-optimizer` package; K-FAC is lmforge's (`training/optim/kfac.py`). Each sees the matrices as matrices, so
they need ZeRO stage 0 (ZeRO hands optimisers flat 1-D partitions, which would silently make them diagonal:
the recipe refuses it). Embeddings, norms, the LM head and the MoE experts' stacked weights stay on AdamW.
`Chain` presents both optimisers to DeepSpeed and the loop as one: shared parameter-group dicts, one state dict.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from training.config import OptimConfig
from training.optim.kfac import KFAC

MATRIX_GROUP = "matrix"


class Chain(torch.optim.Optimizer):
    """Optimisers over disjoint parameter groups, stepped together; `param_groups` are theirs (the same dicts), so
    learning rates set here reach them and DeepSpeed's fp32 copies replace their parameters."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for optimizer, state in zip(self.optimizers, state_dict["optimizers"], strict=True):
            optimizer.load_state_dict(state)
        self.param_groups[:] = [g for o in self.optimizers for g in o.param_groups]  # loading replaced them


def linear_layers_of(model: nn.Module, params: list[nn.Parameter]) -> list[nn.Linear]:
    """The nn.Linear owning each of `params` (as its weight), in order."""
    owners = {id(m.weight): m for m in model.modules() if isinstance(m, nn.Linear)}
    missing = [i for i, p in enumerate(params) if id(p) not in owners]
    if missing:
        raise ValueError(f"K-FAC preconditions nn.Linear weights only; {len(missing)} matrices are not one")
    return [owners[id(p)] for p in params]


def matrix_optimizer(
    groups: list[dict[str, Any]], cfg: OptimConfig, model: nn.Module, grad_scale: float
) -> torch.optim.Optimizer:
    """The optimiser `cfg.name` over the matrix groups."""
    every = cfg.precondition_every
    if cfg.name == "soap":
        from pytorch_optimizer import SOAP

        return SOAP(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, precondition_frequency=every)
    if cfg.name == "shampoo":
        from pytorch_optimizer import ScalableShampoo
        from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting

        return ScalableShampoo(
            groups,
            lr=cfg.lr,
            betas=cfg.betas,
            decoupled_weight_decay=True,
            start_preconditioning_step=every,
            preconditioning_compute_steps=every,
            graft_type=LayerWiseGrafting.RMSPROP,
            matrix_eps=cfg.damping,
        )
    if cfg.name == "kron":
        from pytorch_optimizer import Kron

        return Kron(groups, lr=cfg.lr, momentum=cfg.betas[0], pre_conditioner_update_probability=1 / every)
    if cfg.name == "kfac":
        params = [p for g in groups for p in g["params"]]
        return KFAC(
            groups,
            linear_layers_of(model, params),
            lr=cfg.lr,
            momentum=cfg.betas[0],
            damping=cfg.damping,
            update_every=every,
            grad_scale=grad_scale,
        )
    raise ValueError(f"optim.name={cfg.name!r} is not a matrix optimiser")


def build_chain(groups: list[dict[str, Any]], cfg: OptimConfig, model: nn.Module, grad_scale: float) -> Chain:
    """The matrix optimiser on the `matrix` groups, AdamW on the rest."""
    matrices = [g for g in groups if g["name"] == MATRIX_GROUP]
    rest = [g for g in groups if g["name"] != MATRIX_GROUP]
    if not matrices:
        raise ValueError(f"optim.name={cfg.name} found no trainable 2-D matrices inside the blocks")
    optimizers = [matrix_optimizer(matrices, cfg, model, grad_scale)]
    if rest:
        optimizers.append(torch.optim.AdamW(rest, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False))
    return Chain(optimizers)
