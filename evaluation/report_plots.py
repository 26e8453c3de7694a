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
)


def write_report_plots(report: Any, out: Path) -> list[Path]:
    paths = [_metrics(report, out / "metrics.png"), _ranks(report, out / "effective_rank.png")]
    if any("lora" in s for s in report.spectra.values()):
        paths.append(_lora(report, out / "lora_spectra.png"))
    if any("favor_error" in s for s in report.spectra.values()):
        paths.append(_favor(report, out / "favor_error.png"))
    return [p for p in paths if p is not None]


def _metrics(report: Any, path: Path) -> Path | None:
    # a metric every model scores 0 on (exact match of a tiny model) draws an empty panel: it is in the table
    metrics = [m for m in HEADLINE if m in report.metrics and any(report.metrics[m].values())]
    if not metrics:
        return None
    names = list(report.models)
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics, strict=True):
        values = [report.metrics[metric].get(n) or 0.0 for n in names]
        ax.bar(names, values, color=plt.cm.tab10(np.arange(len(names))))
        ax.set_title(metric, fontsize=8)
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
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _lora(report: Any, path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, spectra in report.spectra.items():
        for module, values in list(spectra.get("lora", {}).items())[:12]:
            s = np.asarray(values["singular_values"])
            ax.plot(np.arange(1, len(s) + 1), s / s[0], lw=0.8, label=f"{name}: {module}")
    ax.set(
        xlabel="index", ylabel="σ_i / σ_1", title="LoRA updates ΔW = (α/r)·B·A: singular values", yscale="log"
    )
    ax.legend(fontsize=5, ncol=2)
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
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
