"""Scaling-law plots (PNG): IsoFLOP curves with parabolas, loss contours with the compute-optimal frontier,
and residuals of the Approach 3 fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from evaluation.chinchilla_fit import Law  # noqa: E402
from evaluation.isoflop import IsoFlopFit  # noqa: E402
from evaluation.scaling_data import ScalingPoints  # noqa: E402


def write_plots(
    points: ScalingPoints, law: Law, iso: IsoFlopFit | None, optimal: Any, out: Path
) -> list[Path]:
    paths = [out / "isoflop.png", out / "contours.png", out / "residuals.png"]
    _isoflop(points, law, iso, paths[0])
    _contours(points, law, iso, optimal, paths[1])
    _residuals(points, law, paths[2])
    return paths


def _isoflop(points: ScalingPoints, law: Law, iso: IsoFlopFit | None, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = points.budgets()
    budgets = np.unique(labels)
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(budgets)))
    for budget, colour in zip(budgets, colours, strict=True):
        group = labels == budget
        ax.scatter(points.n[group], points.loss[group], s=12, color=colour)
        n = np.geomspace(points.n[group].min() / 1.5, points.n[group].max() * 1.5, 100)
        ax.plot(n, law.loss(n, budget / (6 * n)), color=colour, lw=0.8, ls=":")
    for p in iso.parabolas if iso else []:
        group = np.isclose(labels, p.budget)
        n = np.geomspace(points.n[group].min(), points.n[group].max(), 100)
        ax.plot(n, p.loss(n), color="k", lw=1)
        ax.plot(p.n_opt, p.loss_opt, "k*", ms=8)
    ax.set(
        xscale="log",
        xlabel="parameters N",
        ylabel="final loss",
        title="IsoFLOP runs: Approach 3 (dotted), parabolas (black)",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _contours(points: ScalingPoints, law: Law, iso: IsoFlopFit | None, optimal: Any, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    c_lo, c_hi = points.c.min() / 3, max(points.c.max(), optimal.budget) * 3
    n_lo, n_hi = points.n.min() / 3, max(points.n.max(), optimal.n_opt) * 3
    c, n = np.meshgrid(np.geomspace(c_lo, c_hi, 200), np.geomspace(n_lo, n_hi, 200))
    levels = np.quantile(law.loss(n, c / (6 * n)), np.linspace(0.02, 0.9, 14))
    cs = ax.contour(
        c, n, law.loss(n, c / (6 * n)), levels=np.unique(levels), cmap="viridis_r", linewidths=0.8
    )
    ax.clabel(cs, fontsize=7, fmt="%.2f")
    ax.scatter(points.c, points.n, c=points.loss, s=8, cmap="viridis_r")
    frontier = np.geomspace(c_lo, c_hi, 50)
    ax.plot(frontier, law.optimal_n(frontier), "r-", lw=1.5, label=f"Approach 3: N* ∝ C^{law.a:.3f}")
    if iso and iso.n_opt:
        ax.plot(
            frontier,
            iso.n_opt(frontier),
            "k--",
            lw=1,
            label=f"Approach 2: N_opt ∝ C^{iso.n_opt.exponent:.3f}",
        )
    ax.plot(
        optimal.budget,
        optimal.n_opt,
        "r*",
        ms=12,
        label=f"target C={optimal.budget:.2g}: N*={optimal.n_opt:.3g}",
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="compute C (FLOPs)",
        ylabel="parameters N",
        title="Fitted loss L(N, C/6N)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _residuals(points: ScalingPoints, law: Law, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    resid = np.log(law.loss(points.n, points.d)) - np.log(points.loss)
    ax.scatter(points.c, resid, c=np.log(points.n), s=10, cmap="plasma")
    ax.axhline(0, color="k", lw=0.8)
    ax.set(
        xscale="log",
        xlabel="compute C (FLOPs)",
        ylabel="log predicted − log observed",
        title="Approach 3 residuals (colour: log N)",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
