"""Scaling-law plots (PNG): IsoFLOP curves with parabolas, loss contours with the compute-optimal frontier,
and residuals of the Approach 3 fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.colors

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from evaluation.chinchilla_fit import Law  # noqa: E402
from evaluation.isoflop import IsoFlopFit  # noqa: E402
from evaluation.loss_curve import CURVE_TOLERANCE, CurveLaw, CurvePoints  # noqa: E402
from evaluation.scaling_data import ScalingPoints  # noqa: E402


def write_plots(
    points: ScalingPoints,
    law: Law,
    iso: IsoFlopFit | None,
    fit: Any,
    out: Path,
    curves: CurvePoints | None = None,
) -> list[Path]:
    """isoflop.png, contours.png, residuals.png and prediction.png for a `ScalingFit`; curve.png too when it has a
    loss-curve law and the sweep's curves are given."""
    paths = [out / "isoflop.png", out / "contours.png", out / "residuals.png", out / "prediction.png"]
    _isoflop(points, law, iso, fit, paths[0])
    _contours(points, law, iso, fit, paths[1])
    _residuals(points, law, paths[2])
    _prediction(fit, paths[3])
    if curves is not None and fit.curve_law is not None:
        paths.append(out / "curve.png")
        _curve(fit, curves, paths[-1])
    return paths


