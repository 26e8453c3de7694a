"""The DAG, wired once: each stage as a plain function of the recipe, and the compositions that chain them.

The Prefect flows (`flows/pipeline.py`) and the CLI commands (`flows/cli*.py`) are two faces of these functions:
they differ only in the `Runner` (`flows/runner.py`) that calls each stage (a Prefect task with retries, or a
direct call with a progress bar) and in how headline numbers are published. Every stage is a cached step, so any composition
skips what has finished and resumes what was interrupted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict

from data_pipeline.preference import PreferenceManifest
from data_pipeline.sft import SFTManifest
from data_pipeline.shards import DatasetManifest
from evaluation.frontier import Frontier
from evaluation.report import EvalReport
from evaluation.scaling_report import ScalingFit
from flows.recipe import ConfigError, Recipe
from flows.runner import ItemProgress, Runner, StepProgress, T, TrialProgress
from infra.object_store import is_remote
from training.compress_stage import Compressed
from training.compress_stage import check as check_compress
from training.distill import Teacher
from training.preference import ReferenceLogps
from training.stage import TrainedModel
from training.sweep import SweepResult

# ---- the stages: recipe in, artifact out ----------------------------------------------------------------


def tokens(recipe: Recipe) -> DatasetManifest:
    from data_pipeline.tokenize import run_tokenize

    return run_tokenize(recipe.data, recipe.output_dir)


def sweep(recipe: Recipe, data: DatasetManifest, progress: TrialProgress | None = None) -> SweepResult:
    from training.sweep import run_sweep

    return run_sweep(recipe.sweep_spec(), data, progress=progress)


def fit(recipe: Recipe, swept: SweepResult, data: DatasetManifest, budget: float | None = None) -> ScalingFit:
    from flows.scaling import fit_sweep

    return fit_sweep(recipe, swept, data, budget)


def check(recipe: Recipe, swept: SweepResult, law: ScalingFit, rung: TrainedModel) -> ScalingFit:
    from flows.scaling import check_rung

    return check_rung(recipe, swept, law, rung)


def pretrain(recipe: Recipe, data: DatasetManifest, progress: StepProgress | None = None) -> TrainedModel:
    from training.pretrain import run_pretrain

    return run_pretrain(recipe.pretrain_spec(), data, progress=progress)


def sft_examples(recipe: Recipe, tokenizer_dir: str | Path, seq_len: int | None = None) -> SFTManifest:
    """SFT examples encoded with the given tokenizer at `seq_len` (default: the fine-tuning sequence length)."""
    from data_pipeline.sft import run_sft_data
    from data_pipeline.tokenizer import describe

    seq_len = seq_len or recipe.finetune.train.seq_len
    return run_sft_data(recipe.data.sft, describe(Path(tokenizer_dir)), seq_len, recipe.output_dir)


def exported(model: TrainedModel) -> str:
    """The run's Hugging Face export (its tokenizer files too), or one line naming the fix."""
    if not Path(model.hf_export).is_dir():
        raise ConfigError(
            f"{model.path} has no Hugging Face export (and so no tokenizer files) to start from; rerun its "
            "stage to export it"
        )
    return model.hf_export


def sft_data(recipe: Recipe, base: TrainedModel) -> SFTManifest:
    return sft_examples(recipe, exported(base))


def finetune(
    recipe: Recipe, base: TrainedModel, data: SFTManifest, progress: StepProgress | None = None
) -> TrainedModel:
    from training.finetune import run_sft

    return run_sft(recipe.sft_spec(), base, data, progress=progress)


def preference_data(recipe: Recipe, base: TrainedModel) -> PreferenceManifest:
    """Preference pairs (derived from the SFT conversations, or the user's file) encoded with the base's
    tokenizer at the preference-tuning sequence length."""
    from data_pipeline.preference import derive_pairs, read_pairs, run_preference_data
    from data_pipeline.sft import sft_examples as conversations
    from data_pipeline.tokenizer import describe

    cfg = recipe.data.preference
    if cfg.source == "derived":
        pairs = derive_pairs(conversations(recipe.data.sft), cfg.rejected, cfg.seed)
    else:
        pairs = read_pairs(Path(cfg.source))
    tokenizer = describe(Path(exported(base)))
    return run_preference_data(
        cfg, pairs[: cfg.max_pairs], tokenizer, recipe.dpo.train.seq_len, recipe.output_dir
    )


