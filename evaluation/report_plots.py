"""Evaluation plots (PNG): headline metrics per model, effective rank of every weight matrix, LoRA update spectra,
FAVOR+'s error against each softmax layer's attention by feature count."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HEADLINE = (
    "heldout/all/bits_per_byte",
    "stdlib-import-mc/acc",
    "stdlib-import-mc/acc_norm",
    "sft-heldout-em/exact_match",
    "sft-heldout-em/response_loss",
    "sft-heldout-em/stop_rate",
)


def write_report_plots(report: Any, out: Path) -> list[Path]:
    paths = [_metrics(report, out / "metrics.png"), _ranks(report, out / "effective_rank.png")]
    if any("lora" in s for s in report.spectra.values()):
        paths.append(_lora(report, out / "lora_spectra.png"))
    if any("favor_error" in s for s in report.spectra.values()):
        paths.append(_favor(report, out / "favor_error.png"))
    return [p for p in paths if p is not None]


def _metrics(report: Any, path: Path) -> Path | None:
    """One panel per headline metric: each model's change from the first model (the base, usually the pretrained
    one) in percent (the values themselves where the first is 0), its value written on the bar, and which direction
    is better (bars from 0 hid 1.81 vs 1.84)."""
    from evaluation.config import LOWER_IS_BETTER

    # a metric every model scores 0 on (exact match of a tiny model) draws an empty panel: it is in the table
    metrics = [m for m in HEADLINE if m in report.metrics and any(report.metrics[m].values())]
    if not metrics:
        return None
    names = list(report.models)
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.4 * len(metrics), 3.6), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        values = [report.metrics[metric].get(n) for n in names]
        base = values[0]
        if base:  # a percentage of the first model's value
            heights = [100.0 * (v - base) / abs(base) if v is not None else 0.0 for v in values]
            ax.set_ylabel(f"change vs {names[0]} (%)", fontsize=7)
        else:  # nothing to be a percentage of (the pretrained model's stop rate is 0): the values themselves
            heights = [v or 0.0 for v in values]
            ax.set_ylabel("value", fontsize=7)
        bars = ax.bar(names, heights, color=plt.cm.tab10(np.arange(len(names))))
        for bar, value in zip(bars, values, strict=True):
            label = "n/a" if value is None else f"{value:.4g}"
            ax.annotate(
                label,
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                fontsize=6,
                va="bottom" if bar.get_height() >= 0 else "top",
            )
        ax.axhline(0, color="black", lw=0.6)
        better = "lower" if metric.rsplit("/", 1)[-1] in LOWER_IS_BETTER else "higher"
        ax.set_title(f"{metric}\n({better} is better)", fontsize=8)
        ax.tick_params(axis="x", labelsize=7, rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ranks(report: Any, path: Path) -> Path | None:
    rows = {n: s.get("weights", {}) for n, s in report.spectra.items() if s.get("weights")}
    if not rows:
        return None
    keys = sorted(next(iter(rows.values())))
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(keys)), 3.5))
    width = 0.8 / len(rows)
    for i, (name, weights) in enumerate(rows.items()):
        ranks = [
            weights.get(k, {}).get("effective_rank", 0) / min(weights.get(k, {}).get("shape", [1])[-2:])
            for k in keys
        ]
        ax.bar(np.arange(len(keys)) + i * width, ranks, width, label=name)
    ax.set_xticks(np.arange(len(keys)) + 0.4 - width / 2, keys, rotation=90, fontsize=6)
    ax.set_ylabel("effective rank / max rank")
    ax.set_title("Effective rank of weight matrices")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, never over them
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lora(report: Any, path: Path) -> Path:
    """Every adapted module's normalised singular values (none left out), coloured by projection (the legend counts
    the modules of each) and styled by model."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    colours, styles = plt.cm.tab10.colors, ["-", "--", ":"]
    kinds: dict[str, int] = {}
    models = {name: spectra["lora"] for name, spectra in report.spectra.items() if spectra.get("lora")}
    for m, modules in enumerate(models.values()):
        for module, values in modules.items():
            kind = module.rsplit(".", 1)[-1]
            kinds[kind] = kinds.get(kind, 0) + 1
            s = np.asarray(values["singular_values"])
            colour = colours[list(kinds).index(kind) % 10]
            ax.plot(np.arange(1, len(s) + 1), s / s[0], styles[m % 3], lw=0.7, color=colour, alpha=0.8)
    handles = [
        plt.Line2D([], [], color=colours[i % 10], label=f"{k} ({n})")
        for i, (k, n) in enumerate(kinds.items())
    ]
    if len(models) > 1:
        handles += [
            plt.Line2D([], [], ls=styles[m % 3], color="black", label=n) for m, n in enumerate(models)
        ]
    ax.set(
        xlabel="index",
        ylabel="σ_i / σ_1",
        title="LoRA updates ΔW = (α/r)·B·A: singular values of every module",
        yscale="log",
    )
    ax.legend(
        handles=handles,
        fontsize=6,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        title="projection (modules)",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _favor(report: Any, path: Path) -> Path:
    """Relative error of FAVOR+ attention outputs vs exact softmax attention, per model and layer, against the
    random feature count (log-log), with an m^(-1/2) guide."""
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    styles = ["-", "--", ":", "-."]
    for i, (name, spectra) in enumerate(report.spectra.items()):
        for layer, errors in spectra.get("favor_error", {}).items():
            ms = sorted(int(m) for m in errors)
            ax.plot(
                ms,
                [errors[m] if m in errors else errors[str(m)] for m in ms],
                styles[i % 4],
                marker="o",
                label=f"{name} {layer}",
            )
    lines = ax.get_lines()
    ms = np.array(sorted({int(x) for line in lines for x in line.get_xdata()}))
    start = float(np.mean([line.get_ydata()[0] for line in lines]))
    ax.plot(ms, start * (ms / ms[0]) ** -0.5, "k:", alpha=0.5, label="∝ m^-1/2")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("random features per head, m")
    ax.set_ylabel("relative error of the attention output")
    ax.set_title("FAVOR+ on the model's own queries and keys")
    ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the curves, never over them
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
