"""The Prefect flows: `pipeline` (tokenize → sweep → fit → pretrain at the compute-optimal size → SFT/LoRA →
evaluate → register) and one flow per stage. Tasks are one-line wrappers around the `run_<stage>` functions;
every stage output is content-addressed, so a rerun skips finished stages and a killed run resumes.

MLflow: one parent run per pipeline run, every stage nested under it (sweep trials under the sweep), tagged
with the Prefect flow-run id. Each stage publishes a Prefect markdown artifact with its headline numbers.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq
from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field, model_validator

from flows.recipe import Recipe, load_recipe, validate_recipe
from flows.stage_report import publish

TRANSIENT = (ConnectionError, TimeoutError, OSError)


def transient(task_: Any, task_run: Any, state: Any) -> bool:
    """Retry network-ish failures (an MLflow server restart, a Ray hiccup), never bad input."""
    try:
        state.result()
    except TRANSIENT as error:
        return not isinstance(error, FileNotFoundError | PermissionError)
    except Exception:
        return False
    return False


def stage(fn: Any) -> Any:
    return task(
        fn, retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=transient, cache_policy=NO_CACHE
    )


class RecipeParams(BaseModel):
    """A recipe and its overrides; validated (the recipe is loaded) before any work starts."""

    recipe: str = Field(
        "demo", title="Recipe", description="name in configs/ (smoke, demo, ...) or a YAML path"
    )
    overrides: list[str] = Field(default_factory=list, title="Overrides", description="a.b=value, as --set")

    @model_validator(mode="after")
    def _loads(self) -> RecipeParams:
        load_recipe(self.recipe, self.overrides)  # raises ConfigError (a ValueError) naming the field
        return self

    def load(self) -> Recipe:
        return load_recipe(self.recipe, self.overrides)


class PipelineParams(RecipeParams):
    size: Literal["fit", "recipe"] = Field(
        "fit",
        title="Model size",
        description="fit: the scaling fit picks it for the budget; recipe: the recipe's model",
    )
    budget: float | None = Field(
        None, gt=0, title="Compute budget (FLOPs)", description="default: sweep.target_budget"
    )
    finetune: bool = Field(True, title="Fine-tune", description="run SFT (finetune.method: lora or full)")
    register_model: bool = Field(
        True, title="Register", description="log the final model to the MLflow registry"
    )


def every_tenth(total: int, name: str) -> Any:
    """A training progress callback that prints (into the Prefect log) at every tenth of the run."""
    mark = max(1, total // 10)

    def report(step: int, loss: float, tokens_per_s: float) -> None:
        if step % mark == 0 or step == total:
            print(f"{name} step {step}/{total}: loss {loss:.4f}, {tokens_per_s:,.0f} tokens/s")

    return report


# ---- tasks: one line each ------------------------------------------------------------------------------


@stage
def tokenize(recipe: Recipe) -> Any:
    from data_pipeline.tokenize import run_tokenize

    return run_tokenize(recipe.data, recipe.output_dir)


@stage
def sweep(recipe: Recipe, data: Any) -> Any:
    from training.sweep import run_sweep

    def report(done: int, total: int, row: dict[str, Any]) -> None:
        loss = f", val loss {row['loss']:.4f}" if row.get("loss") is not None else ""
        print(
            f"sweep trial {done}/{total}: depth {row.get('depth')} C={row.get('budget', 0):.3g} {row.get('status')}{loss}"
        )

    return run_sweep(recipe, data, progress=report)


@stage
def fit(recipe: Recipe, sweep_result: Any) -> Any:
    from flows.scaling import fit_sweep

    return fit_sweep(recipe, sweep_result)


@stage
def pretrain(recipe: Recipe, data: Any) -> Any:
    from training.pretrain import run_pretrain

    return run_pretrain(recipe, data, progress=every_tenth(recipe.train.max_steps, "pretrain"))


@stage
def sft_data(recipe: Recipe, base: Any) -> Any:
    from data_pipeline.sft import run_sft_data
    from data_pipeline.tokenizer import describe

    return run_sft_data(
        recipe.data.sft, describe(Path(base.hf_export)), recipe.finetune.train.seq_len, recipe.output_dir
    )


@stage
def finetune(recipe: Recipe, base: Any, data: Any) -> Any:
    from training.finetune import run_sft

    return run_sft(recipe, base, data, progress=every_tenth(recipe.finetune.train.max_steps, "finetune"))


@stage
def evaluate(recipe: Recipe, models: list[Any], sft_heldout: str | None) -> Any:
    from evaluation.report import run_eval

    return run_eval(recipe, models, sft_heldout=sft_heldout)


@stage
def register(recipe: Recipe, ref: Any, report: Any, base_name: str | None) -> Any:
    from flows.registration import register_final

    return register_final(recipe, ref, report, base_name)


# ---- flows ---------------------------------------------------------------------------------------------


def timed(timings: dict[str, float], name: str, call: Any, *args: Any) -> Any:
    t0 = time.perf_counter()
    result = call(*args)
    timings[name] = time.perf_counter() - t0
    return result


@flow(name="pipeline", log_prints=True)
def pipeline(params: PipelineParams) -> dict[str, Any]:
    """Raw text to an evaluated, registered model: the whole DAG on one recipe."""
    from flows.lineage import finish_parent, log_dataset, nest_under, start_parent
    from flows.scaling import size_for_budget, target_budget

    t_start = time.perf_counter()
    recipe = params.load()
    parent = start_parent(recipe, params)
    recipe = nest_under(recipe, parent)
    times: dict[str, float] = {}
    summary: dict[str, Any] = {"mlflow_parent_run": parent}
    try:
        data = timed(times, "tokenize", tokenize, recipe)
        log_dataset(recipe, parent, data)
        publish(
            "tokenize",
            recipe,
            {
                "tokens (train)": data.splits["train"].n_tokens,
                "tokens (val)": data.splits["val"].n_tokens,
                "directory": data.path,
            },
        )
        final = recipe
        if params.size == "fit":
            swept = timed(times, "sweep", sweep, recipe, data)
            publish(
                "sweep",
                recipe,
                {"trials": swept.n_trials, "completed": swept.n_completed, "results": swept.results},
                swept.mlflow_run_id,
            )
            law = timed(times, "fit", fit, recipe, swept)
            budget = params.budget or target_budget(recipe)
            sizes = [row["N"] for row in pq.read_table(swept.results, columns=["N"]).to_pylist()]
            final, note = size_for_budget(
                recipe, float(law.to_law().optimal_n(budget)), budget, (min(sizes), max(sizes))
            )
            final = validate_recipe({**final.model_dump(mode="json"), "name": f"{recipe.name}-optimal"})
            summary |= {"law": law.law, "intervals": law.intervals, "chosen": note}
            publish(
                "fit",
                recipe,
                {**{k: round(v, 4) for k, v in law.law.items()}, "chosen size": note},
                swept.mlflow_run_id,
            )
        base = timed(times, "pretrain", pretrain, final, data)
        publish(
            "pretrain",
            recipe,
            {"val loss": base.final_val_loss, "steps": base.step, "export verified": base.export_valid},
            base.mlflow_run_id,
        )
        models, heldout = [base], None
        if params.finetune:
            examples = timed(times, "sft_data", sft_data, final, base)
            tuned = timed(times, "finetune", finetune, final, base, examples)
            publish("finetune", recipe, tuned.summary, tuned.mlflow_run_id)
            models.append(tuned)
            heldout = str(Path(examples.path) / "heldout.jsonl")
        report = timed(times, "evaluate", evaluate, final, models, heldout)
        publish("evaluate", recipe, _eval_headline(report), report.mlflow_run_id)
        summary |= {"eval": _eval_headline(report), "report": str(Path(report.out_dir) / "report.md")}
        if params.register_model:
            version = timed(
                times,
                "register",
                register,
                final,
                models[-1],
                report,
                list(report.models)[0] if len(models) > 1 else None,
            )
            summary["registered"] = version.model_dump()
            publish(
                "register",
                recipe,
                {"model": version.name, "version": version.version, "alias": version.alias, **version.gates},
            )
    except BaseException:
        finish_parent(recipe, parent, "FAILED", {})
        raise
    wall = time.perf_counter() - t_start
    summary |= {
        "stage_seconds": times,
        "wall_seconds": wall,
        "orchestration_overhead": (wall - sum(times.values())) / wall,
    }
    finish_parent(recipe, parent, "FINISHED", summary)
    return summary


def _eval_headline(report: Any) -> dict[str, Any]:
    keep = (
        "heldout/all/bits_per_byte",
        "heldout/all/loss",
        "stdlib-import-mc/acc",
        "sft-heldout-em/exact_match",
        "sft-heldout-em/response_loss",
    )
    return {m: report.metrics[m] for m in keep if m in report.metrics}


# ---- per-stage flows (each also a deployment) ----------------------------------------------------------


class FinetuneParams(RecipeParams):
    base: str | None = Field(
        None, title="Base run", description="a pretraining run directory (default: this recipe's)"
    )


class EvalParams(RecipeParams):
    runs: list[str] = Field(
        default_factory=list, title="Runs", description="finished run directories to compare"
    )


@flow(name="tokenize")
def tokenize_flow(params: RecipeParams) -> str:
    return tokenize(params.load()).path


@flow(name="sweep")
def sweep_flow(params: RecipeParams) -> str:
    recipe = params.load()
    return sweep(recipe, tokenize(recipe)).results


@flow(name="fit_scaling")
def fit_scaling_flow(params: RecipeParams) -> dict[str, float]:
    recipe = params.load()
    return fit(recipe, sweep(recipe, tokenize(recipe))).law


@flow(name="pretrain")
def pretrain_flow(params: RecipeParams) -> str:
    recipe = params.load()
    return pretrain(recipe, tokenize(recipe)).run_dir


@flow(name="finetune")
def finetune_flow(params: FinetuneParams) -> str:
    from training.pretrain import CheckpointRef

    recipe = params.load()
    base = CheckpointRef.load(params.base) if params.base else pretrain(recipe, tokenize(recipe))
    return finetune(recipe, base, sft_data(recipe, base)).run_dir


@flow(name="evaluate")
def evaluate_flow(params: EvalParams) -> str:
    from training.pretrain import CheckpointRef

    report = evaluate(params.load(), [CheckpointRef.load(r) for r in params.runs], None)
    return str(Path(report.out_dir) / "report.md")


FLOWS = {
    "pipeline": pipeline,
    "tokenize": tokenize_flow,
    "sweep": sweep_flow,
    "fit_scaling": fit_scaling_flow,
    "pretrain": pretrain_flow,
    "finetune": finetune_flow,
    "evaluate": evaluate_flow,
}