def reference_logps(recipe: Recipe, base: TrainedModel, data: PreferenceManifest) -> ReferenceLogps:
    from training.preference import run_reference_logps

    return run_reference_logps(data, base, recipe.output_dir)


def dpo(
    recipe: Recipe,
    base: TrainedModel,
    data: PreferenceManifest,
    reference: ReferenceLogps,
    progress: StepProgress | None = None,
) -> TrainedModel:
    from training.preference import run_dpo

    return run_dpo(recipe.dpo_spec(), base, data, reference, progress=progress)


def distill(
    recipe: Recipe,
    teacher: Teacher,
    data: DatasetManifest | SFTManifest,
    progress: StepProgress | None = None,
) -> TrainedModel:
    from training.distill import run_distill

    return run_distill(recipe.distill_spec(), teacher, data, progress=progress)


def student_baseline(
    recipe: Recipe, data: DatasetManifest, progress: StepProgress | None = None
) -> TrainedModel:
    """The distillation student trained from scratch on the same tokens in the same order (same seed)."""
    from training.pretrain import run_pretrain

    base = recipe.pretrain_spec()
    changes = {"name": f"{recipe.name}-student", "model": recipe.student(), "probe": None}
    spec = type(base).model_validate(
        {**dict(base), **changes, "optim": recipe.distill.optim, "train": recipe.distill.train}
    )
    return run_pretrain(spec, data, progress=progress)


def compress(
    recipe: Recipe, base: TrainedModel, data: DatasetManifest, progress: ItemProgress | None = None
) -> Compressed:
    from training.compress_stage import run_compress

    return run_compress(recipe.compress_spec(), base, data, progress=progress)


def frontier(
    recipe: Recipe,
    variants: Compressed,
    base: TrainedModel,
    sft_heldout: str | None = None,
    progress: ItemProgress | None = None,
) -> Frontier:
    from evaluation.frontier import run_frontier

    return run_frontier(recipe.frontier_spec(), variants, base, sft_heldout, progress=progress)


def evaluate(
    recipe: Recipe,
    models: list[TrainedModel],
    sft_heldout: str | None = None,
    names: list[str] | None = None,
    preference_heldout: str | None = None,
) -> EvalReport:
    from evaluation.report import run_eval

    return run_eval(
        recipe.eval_spec(), models, names, sft_heldout=sft_heldout, preference_heldout=preference_heldout
    )


def register(
    recipe: Recipe,
    ref: TrainedModel,
    report: EvalReport,
    base_name: str | None,
    law: ScalingFit | None = None,
    name: str | None = None,
) -> Any:
    from flows.registration import register_final

    return register_final(recipe, ref, report, base_name, law, name)


# ---- compositions -------------------------------------------------------------------------------------


def load_model(run_dir: str | Path) -> TrainedModel:
    """A finished, intact training run by directory; one line naming the fix when it is missing, unfinished or
    damaged. An object-store URI of a run is pulled to this node first."""
    if not is_remote(run_dir) and not Path(run_dir).is_dir():
        raise ConfigError(
            f"{run_dir}: no such run directory; give a training run's directory (outputs/<stage>/<name>-<hash>)"
        )
    return TrainedModel.load(run_dir)


def load_teacher(source: str | Path) -> Teacher:
    """A distillation teacher: a finished lmforge run directory, or a Hugging Face export directory."""
    from training.distill import teacher_from_export, teacher_from_run

    if (Path(source) / "manifest.json").is_file():
        return teacher_from_run(load_model(source))
    return teacher_from_export(source)


def pretrained(recipe: Recipe, run: Runner) -> TrainedModel:
    data = run("tokenize", tokens, recipe)
    return run("pretrain", pretrain, recipe, data, progress=run.steps("pretrain", recipe.train.max_steps))


def finetuned(
    recipe: Recipe, run: Runner, base: TrainedModel | None = None
) -> tuple[TrainedModel, SFTManifest]:
    base = base or pretrained(recipe, run)
    examples = run("sft_data", sft_data, recipe, base)
    progress = run.steps("finetune", recipe.finetune.train.max_steps)
    return run("finetune", finetune, recipe, base, examples, progress=progress), examples


