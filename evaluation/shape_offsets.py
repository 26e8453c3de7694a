"""Each swept shape's own offset from the point law: how far its runs sat from the law at the largest swept budget,
shrunk toward zero by what seed noise alone would leave (empirical Bayes). Neither law form sees a model's shape,
only its N; on the demo's sweeps three layers 48 wide sat below Kaplan's law at 8e11 and two layers 64 wide above
it, and at the rung's budget the first ended 1.1% lower (three seeds each, README "Which shape the rung gets").
The rung is sized by the law's loss times this offset and predicted with it (`flows.scaling.shaped_rung`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from evaluation.loss_curve import PointLaw
from evaluation.scaling_data import ScalingPoints

TOP_BUDGET = 0.9  # points within this share of the largest compute count as the largest budget's


@dataclass(frozen=True)
class ShapeOffset:
    """A swept shape's log offset from the law (its loss ≈ law × exp(offset)): the mean of its runs' log residuals
    at the largest budget (`raw`) shrunk by τ² / (τ² + se²), with its posterior sd; τ² is the spread of the shapes'
    means beyond their noise."""

    n: float
    offset: float
    sd: float
    raw: float
    runs: int

    def factor(self) -> float:
        return math.exp(self.offset)


def shape_offsets(points: ScalingPoints, law: PointLaw) -> dict[float, ShapeOffset]:
    """By N (a swept shape's), its offset at the largest budget; empty where no shape has two runs there (no
    estimate of the seed noise) or the shapes' means vary no more than that noise explains (all offsets 0)."""
    top = points.c >= TOP_BUDGET * points.c.max()
    n = points.n[top]
    residuals = np.log(points.loss[top]) - np.log(law.loss(n, points.d[top]))
    groups = {float(size): residuals[n == size] for size in np.unique(n)}
    replicated = [r for r in groups.values() if len(r) >= 2]
    if not replicated or len(groups) < 2:
        return {}
    # one run's variance about its shape's mean, pooled over the replicated shapes
    noise = float(np.mean([np.var(r, ddof=1) for r in replicated]))
    raw = {size: float(np.mean(r)) for size, r in groups.items()}
    se2 = {size: noise / len(r) for size, r in groups.items()}
    spread = max(0.0, float(np.var(list(raw.values()), ddof=1)) - float(np.mean(list(se2.values()))))
    out = {}
    for size, r in groups.items():
        keep = spread / (spread + se2[size]) if spread + se2[size] > 0 else 0.0
        out[size] = ShapeOffset(size, keep * raw[size], math.sqrt(keep * se2[size]), raw[size], len(r))
    return out


@dataclass(frozen=True)
class Shifted:
    """A point law times a shape's offset factor (the rung's curve is anchored to it)."""

    law: PointLaw
    factor: float

    def loss(self, n: np.ndarray | float, d: np.ndarray | float) -> np.ndarray:
        return np.asarray(self.law.loss(n, d)) * self.factor


def widened(loss: float, bounds: tuple[float, float], offset: ShapeOffset) -> tuple[float, float]:
    """An interval around `loss` (already times the offset's factor) widened by the offset's own uncertainty: each
    side's log half-width and 1.96 of the offset's sd added in quadrature."""
    lo, hi = bounds
    z = 1.96 * offset.sd
    return (
        loss * math.exp(-math.hypot(math.log(loss / lo), z)),
        loss * math.exp(math.hypot(math.log(hi / loss), z)),
    )
