"""Each stage's headline numbers as a Prefect markdown artifact (shown on the flow run and the Artifacts page)."""

from __future__ import annotations

import contextlib
from typing import Any

from infra.tracking import existing_run


def publish(stage: str, recipe: Any, numbers: dict[str, Any], mlflow_run_id: str | None = None) -> None:
    """A markdown table of `numbers` plus the MLflow link, keyed `<recipe>-<stage>` (a valid artifact key)."""
    from prefect.artifacts import create_markdown_artifact

    lines = [f"### {stage}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in numbers.items()]
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


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