def preference_tuned(
    recipe: Recipe, run: Runner, base: TrainedModel | None = None
) -> tuple[TrainedModel, PreferenceManifest]:
    """DPO from `base` (default: this recipe's fine-tuned model): pairs, reference log-probabilities, training."""
    base = base or finetuned(recipe, run)[0]
    pairs = run("preference_data", preference_data, recipe, base)
    reference = run("reference_logps", reference_logps, recipe, base, pairs)
    progress = run.steps("dpo", recipe.dpo.train.max_steps)
    return run("dpo", dpo, recipe, base, pairs, reference, progress=progress), pairs


def distilled(
    recipe: Recipe, run: Runner, teacher: Teacher | None = None, times: dict[str, float] | None = None
) -> tuple[TrainedModel, TrainedModel | None]:
    """The student distilled from `teacher` (default: this recipe's pretrained model) and, on token data with
    `distill.baseline`, the same student trained from scratch on the same tokens."""
    from training.distill import teacher_from_run

    data = run("tokenize", tokens, recipe)
    teacher = teacher or teacher_from_run(pretrained(recipe, run))
    if recipe.distill.data == "sft":
        examples: DatasetManifest | SFTManifest = run(
            "sft_data", sft_examples, recipe, teacher.path, recipe.distill.train.seq_len
        )
    else:
        examples = data
    times = {} if times is None else times
    steps = recipe.distill.train.max_steps
    progress = run.steps("distill", steps)
    student = timed(times, "distill", run, distill, recipe, teacher, examples, progress=progress)
    baseline = None
    if recipe.distill.baseline and recipe.distill.data == "tokens":
        progress = run.steps("student_baseline", steps)
        baseline = timed(times, "student_baseline", run, student_baseline, recipe, data, progress=progress)
    return student, baseline


def compressed(
    recipe: Recipe,
    run: Runner,
    base: TrainedModel | None = None,
    sft_heldout: str | None = None,
    times: dict[str, float] | None = None,
) -> tuple[Compressed, Frontier]:
    """The compressed variants of `base` (default: this recipe's fine-tuned model) and their frontier against it;
    `sft_heldout` adds the SFT held-out task to each evaluation."""
    times = {} if times is None else times
    data = run("tokenize", tokens, recipe)
    if base is None:
        base, examples = finetuned(recipe, run)
        sft_heldout = sft_heldout or str(Path(examples.path) / "heldout.jsonl")
    check_compress(
        recipe.compress_spec(), base, data
    )  # bad settings end in one line before any progress bar starts
    progress = run.items("compress", len(recipe.compress.variants))
    variants = timed(times, "compress", run, compress, recipe, base, data, progress=progress)
    progress = run.items("frontier", len(variants.variants) + 1)
    front = timed(times, "frontier", run, frontier, recipe, variants, base, sft_heldout, progress=progress)
    return variants, front


def swept(recipe: Recipe, run: Runner) -> SweepResult:
    data = run("tokenize", tokens, recipe)
    return run("sweep", sweep, recipe, data, progress=run.trials("sweep"))


