"""frontier.png: the bytes each variant serves (and stores, hollow) against held-out bits per byte, one marker
per method, the uncompressed model as the reference point and lines, the registered variant ringed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from evaluation.config import BPB  # noqa: E402

MARKERS = {
    "int8-weight": "s",
    "int8-dynamic": "D",
    "int4": "v",
    "rtn": "^",
    "gptq": "o",
    "lowrank": "P",
    "magnitude": "X",
    "wanda": "*",
}


def write_frontier_plot(frontier: Any, path: Path) -> Path:
    reference, variants = frontier.rows[0], frontier.rows[1:]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ref_kb, ref_bpb = reference["served_bytes"] / 1024, reference["metrics"][BPB]
    ax.scatter([ref_kb], [ref_bpb], marker="H", s=160, color="black", zorder=3, label="uncompressed")
    ax.axhline(ref_bpb, color="black", lw=0.8, ls="--")
    ax.axvline(ref_kb, color="black", lw=0.8, ls=":")
    colors = plt.cm.tab10.colors
    labelled: list[tuple[float, float]] = []  # (size, bits per byte) of the labels so far
    for i, method in enumerate(dict.fromkeys(row["method"] for row in variants)):
        rows = [row for row in variants if row["method"] == method]
        colour, marker = colors[i % len(colors)], MARKERS.get(method, "o")
        for row in rows:  # lmforge's own storage (hollow) to the served export (filled)
            kb = (row["disk_bytes"] / 1024, row["served_bytes"] / 1024)
            ax.plot(kb, (row["metrics"][BPB],) * 2, color=colour, lw=0.6, zorder=1)
            ax.scatter(
                [kb[0]], [row["metrics"][BPB]], marker=marker, s=40, facecolors="none", edgecolors=colour
            )
            bpb = row["metrics"][BPB]
            # a point labelled there already (same size and quality): this label one line up
            stacked = sum(abs(x - kb[1]) <= 0.02 * kb[1] and abs(y - bpb) <= 0.005 * bpb for x, y in labelled)
            labelled.append((kb[1], bpb))
            ax.annotate(
                row["name"],
                (kb[1], row["metrics"][BPB]),
                fontsize=6,
                xytext=(3, 3 + 8 * stacked),
                textcoords="offset points",
            )
        ax.scatter(
            [row["served_bytes"] / 1024 for row in rows],
            [row["metrics"][BPB] for row in rows],
            marker=marker,
            s=60,
            color=colour,
            alpha=0.75,  # variants of one size (RTN and GPTQ at 4 bits) show through one another
            edgecolors="black",
            linewidths=0.4,
            label=method,
            zorder=2,
        )
    if frontier.chosen:
        chosen = frontier.record(frontier.chosen)
        ax.scatter(
            [chosen["served_bytes"] / 1024],
            [chosen["metrics"][BPB]],
            s=260,
            facecolors="none",
            edgecolors="red",
            linewidths=1.5,
            zorder=4,
            label=f"registered: {frontier.chosen}",
        )
    ax.set_xscale("log")  # the quantized variants sit within a factor of two of one another, far from fp32
    ax.margins(x=0.15, y=0.08)  # room for the labels of the points at the edges
    ax.set_xlabel("weights served (KiB, log scale; hollow: lmforge's own storage)")
    ax.set_ylabel("held-out bits per byte (lower is better)")
    ax.set_title("Compression frontier: size vs held-out quality")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the points, never over them
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
