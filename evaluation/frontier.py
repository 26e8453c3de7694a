"""The size–quality frontier of a compressed model: `run_frontier(spec, compressed, base) -> Frontier`.

Every variant and the uncompressed reference go through the evaluation's own `evaluate_model` (held-out loss and
bits per byte, the recipe's tasks), plus greedy generation speed on this machine; each row records bytes on disk
and in memory, bits per parameter and the relative change of every metric against the reference. Written as
frontier.json, frontier.md (the table) and frontier.png, and to MLflow as a parent run with one nested run per
variant (its files as artifacts). `chosen` is the smallest variant with a verified export whose held-out loss
rose by at most the tolerance: what the registry may register under its own alias.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from data_pipeline.sources import Corpus
from data_pipeline.tokenizer import describe
from evaluation.config import BPB, LOSS, LOWER_IS_BETTER, EvalConfig, FrontierSpec
from evaluation.heldout import heldout_documents
from evaluation.model_io import EvalModel
from evaluation.report import build_tasks, evaluate_model
from evaluation.scoring import generate_text
from infra.steps import Artifact, Step, run_step
from infra.storage import atomic_write_bytes, atomic_write_json, sha256_file
from infra.tracking import tracked_run
from training.compress.variants import load_variant
from training.model.hf_interop import load_export
from training.model.transformer import Transformer
from training.stages.compress import Compressed, VariantRecord
from training.stages.lifecycle import TrainedModel

FRONTIER_VERSION = 3  # 2: served sizes, chosen by them (ties by loss); 3: no FAVOR+ errors
ROW_FIELDS = {  # what a frontier row repeats from the variant's record
    "name",
    "method",
    "settings",
    "disk_bytes",
    "served_bytes",
    "memory_bytes",
    "export_valid",
    "max_abs_logit_diff",
    "hf_export",
    "details",
}


class Frontier(Artifact):
    """One row per model (the reference first); `chosen` names the registrable variant, if any."""

    rows: list[dict[str, Any]]
    chosen: str | None
    tolerance: float
    alias: str
    mlflow_run_id: str | None

    def record(self, name: str) -> dict[str, Any]:
        return next(row for row in self.rows if row["name"] == name)


def run_frontier(
    spec: FrontierSpec,
    compressed: Compressed,
    base: TrainedModel,
    sft_heldout: str | Path | None = None,
    progress: Callable[[int, str], None] | None = None,
) -> Frontier:
    """Evaluate every variant of `compressed` (made from `base`) against the uncompressed model; cached.
    `progress(done, name)` hears each model's evaluation start."""
    # the report has the spectra and the FAVOR+ errors (an analysis of the model's attention, not of a variant's
    # quality: the table, the plot and the choice never read them); here they would repeat, ~0.4 s a variant
    cfg = spec.eval.model_copy(update={"spectra": False, "favor_features": []})
    config = {
        "eval": cfg.model_dump(mode="json", exclude={"tasks", "gates", "dpo_gates", "rl_gates"}),
        "tasks": [t if t == "builtin" else sha256_file(t) for t in cfg.tasks],
        "corpus": Corpus(spec.data).fingerprint(),
        "compress": spec.compress.model_dump(mode="json", include={"tolerance", "alias", "generate_tokens"}),
        "sft_heldout": sha256_file(sft_heldout) if sft_heldout else None,
    }
    step = Step("frontier", spec.name, FRONTIER_VERSION, config, Frontier, {"compressed": compressed})
    return run_step(
        spec.output_dir,
        step,
        lambda out, key: _frontier(spec, cfg, compressed, base, sft_heldout, out, key, progress),
    )


def generation_speed(model: Transformer, eos_id: int, tokens: int) -> float:
    """Greedy tokens per second from a one-token prompt (no early stop), best of three runs; at most as many
    tokens as the model's trained context holds after the prompt."""
    tokens = min(tokens, model.cfg.max_seq_len - 1)
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        generate_text(model, [eos_id], tokens, None)
        best = max(best, tokens / (time.perf_counter() - t0))
    return best