class PipelineOptions(BaseModel):
    """What the pipeline does beyond the recipe (the Prefect form and `lmforge pipeline` flags)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    size: Literal["fit", "recipe"] = "fit"
    budget: float | None = None
    finetune: bool = True
    dpo: bool = False
    distill: bool = False
    compress: bool = False
    register_model: bool = True


def timed(times: dict[str, float], name: str, run: Runner, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    t0 = time.perf_counter()
    result = run(name, fn, *args, **kw)
    times[name] = time.perf_counter() - t0
    return result


def check_pipeline(recipe: Recipe, options: PipelineOptions) -> None:
    """Registration and compression need a Hugging Face layout: refuse them for linear or FAVOR+ attention."""
    if not recipe.model.has_llama_layout and (options.register_model or options.compress):
        raise ConfigError(
            f"model.attention={recipe.model.attention} has no Hugging Face layout, which registering and "
            "compressing need; run the pipeline with register_model off (--no-register) and without --compress, "
            "or use model.attention=softmax"
        )


def pipeline(
    recipe: Recipe,
    options: PipelineOptions,
    run: Runner,
    on_data: Callable[[DatasetManifest], None] | None = None,
) -> dict[str, Any]:
    """Raw text to an evaluated, registered model; returns the summary (stage times, law, eval, registry).
    `on_data` sees the token shards as soon as they exist (the pipeline flow logs them as an MLflow input)."""
    from flows.lineage import record_fit, record_register, record_tokenize
    from flows.scaling import fit_dir, size_for_budget, target_budget

    check_pipeline(recipe, options)
    times: dict[str, float] = {}
    summary: dict[str, Any] = {}
    data = timed(times, "tokenize", run, tokens, recipe)
    if on_data is not None:
        on_data(data)
    train_split, val_split = data.splits["train"], data.splits["val"]
    run.publish(
        "tokenize",
        recipe,
        {"tokens (train)": train_split.n_tokens, "tokens (val)": val_split.n_tokens, "directory": data.path},
    )
    record_tokenize(recipe, data)
    final, law = recipe, None
    if options.size == "fit":
        result = timed(times, "sweep", run, sweep, recipe, data, progress=run.trials("sweep"))
        numbers = {
            "trials": result.n_trials,
            "completed": result.n_completed,
            "points": result.n_points,
            "points per FLOP vs one run per point": round(result.points_per_flop_gain, 3),
            "results": result.results,
        }
        run.publish("sweep", recipe, numbers, result.mlflow_run_id)
        budget = options.budget or target_budget(recipe)
        law = timed(times, "fit", run, fit, recipe, result, data, budget)
        sizes = [row["N"] for row in pq.read_table(result.results, columns=["N"]).to_pylist()]
        final, note = size_for_budget(
            recipe, float(law.to_law().optimal_n(budget)), budget, (min(sizes), max(sizes))
        )
        final = final.override({"name": f"{recipe.name}-optimal"})
        summary |= {"law": law.law, "intervals": law.intervals, "chosen": note}
    progress = run.steps("pretrain", final.train.max_steps)
    base = timed(times, "pretrain", run, pretrain, final, data, progress=progress)
    outputs = {"token shards": data.path, "pretrained model": base.hf_export}
    numbers = {"val loss": base.final_val_loss, "steps": base.step, "export verified": base.export_valid}
    run.publish("pretrain", recipe, numbers, base.mlflow_run_id)
    if law is not None:
        from evaluation.scaling_report import headline

        law = timed(times, "check", run, check, recipe, result, law, base)
        summary |= {"rung": fit_headline(law), "scaling": headline(law), "fit": str(fit_dir(result, budget))}
        outputs["scaling fit"] = str(fit_dir(result, budget) / "fit.json")
        outputs["scaling plots"] = str(fit_dir(result, budget) / "*.png")
        run.publish("fit", recipe, {**summary["rung"], "chosen size": note}, result.mlflow_run_id)
        record_fit(recipe, law, fit_dir(result, budget), budget)
    models, names, heldout, pairs = [base], ["pretrain"], None, None
    candidate, against = base, None  # what the registry gates, and the report column it is gated against
    if options.finetune:
        examples = timed(times, "sft_data", run, sft_data, final, base)
        progress = run.steps("finetune", final.finetune.train.max_steps)
        tuned = timed(times, "finetune", run, finetune, final, base, examples, progress=progress)
        run.publish("finetune", recipe, tuned.summary, tuned.mlflow_run_id)
        models.append(tuned)
        names.append(tuned.kind)
        candidate, against = tuned, "pretrain"
        heldout = str(Path(examples.path) / "heldout.jsonl")
        outputs |= {
            "fine-tuned model": tuned.hf_export,
            **({"LoRA adapter": tuned.adapter} if tuned.adapter else {}),
        }
    if (
        options.dpo
    ):  # from the fine-tuned model (or the pretrained one without fine-tuning), which it is gated on
        pair_data = timed(times, "preference_data", run, preference_data, final, candidate)
        reference = timed(times, "reference_logps", run, reference_logps, final, candidate, pair_data)
        progress = run.steps("dpo", final.dpo.train.max_steps)
        tuned = timed(times, "dpo", run, dpo, final, candidate, pair_data, reference, progress=progress)
        run.publish("dpo", recipe, {**pair_data.counts, **tuned.summary}, tuned.mlflow_run_id)
        models.append(tuned)
        names.append(tuned.kind)
        candidate, against = tuned, names[-2]
        pairs = str(Path(pair_data.path) / "heldout.jsonl")
        outputs["preference-tuned model"] = tuned.hf_export
    if options.distill:
        from training.distill import teacher_from_run

        student, baseline = distilled(final, run, teacher_from_run(base), times)
        run.publish("distill", recipe, student.summary, student.mlflow_run_id)
        models.append(student)
        names.append("student-distilled")
        outputs["distilled student"] = student.hf_export
        if baseline is not None:
            models.append(baseline)
            names.append("student-scratch")
    report = timed(times, "evaluate", run, evaluate, final, models, heldout, names, pairs)
    run.publish("evaluate", recipe, eval_headline(report), report.mlflow_run_id)
    summary |= {"eval": eval_headline(report), "report": str(Path(report.path) / "report.md")}
    outputs["eval report"] = summary["report"]
    if options.register_model:
        name = names[models.index(candidate)]
        version = timed(times, "register", run, register, final, candidate, report, against, law, name)
        summary["registered"] = version.model_dump()
        numbers = {"model": version.name, "version": version.version, "alias": version.alias, **version.gates}
        run.publish("register", recipe, numbers)
        record_register(recipe, version, candidate)
    if options.compress:  # the model the registry took, compressed, and the frontier against it
        variants, front = compressed(final, run, candidate, heldout, times)
        run.publish("compress", recipe, frontier_headline(front), front.mlflow_run_id)
        summary["compress"] = frontier_headline(front)
        outputs |= {"compressed variants": variants.path, "frontier": str(Path(front.path) / "frontier.md")}
        if options.register_model and front.chosen is not None:
            from flows.registration import register_compressed

            version = timed(times, "register_compressed", run, register_compressed, final, front, variants)
            summary["registered_compressed"] = version.model_dump()
    summary |= {"stage_seconds": times, "outputs": outputs}
    return summary


def frontier_headline(front: Frontier) -> dict[str, Any]:
    """Each variant's size ratio and held-out bits-per-byte change, and the registrable one."""
    from evaluation.frontier import BPB

    numbers: dict[str, Any] = {
        row["name"]: f"{row['size_ratio']:.2f}x size, {100 * row['relative'].get(BPB, 0.0):+.2f}% bits/byte"
        for row in front.rows[1:]
    }
    return {**numbers, "chosen (within tolerance)": front.chosen or "none"}


