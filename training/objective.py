"""What a training stage minimises, as the loop sees it.

Per micro-batch an objective returns the mean of its loss over some units (tokens for cross-entropy; a
preference loss would count pairs) and says how many units the micro-batch holds; the loop weights each mean by
its share of the step's units across micro-batches and ranks, so the step minimises the global mean. Router
losses are added unweighted; extra metrics are logged as named, averaged over micro-batches and ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from data_pipeline.loader import Batch
from training.engine import Engine
from training.model.moe import RouterStats


@dataclass
class Outcome:
    """One micro-batch's result."""

    loss: Tensor  # mean over the micro-batch's units
    aux_loss: Tensor | float = 0.0  # added as is (MoE load-balancing and z-losses)
    router_stats: list[RouterStats] = field(default_factory=list)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # e.g. "rewards/margins"


class Objective(Protocol):
    def units(self, batch: Batch) -> int:
        """How many units `loss` averages over in this micro-batch (0: it carries no loss)."""
        ...

    def __call__(self, engine: Engine, batch: Batch) -> Outcome: ...


class TokenCrossEntropy:
    """Next-token cross-entropy over the positions that carry loss (pretraining: all; SFT: response tokens)."""

    def units(self, batch: Batch) -> int:
        return batch.n_targets()

    def __call__(self, engine: Engine, batch: Batch) -> Outcome:
        out = engine.forward(batch, logits_grad=False)  # the loss alone is differentiated
        return Outcome(loss=out.ce_loss, aux_loss=out.aux_loss, router_stats=out.router_stats)
