"""The comparison plot: each variant's compute-optimal loss L*(C) with its bootstrap band and its sweep points,
and the multiplier read off at the reference budget."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from evaluation.compute_multiplier import Comparison, optimal_loss, resampled_laws  # noqa: E402
from evaluation.scaling_data import ScalingPoints  # noqa: E402


def compare_plot(
    comparison: Comparison, points: tuple[ScalingPoints, ScalingPoints], names: tuple[str, str], path: Path
) -> Path:
    """Loss (nats/token) against training FLOPs, log-log in C; the multiplier as an arrow at B's loss."""
    c_lo = min(float(p.c.min()) for p in points) / 2
    c_hi = max(comparison.c_ref * 4, comparison.c_ref * min(comparison.multiplier, 64) * 1.5)
    grid = np.geomspace(c_lo, c_hi, 120)
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    laws = (comparison.law_a, comparison.law_b)
    boots = (comparison.boot_a, comparison.boot_b)
    for color, name, law, boot, pts in zip(
        ("tab:blue", "tab:orange"), names, laws, boots, points, strict=True
    ):
        curves = np.array([optimal_loss(law_, grid) for law_ in resampled_laws(boot)])
        if len(curves):  # none when every resample's fit ran off (a ladder too small for the law)
            lo, hi = np.nanpercentile(curves, [2.5, 97.5], axis=0)
            ax.fill_between(grid, lo, hi, color=color, alpha=0.15, label=f"{name}: 95% bootstrap band")
        ax.plot(grid, optimal_loss(law, grid), color=color, label=f"{name}: L*(C) of its fitted law")
        ax.scatter(pts.c, pts.loss, color=color, s=12, alpha=0.5, label=f"{name}: sweep runs")
    target = float(optimal_loss(comparison.law_b, comparison.c_ref))
    ax.axhline(target, color="grey", ls=":", lw=1)
    c_a = comparison.c_ref * comparison.multiplier
    if np.isfinite(c_a):
        ax.annotate(
            "",
            xy=(c_a, target),
            xytext=(comparison.c_ref, target),
            arrowprops={"arrowstyle": "->", "color": "black"},
        )
    low, high = comparison.interval
    ax.set_title(
        f"{names[0]} needs {comparison.multiplier:.2f}x [{low:.2f}, {high:.2f}] the compute of {names[1]}\n"
        f"for {names[1]}'s loss at C = {comparison.c_ref:.2g} FLOPs",
        fontsize=9,
    )
    ax.set_xscale("log")
    ax.set_xlabel("training compute C (FLOPs)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
