"""Stage 5: `run_eval(spec, models) -> EvalReport`, several models side by side (base vs SFT vs LoRA).

Held-out loss / perplexity / bits per byte per source, downstream tasks (built-in and JSONL), optional
lm-evaluation-harness tasks, greedy and sampled continuations, weight spectra, MoE expert load; written as
report.json + report.md + plots into a content-addressed directory and logged to its own MLflow run.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from data_pipeline.preference import Pair, read_heldout_pairs
from data_pipeline.sources import Corpus
from evaluation.config import GAIN_LOW, EvalConfig, EvalSpec
from evaluation.favor_error import favor_error
from evaluation.heldout import heldout_documents, heldout_metrics
from evaluation.model_io import EvalModel, load_for_eval
from evaluation.preference_eval import preference_metrics
from evaluation.scoring import generate_text
from evaluation.spectra import expert_load, load_imbalance, lora_spectra, weight_spectra
from evaluation.tasks import Task, load_task, run_task, sft_heldout_task, stdlib_import_task
from infra.steps import Artifact, Step, run_step
from infra.storage import atomic_write_bytes, atomic_write_json, sha256_file
from infra.tracking import tracked_run
from training.stages.lifecycle import TrainedModel

EVAL_VERSION = 3  # 3: each model's base_run_dir


class EvalReport(Artifact):
    """One table (metric -> model -> value) plus samples, spectra summaries; `path` is the report directory."""

    models: dict[str, dict[str, Any]]  # name -> run_dir, kind, export verification, parameters
    metrics: dict[str, dict[str, float | None]]
    samples: dict[str, list[dict[str, str]]]
    spectra: dict[str, dict[str, Any]]
    mlflow_run_id: str | None

    @property
    def out_dir(self) -> str:
        return self.path

    def value(self, metric: str, model: str) -> float | None:
        return self.metrics.get(metric, {}).get(model)

    def column(self, run_dir: str | None) -> str | None:
        """The name of the model scored from `run_dir`, if the report scored it."""
        return next(
            (name for name, info in self.models.items() if run_dir and info["run_dir"] == run_dir), None
        )


def build_tasks(cfg: EvalConfig, sft_heldout: str | Path | None) -> list[Task]:
    tasks: list[Task] = []
    for spec in cfg.tasks:
        if spec == "builtin":
            tasks.append(stdlib_import_task(cfg.builtin_questions, seed=cfg.seed))
            if sft_heldout is not None:
                tasks.append(sft_heldout_task(sft_heldout, cfg.builtin_questions))
        else:
            tasks.append(load_task(spec))
    return tasks


def evaluate_model(
    em: EvalModel, cfg: EvalConfig, docs: list, tasks: list[Task], pairs: list[Pair] | None = None
) -> tuple[dict[str, float], list, dict]:
    """Every metric, the samples and the spectra summary of one model."""
    metrics: dict[str, float] = {}
    t0 = time.perf_counter()
    held = heldout_metrics(em, docs, cfg.batch_size)
    metrics["eval/tokens_per_s"] = held["all"]["tokens"] / (time.perf_counter() - t0)
    for source, values in held.items():
        for key in ("loss", "perplexity", "bits_per_byte", "tokens", "bytes"):
            metrics[f"heldout/{source}/{key}"] = values[key]
    for task in tasks:
        for key, value in run_task(em, task, cfg.batch_size, cfg.max_new_tokens).items():
            metrics[f"{task.name}/{key}"] = value
    if pairs:
        for key, value in preference_metrics(em, pairs, cfg.batch_size).items():
            metrics[f"preference-heldout/{key}"] = value
    if cfg.lm_eval_tasks:
        from evaluation.lm_eval_adapter import run_lm_eval

        for task, values in run_lm_eval(
            em, cfg.lm_eval_tasks, cfg.lm_eval_include, cfg.lm_eval_limit, cfg.batch_size
        ).items():
            for key, value in values.items():
                metrics[f"lm_eval/{task}/{key}"] = value
    samples = []
    for i, prompt in enumerate(cfg.prompts):
        ids = em.tokenizer.encode(prompt).ids or [em.tokenizer_ref.eos_id]
        greedy, _ = generate_text(em.model, ids, cfg.max_new_tokens, em.tokenizer_ref.eos_id)
        sampled, _ = generate_text(
            em.model, ids, cfg.max_new_tokens, em.tokenizer_ref.eos_id, cfg.temperature, cfg.seed + i
        )
        samples.append(
            {"prompt": prompt, "greedy": em.tokenizer.decode(greedy), "sampled": em.tokenizer.decode(sampled)}
        )
    spectra: dict[str, Any] = {}
    if cfg.spectra:
        weights = weight_spectra(em.model)
        spectra["weights"] = {
            k: {"effective_rank": v["effective_rank"], "shape": v["shape"]} for k, v in weights.items()
        }
        spectra["singular_values"] = {
            k: v["singular_values"] for k, v in weights.items() if "singular_values" in v
        }
        if em.ref.adapter:
            lora = lora_spectra(em.ref.adapter)
            spectra["lora"] = lora
            metrics["lora/mean_effective_rank"] = sum(v["effective_rank"] for v in lora.values()) / len(lora)
    if cfg.favor_features and em.model.cfg.attention == "softmax":
        errors = favor_error(em.model, _doc_batches(em, docs), cfg.favor_features, seed=cfg.seed)
        spectra["favor_error"] = errors
        for m in cfg.favor_features:
            metrics[f"favor/rel_error/m{m}"] = sum(layer[m] for layer in errors.values()) / len(errors)
    if em.model.cfg.moe is not None:
        load = expert_load(em.model, _doc_batches(em, docs))
        spectra["expert_load"] = load
        for layer, shares in load.items():
            metrics[f"moe/{layer}/load_imbalance"] = load_imbalance(shares)
    return metrics, samples, spectra


def _doc_batches(em: EvalModel, docs: list, n: int = 4) -> list:
    """The first `n` held-out documents as one-row token batches (cut to the context), for routing statistics."""
    import torch

    encoded = (em.tokenizer.encode(doc.text).ids[: em.max_len] for doc in docs[:n])
    return [torch.tensor([ids]) for ids in encoded if ids]


def run_eval(
    spec: EvalSpec,
    models: list[TrainedModel],
    names: list[str] | None = None,
    sft_heldout: str | Path | None = None,
    preference_heldout: str | Path | None = None,
) -> EvalReport:
    """Evaluate `models` with the spec's settings; cached by content (the models' digests, not their paths).
    `sft_heldout` (conversations) and `preference_heldout` (pairs), JSONL, add their held-out tasks."""
    cfg = spec.eval
    names = names or [ref.kind for ref in models]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must be distinct, got {names}; pass names=[...]")
    # content, not places: the corpus by its fingerprint, task files and the SFT held-out set by their sha256
    data = spec.data
    config = {
        "eval": cfg.model_dump(mode="json", exclude={"tasks", "rl_gates"}),  # (added later: keys stay)
        "tasks": [t if t == "builtin" else sha256_file(t) for t in cfg.tasks],
        "data": data.model_dump(mode="json", include={"text_field", "max_documents", "val_fraction"}),
        "corpus": Corpus(data).fingerprint(),
        "names": names,
        "sft_heldout": sha256_file(sft_heldout) if sft_heldout else None,
    }
    if preference_heldout:  # only when given, so earlier reports keep their keys
        config["preference_heldout"] = sha256_file(preference_heldout)
    step = Step("eval", spec.name, EVAL_VERSION, config, EvalReport, dict(zip(names, models, strict=True)))
    pairs = read_heldout_pairs(preference_heldout, cfg.builtin_questions) if preference_heldout else None
    return run_step(
        spec.output_dir, step, lambda out, key: _evaluate(spec, models, names, sft_heldout, out, key, pairs)
    )


def _evaluate(
    spec: EvalSpec,
    models: list[TrainedModel],
    names: list[str],
    sft_heldout: str | Path | None,
    out: Path,
    key: str = "",
    pairs: list[Pair] | None = None,
) -> EvalReport:
    cfg = spec.eval
    loaded = [load_for_eval(ref, name) for name, ref in zip(names, models, strict=True)]  # refuse before work
    docs = heldout_documents(spec.data, cfg.max_documents)
    tasks = build_tasks(cfg, sft_heldout)
    tags = {"lmforge.stage": "eval", "lmforge.config_digest": key}
    with tracked_run(spec.tracking, spec.output_dir, f"eval-{spec.name}", tags) as run:
        tracker = run.tracker()
        tracker.log_params(
            {
                "eval": cfg.model_dump(mode="json"),
                "models": {n: r.path for n, r in zip(names, models, strict=True)},
            }
        )
        table: dict[str, dict[str, float | None]] = {}
        samples, spectra, info = {}, {}, {}
        for em in loaded:
            metrics, samples[em.name], spectra[em.name] = evaluate_model(em, cfg, docs, tasks, pairs)
            for metric, value in metrics.items():
                table.setdefault(metric, {})[em.name] = value
            info[em.name] = {
                "run_dir": em.ref.path,
                "kind": em.ref.kind,
                "base_run_dir": em.ref.base_run_dir,  # its lineage, which the registry's gates walk
                "hf_export": em.ref.hf_export,
                "export_valid": em.ref.export_valid,
                "max_abs_logit_diff": em.ref.max_abs_logit_diff,
                "parameters": sum(p.numel() for p in em.model.parameters()),
                "mlflow_run_id": em.ref.mlflow_run_id,
            }
            tracker.log_metrics({f"{em.name}/{k}": v for k, v in metrics.items() if v == v}, step=0)
        for name, metrics in rl_metrics(models, names).items():
            for metric, value in metrics.items():
                table.setdefault(metric, {})[name] = value
        report = EvalReport(
            path=str(out.resolve()),
            models=info,
            metrics=table,
            samples=samples,
            spectra=spectra,
            mlflow_run_id=run.run_id,
        )
        atomic_write_json(out / "report.json", report.model_dump(mode="json"))
        atomic_write_bytes(out / "report.md", markdown(report).encode())
        from evaluation.report_plots import write_report_plots

        for path in [out / "report.json", out / "report.md", *write_report_plots(report, out)]:
            tracker.log_artifact(path, "eval")
    return report


def rl_metrics(models: list[TrainedModel], names: list[str]) -> dict[str, dict[str, float]]:
    """By column: an RL model's held-out reward, the lower end of its gain's 95% interval (paired over the
    prompts) and KL to its base, as its stage measured them (the same held-out prompts, seed and reward functions
    for the RL model and the base), and its base's (no gain, KL 0) when it is a column too."""
    columns = {ref.path: name for name, ref in zip(names, models, strict=True)}
    out: dict[str, dict[str, float]] = {}
    for name, ref in zip(names, models, strict=True):
        if ref.kind.startswith("rl"):
            s = ref.summary
            gain = {GAIN_LOW: s[GAIN_LOW]} if GAIN_LOW in s else {}
            out[name] = {
                "rl/heldout_reward": s["rl/heldout_reward_after"],
                **gain,
                "rl/kl_to_base": s["rl/heldout_kl"],
            }
            if ref.base_run_dir in columns:
                out[columns[ref.base_run_dir]] = {
                    "rl/heldout_reward": s["rl/heldout_reward_before"],
                    **dict.fromkeys(gain, 0.0),
                    "rl/kl_to_base": 0.0,
                }
    return out


def _fmt(value: float | None) -> str:
    if value is None:
        return "–"
    if abs(value) >= 1000 or value == int(value):
        return f"{value:,.0f}"
    return f"{value:.4f}"


def markdown(report: EvalReport) -> str:
    """The report as markdown: one table with models as columns, then samples."""
    names = list(report.models)
    lines = [
        "# Evaluation report",
        "",
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for metric, values in report.metrics.items():
        lines.append(f"| {metric} | " + " | ".join(_fmt(values.get(n)) for n in names) + " |")
    lines += ["", "## Models", ""]
    for name, info in report.models.items():
        lines.append(
            f"- **{name}** ({info['kind']}, {info['parameters']:,} parameters): `{info['run_dir']}`; export verified "
            f"{info['export_valid']} (max |Δlogit| {info['max_abs_logit_diff']:.2e})"
        )
    lines += ["", "## Samples", ""]
    for name, rows in report.samples.items():
        lines.append(f"### {name}")
        for row in rows:
            lines += [
                f"- prompt `{row['prompt']!r}`",
                f"  - greedy: `{row['greedy']!r}`",
                f"  - sampled: `{row['sampled']!r}`",
            ]
    return "\n".join(lines) + "\n"
