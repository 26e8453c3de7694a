"""The Prefect flows: `pipeline` (tokenize → sweep → fit → pretrain at the compute-optimal size → SFT/LoRA →
[DPO, distillation] → evaluate → register → [compress → frontier → register the smallest good variant]) and one flow per stage. The DAG itself lives in `flows/stages.py`; here each stage call
becomes a Prefect task (retries on transient errors), and every stage publishes a markdown artifact.

MLflow: one parent run per pipeline run, every stage nested under it (sweep trials under the sweep), tagged
with the Prefect flow-run id.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flows import stages
from flows.recipe import Recipe, load_recipe
from flows.runner import Direct
from flows.stage_report import publish

T = TypeVar("T")
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


class PrefectRunner(Direct):
    """Each stage call is a Prefect task run (progress prints into the flow's log); headlines become artifacts."""

    def __call__(self, name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        wrapped = task(
            fn,
            name=name,
            retries=2,
            retry_delay_seconds=[5, 30],
            retry_condition_fn=transient,
            cache_policy=NO_CACHE,
        )
        return wrapped(*args, **kwargs)

    def publish(self, stage: str, recipe: Recipe, numbers: dict[str, Any], run_id: str | None = None) -> None:
        publish(stage, recipe, numbers, run_id)


class RecipeParams(BaseModel):
    """A recipe and its overrides; validated (the recipe is loaded) before any work starts."""

    model_config = ConfigDict(extra="forbid")

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
    dpo: bool = Field(
        False,
        title="Preference-tune (DPO)",
        description="DPO on preference pairs after fine-tuning (dpo.loss: sigmoid, ipo, hinge, sigmoid_norm); "
        "the registry then gates the DPO model against the fine-tuned one",
    )
    distill: bool = Field(
        False,
        title="Distil a student",
        description="distil the pretrained model into a smaller student (distill.student) and train the same "
        "student from scratch on the same tokens, side by side in the report",
    )
    compress: bool = Field(
        False,
        title="Compress",
        description="quantize (torchao int8/int4, GPTQ), factorise and prune the final model (compress.variants), "
        "evaluate every variant and register the smallest within compress.tolerance under compress.alias",
    )
    register_model: bool = Field(
        True, title="Register", description="log the final model to the MLflow registry"
    )

    @model_validator(mode="after")
    def _layout(self) -> PipelineParams:
        stages.check_pipeline(self.load(), self.options())
        return self

    def options(self) -> stages.PipelineOptions:
        return stages.PipelineOptions(
            size=self.size,
            budget=self.budget,
            finetune=self.finetune,
            dpo=self.dpo,
            distill=self.distill,
            compress=self.compress,
            register_model=self.register_model,
        )


@flow(name="pipeline", log_prints=True)
def pipeline(params: PipelineParams) -> dict[str, Any]:
    """Raw text to an evaluated, registered model: the whole DAG on one recipe."""
    from flows.lineage import finish_parent, log_dataset, nest_under, start_parent

    t_start = time.perf_counter()
    recipe = params.load()
    parent = start_parent(recipe, params)
    recipe = nest_under(recipe, parent)
    runner = PrefectRunner()
    try:
        summary = stages.pipeline(
            recipe, params.options(), runner, on_data=lambda data: log_dataset(recipe, parent, data)
        )
    except BaseException:
        finish_parent(parent, "FAILED", {})
        raise
    wall = time.perf_counter() - t_start
    summary |= {
        "mlflow_parent_run": parent.run_id,
        "wall_seconds": wall,
        "orchestration_overhead": (wall - sum(summary["stage_seconds"].values())) / wall,
    }
    finish_parent(parent, "FINISHED", summary)
    return summary


# ---- per-stage flows (each also a deployment) ----------------------------------------------------------


class FinetuneParams(RecipeParams):
    base: str | None = Field(
        None, title="Base run", description="a pretraining run directory (default: this recipe's)"
    )


class DPOParams(RecipeParams):
    base: str | None = Field(
        None,
        title="Base run",
        description="a fine-tuned (or pretrained) run directory to start from and compare against (default: "
        "this recipe's fine-tuned model)",
    )


class DistillParams(RecipeParams):
    teacher: str | None = Field(
        None,
        title="Teacher",
        description="an lmforge run directory or a Hugging Face export with the same tokenizer (default: this "
        "recipe's pretrained model)",
    )


class CompressParams(RecipeParams):
    base: str | None = Field(
        None,
        title="Model run",
        description="a finished run directory to compress (default: this recipe's fine-tuned model)",
    )


class CompareParams(BaseModel):
    """Two variants of an IsoFLOP ladder: recipe A and recipe B, each with its own overrides."""

    model_config = ConfigDict(extra="forbid")

    a: RecipeParams = Field(
        default_factory=RecipeParams, title="Variant A", description="recipe and overrides"
    )
    b: RecipeParams = Field(
        default_factory=RecipeParams, title="Variant B", description="recipe and overrides"
    )
    names: tuple[str, str] = Field(("a", "b"), title="Names", description="the two variants' names")
    budget: float | None = Field(
        None, gt=0, title="Reference budget (FLOPs)", description="default: largest swept by both"
    )


class EvalParams(RecipeParams):
    runs: list[str] = Field(
        default_factory=list, title="Runs", description="finished run directories to compare"
    )


@flow(name="tokenize")
def tokenize_flow(params: RecipeParams) -> str:
    return PrefectRunner()("tokenize", stages.tokens, params.load()).path


@flow(name="sweep")
def sweep_flow(params: RecipeParams) -> str:
    return stages.swept(params.load(), PrefectRunner()).results


@flow(name="fit_scaling")
def fit_scaling_flow(params: RecipeParams) -> dict[str, float]:
    recipe, runner = params.load(), PrefectRunner()
    data = runner("tokenize", stages.tokens, recipe)
    return runner("fit", stages.fit, recipe, stages.swept(recipe, runner), data).law


@flow(name="pretrain")
def pretrain_flow(params: RecipeParams) -> str:
    return stages.pretrained(params.load(), PrefectRunner()).path


@flow(name="finetune")
def finetune_flow(params: FinetuneParams) -> str:
    base = stages.load_model(params.base) if params.base else None
    return stages.finetuned(params.load(), PrefectRunner(), base)[0].path


@flow(name="dpo")
def dpo_flow(params: DPOParams) -> str:
    base = stages.load_model(params.base) if params.base else None
    return stages.preference_tuned(params.load(), PrefectRunner(), base)[0].path


@flow(name="distill")
def distill_flow(params: DistillParams) -> str:
    teacher = stages.load_teacher(params.teacher) if params.teacher else None
    return stages.distilled(params.load(), PrefectRunner(), teacher)[0].path


@flow(name="compress")
def compress_flow(params: CompressParams) -> str:
    """Compressed variants of a model and their size-quality frontier (frontier.md, frontier.png)."""
    base = stages.load_model(params.base) if params.base else None
    recipe, runner = params.load(), PrefectRunner()
    _, front = stages.compressed(recipe, runner, base)
    runner.publish("compress", recipe, stages.frontier_headline(front), front.mlflow_run_id)
    return str(Path(front.path) / "frontier.md")


@flow(name="compare")
def compare_flow(params: CompareParams) -> str:
    """The compute multiplier of variant A relative to B (comparison.md, compare.png)."""
    from flows.compare import run_compare

    summary = run_compare(params.a.load(), params.b.load(), params.names, PrefectRunner(), params.budget)
    return str(Path(summary["path"]) / "comparison.md")


@flow(name="evaluate")
def evaluate_flow(params: EvalParams) -> str:
    models = [stages.load_model(run) for run in params.runs]
    report = PrefectRunner()("evaluate", stages.evaluate, params.load(), models)
    return str(Path(report.path) / "report.md")


FLOWS = {
    "pipeline": pipeline,
    "tokenize": tokenize_flow,
    "sweep": sweep_flow,
    "fit_scaling": fit_scaling_flow,
    "pretrain": pretrain_flow,
    "finetune": finetune_flow,
    "dpo": dpo_flow,
    "distill": distill_flow,
    "compress": compress_flow,
    "compare": compare_flow,
    "evaluate": evaluate_flow,
}
