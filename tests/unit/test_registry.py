"""The stage registry is the only list of stages: a toy stage declared here, in a test module, reaches the CLI,
the Prefect flows, the pipeline's parameters, the deployments and the summary, and its needs are resolved and
cached, without another file knowing about it. Plus the real registry's own consistency."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flows.recipe import Recipe, load_recipe
from flows.registry import STAGES, declared, enable, pick, plan, resolve
from flows.runner import Direct
from flows.stage_def import Inputs, StageDef, Toggle
from infra.steps import Artifact, Step, run_step

BUILDS: list[str] = []  # which toy steps were built (not returned from the cache)


class Count(Artifact):
    value: int


def count(recipe: Recipe, inputs: Inputs, progress: Any) -> Count:
    """A cached step: the number of the recipe's SFT steps, written to a file."""

    def build(out: Path, key: str) -> Count:
        BUILDS.append("toy_count")
        (out / "count.json").write_text(json.dumps(recipe.sft.train.max_steps))
        return Count(path=str(out), value=recipe.sft.train.max_steps)

    step = Step("toy_count", recipe.name, 1, {"steps": recipe.sft.train.max_steps}, Count)
    return run_step(recipe.output_dir, step, build)


def double(recipe: Recipe, inputs: Inputs, progress: Any) -> Count:
    def build(out: Path, key: str) -> Count:
        BUILDS.append("toy_double")
        for item in range(2):
            if progress is not None:
                progress(item, f"half {item}")
        return Count(path=str(out), value=2 * inputs["counted"].value)

    step = Step("toy_double", recipe.name, 1, {}, Count, {"counted": inputs["counted"]})
    return run_step(recipe.output_dir, step, build)


TOY_COUNT: StageDef[Count] = StageDef(
    name="toy_count", help="count the SFT steps", run=count, command=False, flow=False
)
TOY_DOUBLE: StageDef[Count] = StageDef(
    name="toy_double",
    help="twice the SFT steps, a toy",
    run=double,
    needs={"counted": "toy_count"},
    progress="items",
    total=lambda recipe, inputs: 2,
    headline=lambda c: {"doubled": c.value},
    report=lambda recipe, inputs, c: f"toy doubled {inputs['counted'].value} into {c.value}",
    outputs=lambda recipe, inputs, c: {"toy output": c.path},
    toggle=Toggle("toy_double", False, "Toy", "a toy stage declared in a test"),
)


@pytest.fixture
def toy():
    BUILDS.clear()
    with declared(TOY_COUNT, after="tokenize"), declared(TOY_DOUBLE, after="toy_count"):
        yield


def test_a_toy_stage_reaches_the_cli_and_runs_cached(toy, tmp_path: Path, capsys) -> None:
    from flows.cli import build_parser, main

    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert "toy-double" in commands and "toy-count" not in commands  # helper steps have no command
    assert "--toy-double" in commands["pipeline"]._option_string_actions
    args = ["toy-double", "smoke", "--set", f"output_dir={tmp_path}", "--set", "sft.train.max_steps=7"]
    assert main(args) == 0
    assert "toy doubled 7 into 14" in capsys.readouterr().out
    assert BUILDS == ["toy_count", "toy_double"]
    assert main(args) == 0  # both steps finished: nothing is built again
    assert BUILDS == ["toy_count", "toy_double"]
    assert len(list((tmp_path / "toy_double").iterdir())) == 1


def test_a_toy_stage_reaches_the_flows_the_form_the_deployments_and_the_summary(toy, tmp_path) -> None:
    from prefect.utilities.callables import parameter_schema

    import flows.pipeline as pipeline
    from flows.deployments import render
    from flows.registry import pipeline_stages

    assert pipeline.toy_double_flow.name == "toy_double"  # the deployment's entrypoint resolves
    assert "toy_double" in pipeline.flows() and "toy_count" not in pipeline.flows()
    form = parameter_schema(pipeline.flows()["pipeline"].fn).model_dump()["definitions"]["PipelineParams"]
    assert form["properties"]["toy_double"]["title"] == "Toy"
    assert "flows/pipeline.py:toy_double_flow" in render()
    assert "toy_double" in pipeline_stages({"toy_double": True}, "recipe")
    assert "toy_double" not in pipeline_stages({}, "recipe")  # off by default

    recipe = load_recipe("smoke", [f"output_dir={tmp_path}"])
    made = plan(["toy_double"], recipe, Direct())
    made.run()
    summary = made.summary()
    assert summary["reports"]["toy_double"] == f"toy doubled {recipe.sft.train.max_steps} into 20"
    assert summary["outputs"] == {"toy output": made.done["toy_double"].path}
    assert summary["stages"]["toy_double"] == {"doubled": 20}
    assert list(summary["stage_seconds"]) == ["toy_count", "toy_double"]  # each timed by the runner
    progress: list[str] = []

    class Recording(Direct):
        def items(self, name: str, total: int | None) -> Any:
            return lambda done, label: progress.append(f"{name} {done}/{total} {label}")

    BUILDS.clear()
    recipe = recipe.override("sft.train.max_steps=3")
    assert resolve("toy_double", recipe, Recording()).done["toy_double"].value == 6
    assert progress == ["toy_double 0/2 half 0", "toy_double 1/2 half 1"] and BUILDS == [
        "toy_count",
        "toy_double",
    ]


def test_needs_resolve_to_declared_stages_in_dag_order() -> None:
    order = list(STAGES)
    for stage in STAGES.values():
        for need in [*stage.needs.values(), *stage.wants.values()]:
            for name in (need,) if isinstance(need, str) else need:
                assert name in STAGES, f"{stage.name} needs {name}, which is not declared"
                assert order.index(name) < order.index(stage.name), f"{stage.name} is declared before {name}"
        assert stage.section is None or stage.section in Recipe.model_fields, stage.name


def test_alternatives_take_the_enabled_stage_else_the_default() -> None:
    assert pick(("dpo", "sft", "pretrain"), set()) == "sft"  # DPO is off by default, SFT on
    assert pick(("dpo", "sft", "pretrain"), {"dpo"}) == "dpo"
    assert pick(("dpo", "sft", "pretrain"), {"pretrain"}) == "pretrain"
    assert enable(["dpo"]) == {
        "dpo",
        "reference_logps",
        "preference_data",
        "sft",
        "sft_data",
        "pretrain",
        "tokenize",
    }
    # a base given by the user replaces the fine-tuned model and everything it needs
    assert enable(["dpo"], ["sft"]) == {"dpo", "reference_logps", "preference_data", "sft"}
    # a target brings the stages that share its switch (the frontier comes with compression)
    assert {"compress", "frontier"} <= enable(["compress"])