def load_record(record: VariantRecord) -> Transformer:
    return (
        load_export(record.hf_export) if record.method == "none" else load_variant(record.path, record.method)
    )


def _frontier(
    spec: FrontierSpec,
    cfg: EvalConfig,
    compressed: Compressed,
    base: TrainedModel,
    sft_heldout: str | Path | None,
    out: Path,
    key: str,
    progress: Callable[[int, str], None] | None,
) -> Frontier:
    tok = describe(Path(compressed.reference.hf_export))
    docs = heldout_documents(spec.data, cfg.max_documents)
    tasks = build_tasks(cfg, sft_heldout)
    tags = {"lmforge.stage": "compress", "lmforge.config_digest": key, "lmforge.base_run_dir": base.path}
    if base.mlflow_run_id:
        tags["lmforge.base_run_id"] = base.mlflow_run_id
    rows: list[dict[str, Any]] = []
    with tracked_run(spec.tracking, spec.output_dir, f"compress-{spec.name}", tags) as parent:
        parent.tracker().log_params({"calibration": compressed.calibration, "base": base.path})
        nested = spec.tracking.model_copy(update={"parent_run_id": parent.run_id})
        for i, record in enumerate((compressed.reference, *compressed.variants)):
            if progress is not None:
                progress(i, record.name)
            em = EvalModel(record.name, load_record(record), tok.load(), tok, base)
            t0 = time.perf_counter()
            metrics, samples, _ = evaluate_model(em, cfg, docs, tasks)
            row = {
                **record.model_dump(include=ROW_FIELDS),
                "build_seconds": record.seconds,
                "eval_seconds": time.perf_counter() - t0,
                "bits_per_param": 8 * record.disk_bytes / compressed.parameters,
                "generate_tokens_per_s": generation_speed(
                    em.model, tok.eos_id, spec.compress.generate_tokens
                ),
                "metrics": metrics,
                "samples": samples,
            }
            rows.append(relative_to(row, rows[0] if rows else row))
            run_tags = {**tags, "lmforge.variant": record.name, "lmforge.method": record.method}
            with tracked_run(nested, spec.output_dir, f"compress-{spec.name}-{record.name}", run_tags) as run:
                tracker = run.tracker()
                tracker.log_params({"method": record.method, **record.settings})
                tracker.log_metrics(numbers(rows[-1]), step=0)
                if record.method != "none":
                    tracker.log_artifact(record.path, "variant")
            rows[-1]["mlflow_run_id"] = run.run_id
        if progress is not None:
            progress(len(rows), "done")
        chosen = choose(rows, spec.compress.tolerance)
        frontier = Frontier(
            path=str(out.resolve()),
            rows=rows,
            chosen=chosen,
            tolerance=spec.compress.tolerance,
            alias=spec.compress.alias,
            mlflow_run_id=parent.run_id,
        )
        atomic_write_json(out / "frontier.json", frontier.model_dump(mode="json"))
        atomic_write_bytes(out / "frontier.md", markdown(frontier).encode())
        from evaluation.frontier_plot import write_frontier_plot  # deferred: matplotlib

        tracker = parent.tracker()
        for path in (
            out / "frontier.json",
            out / "frontier.md",
            write_frontier_plot(frontier, out / "frontier.png"),
        ):
            tracker.log_artifact(path, "frontier")
        tracker.log_metrics(
            {f"{row['name']}/{k}": v for row in rows for k, v in numbers(row).items()}, step=0
        )
    return frontier