def fit_headline(law: ScalingFit) -> dict[str, Any]:
    """The law, both approaches' N* and the rung's prediction against its measurement."""
    numbers: dict[str, Any] = {k: round(v, 4) for k, v in law.law.items()}
    numbers |= {f"{k} 95%": [round(x, 4) for x in law.intervals[k]] for k in ("alpha", "beta")}
    numbers |= {"N* (Approach 3)": round(law.optimal.n_opt), "N* (Approach 2)": law.approach2_n_opt}
    rung = law.rung
    if rung is not None:
        numbers |= {
            "rung predicted loss": round(rung.loss, 4),
            "rung 95% interval": [round(x, 4) for x in rung.interval],
            "rung measured loss": rung.measured_loss,
            "fit/rung_rel_error": rung.rel_error,
            "prediction held": rung.held,
        }
        if rung.task_loss is not None:
            numbers |= {
                "rung predicted HumanEval bits/byte": round(rung.task_loss, 4),
                "rung measured HumanEval bits/byte": rung.measured_task_loss,
                "task rel error": rung.task_rel_error,
            }
    return numbers


def eval_headline(report: EvalReport) -> dict[str, Any]:
    keep = (
        "heldout/all/bits_per_byte",
        "heldout/all/loss",
        "stdlib-import-mc/acc",
        "sft-heldout-em/exact_match",
        "sft-heldout-em/response_loss",
        "preference-heldout/accuracy",
    )
    return {m: report.metrics[m] for m in keep if m in report.metrics}
