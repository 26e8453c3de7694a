"""Each stage's headline numbers as a Prefect markdown artifact (shown on the flow run and the Artifacts page)."""

from __future__ import annotations

import contextlib
from typing import Any

from infra.tracking import existing_run, nested_run_id


def publish(stage: str, recipe: Any, numbers: dict[str, Any], mlflow_run_id: str | None = None) -> None:
    """A markdown table of `numbers` plus the MLflow link, keyed `<recipe>-<stage>` (a valid artifact key)."""
    from prefect.artifacts import create_markdown_artifact

    from flows.lineage import RECORDED_AS

    lines = [f"### {stage}", "", *table(numbers)]
    if mlflow_run_id is None and stage in RECORDED_AS:
        mlflow_run_id = nested_run_id(recipe.tracking, recipe.output_dir, RECORDED_AS[stage])
    url = existing_run(recipe.tracking, recipe.output_dir, mlflow_run_id).url()
    if url:
        lines += ["", f"[MLflow run]({url})"]
    name = recipe.name.removesuffix(
        "-optimal"
    )  # stages after the fit run the sized recipe; one key per pipeline
    key = "".join(c if c.isalnum() else "-" for c in f"{name}-{stage}".lower()).strip("-")
    with contextlib.suppress(
        Exception
    ):  # outside a flow run (plain function use) there is nothing to attach to
        create_markdown_artifact(markdown="\n".join(lines), key=key, description=f"{stage} headline numbers")


def table(numbers: dict[str, Any]) -> list[str]:
    """Markdown rows: `name | value`, or, when every value is a {column: number} mapping (a metric per model), one
    column per key."""
    if numbers and all(isinstance(v, dict) for v in numbers.values()):
        columns = list(dict.fromkeys(c for v in numbers.values() for c in v))
        rows = [f"| | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|"]
        return rows + [
            f"| {k} | {' | '.join(_fmt(v.get(c, '')) for c in columns)} |" for k, v in numbers.items()
        ]
    return ["| | |", "|---|---|", *(f"| {k} | {_fmt(v)} |" for k, v in numbers.items())]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value)
