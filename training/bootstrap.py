"""The interval of a mean whose values come in correlated groups (a run's points, a prompt's completions): whole
groups resampled with replacement (the cluster bootstrap), so what a group's values share counts once."""

from __future__ import annotations

import numpy as np


def mean_interval(
    values: np.ndarray, groups: np.ndarray, level: float = 0.95, n_resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """The `level` percentile interval of the mean of `values` over resamples of their `groups` (labels, one per
    value); deterministic per seed."""
    labels, index = np.unique(groups, return_inverse=True)
    sums = np.bincount(index, weights=np.asarray(values, dtype=float), minlength=len(labels))
    counts = np.bincount(index, minlength=len(labels))
    draws = np.random.default_rng(seed).integers(0, len(labels), (n_resamples, len(labels)))
    means = sums[draws].sum(1) / counts[draws].sum(1)
    lo, hi = np.percentile(means, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)