def _curve(fit: Any, curves: CurvePoints, path: Path) -> None:
    """Left: the loss-curve law against every validation point of the sweep. Right: the rung's curve as predicted
    before it trained (anchored to the point law, with the held-out runs' band and the goal), as measured, and the
    end point under other schedules."""
    law = CurveLaw(**fit.curve_law["law"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    dots = left.scatter(
        curves.tokens / 1e6,
        curves.loss,
        c=curves.n,
        s=14,
        cmap="plasma",
        norm=matplotlib.colors.LogNorm(),
        label="measured",
    )
    left.scatter(
        curves.tokens / 1e6,
        law.loss(curves.n, curves.s1, curves.annealing),
        marker="x",
        s=12,
        c="k",
        lw=0.6,
        label="law",
    )
    fig.colorbar(dots, ax=left, label="parameters N")
    left.set(
        xscale="log",
        xlabel="tokens (millions)",
        ylabel="validation loss (nats/token)",
        title=f"Loss-curve law on the sweep ({len(curves)} points, {len(curves.runs)} runs)",
    )
    left.legend(fontsize=7)
    rung = fit.rung.curve if fit.rung is not None else None
    if rung is not None:
        tokens = np.array(rung.tokens) / 1e6
        predicted = np.array(rung.loss)
        right.plot(tokens, predicted, "o-", color="tab:blue", label="predicted before training")
        if rung.band is not None:
            right.fill_between(
                tokens,
                predicted * (1 - rung.band),
                predicted * (1 + rung.band),
                color="tab:blue",
                alpha=0.12,
                label=f"±{rung.band:.1%}: 95% of held-out sweep runs' points",
            )
        for sign in (-1, 1):
            right.plot(tokens, predicted * (1 + sign * CURVE_TOLERANCE), ":", color="tab:blue", lw=0.8)
        right.plot([], [], ":", color="tab:blue", lw=0.8, label=f"±{CURVE_TOLERANCE:.1%} (the goal)")
        seen = [(t, m) for t, m in zip(tokens, rung.measured or [], strict=False) if m is not None]
        if seen:
            label = "measured" + (
                f" (max error {rung.max_rel_error:.2%})" if rung.max_rel_error is not None else ""
            )
            right.plot(*zip(*seen, strict=True), "s", color="red", label=label)
        for (name, value), marker in zip(rung.schedules.items(), "D^v<>", strict=False):
            right.plot(tokens[-1], value, marker, ls="none", mfc="none", label=f"{name}: {value:.4f}")
        if rung.curve_law_end is not None:
            end = rung.curve_law_end
            right.plot(
                tokens[-1], end, "x", color="gray", label=f"the curve law alone (unanchored): {end:.4f}"
            )
    right.set(
        xlabel="tokens (millions)",
        ylabel="validation loss (nats/token)",
        title=f"Rung at C = {fit.optimal.budget:.2g}: its validation curve",
    )
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _isoflop(points: ScalingPoints, law: Law, iso: IsoFlopFit | None, fit: Any, path: Path) -> None:
    """Per budget (one colour): the runs, Approach 2's parabola and its minimum, Approach 3's curve (dotted);
    the compute-optimal frontier; the rung's predicted and measured loss."""
    fig, ax = plt.subplots(figsize=(8, 5))
    labels = points.budgets()
    budgets = np.unique(labels)
    colours = plt.cm.viridis(np.linspace(0, 0.9, len(budgets)))
    parabolas = iso.parabolas if iso else []
    for budget, colour in zip(budgets, colours, strict=True):
        group = labels == budget
        ax.scatter(points.n[group], points.loss[group], s=18, color=colour, label=f"C = {budget:.2g} FLOPs")
        n = np.geomspace(points.n[group].min() / 1.3, points.n[group].max() * 1.3, 100)
        ax.plot(n, law.loss(n, budget / (6 * n)), color=colour, lw=0.8, ls=":")
        parabola = next((p for p in parabolas if np.isclose(p.budget, budget, rtol=1e-6)), None)
        if parabola is not None:
            ax.plot(n, parabola.loss(n), color=colour, lw=1.3)
            ax.plot(parabola.n_opt, parabola.loss_opt, "*", color=colour, ms=12, mec="k", mew=0.5)
    c = np.geomspace(budgets.min(), max(budgets.max(), fit.optimal.budget), 50)
    n_star = law.optimal_n(c)
    ax.plot(
        n_star, law.loss(n_star, c / (6 * n_star)), "k--", lw=1, label="compute-optimal frontier (Approach 3)"
    )
    rung = fit.rung
    if rung is not None:
        lo, hi = rung.check_interval
        ax.errorbar(
            rung.n,
            rung.loss,
            yerr=[[rung.loss - lo], [hi - rung.loss]],
            fmt="o",
            mfc="none",
            color="red",
            capsize=4,
            label=f"rung at C = {fit.optimal.budget:.2g}: {rung.form.capitalize()}'s prediction (95% for a run)",
        )
        if rung.measured_loss is not None:
            ax.plot(rung.n, rung.measured_loss, "rx", ms=10, mew=2, label="rung: measured")
    ax.set(
        xscale="log",
        xlabel="parameters N (" + fit.param_count + ")",
        ylabel="final validation loss (nats/token)",
        title="IsoFLOP runs: parabolas (solid, ★ = N_opt), Approach 3 (dotted)",
    )
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _prediction(fit: Any, path: Path) -> None:
    """Predicted against measured loss: the held-out largest budget(s) (law fitted without them) and the rung."""
    fig, ax = plt.subplots(figsize=(5.5, 5))
    shown: list[float] = []
    holdout = (fit.holdout or {}).get("points", [])
    if holdout:
        measured = np.array([p["measured"] for p in holdout])
        predicted = np.array([p["predicted"] for p in holdout])
        bounds = np.array([p["interval"] for p in holdout])
        err = np.abs(np.stack([predicted - bounds[:, 0], bounds[:, 1] - predicted]))
        ax.errorbar(
            measured,
            predicted,
            yerr=err,
            fmt="o",
            color="tab:blue",
            capsize=3,
            label=f"held-out budget C ≥ {fit.holdout['min_budget']:.2g}",
        )
        shown += [*measured, *bounds.ravel()]
    rung = fit.rung
    if rung is not None and rung.measured_loss is not None:
        lo, hi = rung.check_interval
        err = [[rung.loss - lo], [hi - rung.loss]]
        ax.errorbar(
            rung.measured_loss,
            rung.loss,
            yerr=err,
            fmt="s",
            color="red",
            capsize=4,
            label=f"rung at C = {fit.optimal.budget:.2g} (error {rung.rel_error:.1%})",
        )
        shown += [rung.measured_loss, lo, hi]
    if shown:
        lo, hi = min(shown), max(shown)
        pad = 0.05 * (hi - lo or 1.0)
        ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], "k-", lw=0.8, label="predicted = measured")
    ax.set(
        xlabel="measured loss (nats/token)",
        ylabel="predicted loss (nats/token), 95% interval for a run",
        title="Scaling-law predictions",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _contours(points: ScalingPoints, law: Law, iso: IsoFlopFit | None, fit: Any, path: Path) -> None:
    """Chinchilla's law's loss over (C, N) with its compute-optimal frontier, Approach 2's, and N* at the target
    budget (the chosen form's too, where another form sized the rung)."""
    optimal, param_count = fit.optimal, fit.param_count
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
    choice = fit.choice
    if choice is not None and choice.form != "chinchilla":
        lo, hi = choice.n_opt_interval
        ax.errorbar(
            optimal.budget,
            choice.n_opt,
            yerr=[[choice.n_opt - lo], [hi - choice.n_opt]],
            fmt="bD",
            capsize=4,
            label=f"{choice.form.capitalize()}'s N*={choice.n_opt:.3g} (95%), which sized the rung",
        )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="compute C (FLOPs)",
        ylabel=f"parameters N ({param_count})",
        title="Fitted loss L(N, C/6N)",
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _residuals(points: ScalingPoints, law: Law, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    resid = np.log(law.loss(points.n, points.d)) - np.log(points.loss)
    dots = ax.scatter(points.c, resid, c=points.n, s=12, cmap="plasma", norm=matplotlib.colors.LogNorm())
    for run in np.unique(points.runs):  # the horizons of one run, joined: its offset is shared
        mine = points.runs == run
        if mine.sum() > 1:
            order = np.argsort(points.c[mine])
            ax.plot(points.c[mine][order], resid[mine][order], color="grey", lw=0.5, zorder=0)
    fig.colorbar(dots, ax=ax, label="parameters N")
    ax.axhline(0, color="k", lw=0.8)
    ax.set(
        xscale="log",
        xlabel="compute C (FLOPs)",
        ylabel="log predicted − log observed",
        title="Approach 3 residuals (lines join a run's horizons)",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