def relative_to(row: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """`row` with `size_ratio` and `relative` (each metric's change over the reference's value)."""
    ref = reference["metrics"]
    relative = {
        metric: (value - ref[metric]) / abs(ref[metric])
        for metric, value in row["metrics"].items()
        if ref.get(metric) not in (None, 0) and value == value
    }
    speed = row["generate_tokens_per_s"] / reference["generate_tokens_per_s"]
    return {
        **row,
        "size_ratio": row["disk_bytes"] / reference["disk_bytes"],
        "served_ratio": row["served_bytes"] / reference["served_bytes"],
        "speed_ratio": speed,
        "relative": relative,
    }


def numbers(row: dict[str, Any]) -> dict[str, float]:
    """A row's numbers as MLflow metrics."""
    keys = (
        "disk_bytes",
        "served_bytes",
        "memory_bytes",
        "bits_per_param",
        "size_ratio",
        "served_ratio",
        "generate_tokens_per_s",
        "speed_ratio",
    )
    values = {k: float(row[k]) for k in keys}
    values |= {k: v for k, v in row["metrics"].items() if v == v}
    values |= {f"relative/{k}": v for k, v in row["relative"].items()}
    return values


def choose(rows: list[dict[str, Any]], tolerance: float) -> str | None:
    """The verified variant whose held-out loss rose by at most `tolerance` (relative) with the smallest served
    export (what the registry hands out, not lmforge's own packed file); equal sizes go to the lower loss."""
    fit = [r for r in rows[1:] if r["export_valid"] and r["relative"].get(LOSS, float("inf")) <= tolerance]
    return min(fit, key=lambda r: (r["served_bytes"], r["relative"][LOSS]))["name"] if fit else None


def _signed(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:+.1f}%"


def markdown(frontier: Frontier) -> str:
    """The frontier as a markdown table, smallest first after the reference."""
    tasks = sorted(
        {m for row in frontier.rows for m in row["metrics"] if m.endswith(("/acc", "/exact_match"))}
    )
    head = [
        "variant",
        "bytes on disk",
        "size",
        "served bytes",
        "served",
        "bits/param",
        "memory",
        "held-out loss",
        "Δ",
        "bits/byte",
        "Δ",
    ]
    head += [*tasks, "tokens/s", "export"]
    lines = [
        "# Compression frontier",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in [frontier.rows[0], *sorted(frontier.rows[1:], key=lambda r: r["disk_bytes"])]:
        m, rel = row["metrics"], row["relative"]
        cells = [
            f"**{row['name']}**" if row["name"] == frontier.chosen else row["name"],
            f"{row['disk_bytes']:,}",
            f"{row['size_ratio']:.2f}x",
            f"{row['served_bytes']:,}",
            f"{row['served_ratio']:.2f}x",
            f"{row['bits_per_param']:.1f}",
            f"{row['memory_bytes']:,}",
            f"{m[LOSS]:.4f}",
            _signed(rel.get(LOSS)) if row is not frontier.rows[0] else "",
            f"{m[BPB]:.4f}",
            _signed(rel.get(BPB)) if row is not frontier.rows[0] else "",
            *[f"{m[t]:.3f}" if t in m else "–" for t in tasks],
            f"{row['generate_tokens_per_s']:.0f}",
            "verified" if row["export_valid"] else "FAILED",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    chosen = (
        f"**{frontier.chosen}** has the smallest served export within {100 * frontier.tolerance:g}% of the "
        f"uncompressed held-out loss (registrable as `{frontier.alias}`)."
        if frontier.chosen
        else f"No variant stays within {100 * frontier.tolerance:g}% of the uncompressed held-out loss."
    )
    notes = (
        "Bytes on disk: lmforge's own storage (bit-packed codes, low-rank factors); served: the Hugging Face export "
        "the registry serves (torchao keeps sub-8-bit codes unpacked in int8 plus scales, so a 3- or 4-bit export "
        "weighs about what an int8 one does). Bits/param: the weight files' bits over the uncompressed parameter "
        "count (embeddings, norms and the head stay in full precision). Pruned variants are stored dense (zeros take space on disk and in memory); "
        "low-rank ones as factors (their Hugging Face export holds the dense product). Lower is better for "
        f"{', '.join(LOWER_IS_BETTER)}."
    )
    return "\n".join([*lines, "", chosen, "", notes]) + "\n"
