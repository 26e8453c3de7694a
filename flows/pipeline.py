"""The Prefect flows, generated from the stage registry: `pipeline` (every enabled stage of the DAG, each a Prefect
task with retries on transient errors, each publishing a markdown artifact) and one flow per stage (`sft_flow`,
`dpo_flow`, ...; each also a deployment), plus `compare`. A stage declared in the registry gets its flow, its
deployment and its pipeline switch (a field of the UI form) from its declaration alone.

MLflow: one parent run per pipeline run, every stage nested under it (sweep trials under the sweep), tagged
with the Prefect flow-run id.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any, Literal

from prefect import Flow, flow, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from flows import registry
from flows.logs import send_to_prefect_runs, show_lmforge_logs
from flows.recipe import Recipe, load_recipe
from flows.runner import Direct
from flows.stage_def import Given, Inputs, StageDef, Toggle
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


class PrefectRunner(Direct):
    """Each stage call is a Prefect task run (progress prints into the flow's log); headlines become artifacts.
    lmforge's own log records join the runs' logs too, wherever the flow runs (the CLI, a Prefect worker)."""

    def __init__(self) -> None:
        super().__init__()
        show_lmforge_logs()
        send_to_prefect_runs()

    def call(self, stage: StageDef[Any], recipe: Recipe, inputs: Inputs) -> Any:
        wrapped = task(
            Direct.call,
            name=stage.name,
            retries=2,
            retry_delay_seconds=[5, 30],
            retry_condition_fn=transient,
            cache_policy=NO_CACHE,
        )
        return wrapped(self, stage, recipe, inputs)

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
        self.load()  # raises ConfigError (a ValueError) naming the field
        return self

    def load(self) -> Recipe:
        return load_recipe(self.recipe, self.overrides)


class PipelineBase(RecipeParams):
    """The pipeline's own parameters; `pipeline_params()` adds one switch per optional stage."""

    size: Literal["fit", "recipe"] = Field(
        "fit",
        title="Model size",
        description="fit: the scaling fit picks it for the budget; recipe: the recipe's model",
    )
    budget: float | None = Field(
        None, gt=0, title="Compute budget (FLOPs)", description="default: sweep.target_budget"
    )
    rung_multiple: float | None = Field(
        None,
        gt=0,
        title="Rung multiple",
        description="without a budget: this multiple of the largest swept budget (default sweep.rung_multiple, 3)",
    )

    @model_validator(mode="after")
    def _stages_take_the_recipe(self) -> PipelineBase:
        registry.preflight(self.load(), registry.enable(registry.pipeline_stages(self.switches(), self.size)))
        return self

    def load(self) -> Recipe:
        budget = [f"sweep.target_budget={self.budget}"] if self.budget else []
        if self.rung_multiple:  # a multiple replaces the recipe's own target budget
            budget += ["sweep.target_budget=null", f"sweep.rung_multiple={self.rung_multiple}"]
        return load_recipe(self.recipe, [*self.overrides, *budget])

    def switches(self) -> dict[str, bool]:
        return {name: getattr(self, name) for name in registry.toggles()}


def pipeline_params() -> type[PipelineBase]:
    """The pipeline's parameter model (the Prefect UI form): recipe, size, budget, and each stage's switch. One
    class per set of switches, so the flow and its callers validate against the same class."""
    return switch_model(tuple(registry.toggles().items()))


@functools.cache
def switch_model(toggles: tuple[tuple[str, Toggle], ...]) -> type[PipelineBase]:
    switches: Any = {
        name: (bool, Field(t.default, title=t.title, description=t.description)) for name, t in toggles
    }
    return create_model("PipelineParams", __base__=PipelineBase, **switches)


def stage_params(stage: StageDef[Any]) -> type[RecipeParams]:
    """A stage flow's parameters: the recipe, plus the finished run it may be given (`base`, `teacher`, `runs`)."""
    return given_model(stage.name, stage.given)


@functools.cache
def given_model(name: str, given: Given | None) -> type[RecipeParams]:
    if given is None:
        return RecipeParams
    kind: Any = list[str] if given.many else str | None
    default: Any = Field(
        default_factory=list if given.many else lambda: None,
        title=given.flag.capitalize(),
        description=given.help,
    )
    camel = "".join(part.capitalize() for part in name.split("_"))
    return create_model(f"{camel}Params", __base__=RecipeParams, **{given.flag: (kind, default)})


def run_pipeline(params: PipelineBase) -> dict[str, Any]:
    """Raw text to an evaluated, registered model: the whole DAG on one recipe."""
    from flows.lineage import finish_parent, log_dataset, nest_under, start_parent

    t_start = time.perf_counter()
    recipe = params.load()
    parent = start_parent(recipe, params)
    recipe = nest_under(recipe, parent)
    try:
        summary = registry.pipeline(
            recipe,
            params.switches(),
            params.size,
            PrefectRunner(),
            on_data=lambda data: log_dataset(recipe, parent, data),
        )
    except BaseException:
        parent.fail()
        raise
    wall = time.perf_counter() - t_start
    summary |= {
        "mlflow_parent_run": parent.run_id,
        "wall_seconds": wall,
        "orchestration_overhead": (wall - sum(summary["stage_seconds"].values())) / wall,
    }
    finish_parent(parent, "FINISHED", summary)
    return summary


def stage_flow(stage: StageDef[Any]) -> Flow[..., dict[str, Any]]:
    """The stage's flow: the stage and what it needs, each a task; returns the stage's summary."""

    def run(params: RecipeParams) -> dict[str, Any]:
        recipe = params.load()
        given = stage.given_from(params, recipe.output_dir)
        return registry.resolve(stage.name, recipe, PrefectRunner(), given).summary()

    return generated(run, f"{stage.name}_flow", stage.name, stage.help, stage_params(stage))


def generated(fn: Any, attribute: str, name: str, doc: str, params: type[BaseModel]) -> Flow[..., Any]:
    """A flow over `fn` with its parameter model set (the UI form), found as this module's `attribute` (its
    deployment's entrypoint, `flows/pipeline.py:<attribute>`)."""
    fn.__annotations__ = {"params": params, "return": dict[str, Any]}
    fn.__name__ = fn.__qualname__ = attribute
    fn.__doc__ = doc
    return flow(fn, name=name, log_prints=True)


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


@flow(name="compare")
def compare_flow(params: CompareParams) -> str:
    """The compute multiplier of variant A relative to B (comparison.md, compare.png)."""
    from flows.compare import run_compare

    summary = run_compare(params.a.load(), params.b.load(), params.names, PrefectRunner(), params.budget)
    return str(Path(summary["path"]) / "comparison.md")


def flows() -> dict[str, Flow[..., Any]]:
    """Every flow by name: the pipeline, one per stage that has one, and compare (each a deployment)."""

    def run(params: PipelineBase) -> dict[str, Any]:
        return run_pipeline(params)

    doc = "Raw text to an evaluated, registered model: the whole DAG on one recipe."
    made = {"pipeline": generated(run, "pipeline", "pipeline", doc, pipeline_params())}
    made |= {stage.name: stage_flow(stage) for stage in registry.STAGES.values() if stage.flow}
    return made | {"compare": compare_flow}


FLOWS = flows()
PipelineParams = pipeline_params()
pipeline = FLOWS["pipeline"]


def __getattr__(name: str) -> Any:
    """`<stage>_flow` for every stage's flow (the deployments' entrypoints, flows/pipeline.py:sft_flow), also for
    a stage declared after this module was imported."""
    stage = registry.STAGES.get(name.removesuffix("_flow")) if name.endswith("_flow") else None
    if stage is not None and stage.flow:
        return FLOWS.get(stage.name) or stage_flow(stage)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
