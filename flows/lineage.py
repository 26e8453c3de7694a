"""MLflow lineage of a pipeline run: the parent run, nesting every stage under it, the dataset input, the
final summary (parameters, fit, chosen size, eval headline) as an artifact."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from flows.recipe import Recipe, validate_recipe
from infra.storage import digest_of
from infra.tracking import finish_run, log_dataset_input, make_tracker, set_run_tags, start_run
from training.pretrain import git_revision


def flow_run_id() -> str:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id or "")
    except Exception:  # noqa: BLE001 - outside a flow run
        return ""


def start_parent(recipe: Recipe, params: Any) -> str | None:
    """The pipeline's parent run, tagged with config hash, git revision and the Prefect flow-run id."""
    tags = {
        "lmforge.stage": "pipeline",
        "lmforge.config_digest": recipe.digest(),
        "lmforge.git": git_revision(),
        "prefect.flow_run_id": flow_run_id(),
    }
    run_id = start_run(recipe.tracking, recipe.output_dir, f"pipeline-{recipe.name}", None, tags)
    tracker = make_tracker(recipe.tracking, recipe.output_dir, run_id, rank=0)
    tracker.log_params({"pipeline": params.model_dump(mode="json"), "recipe": recipe.model_dump(mode="json")})
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.json"
        path.write_text(recipe.model_dump_json(indent=2))
        tracker.log_artifact(path)
    return run_id


def nest_under(recipe: Recipe, parent: str | None) -> Recipe:
    """The recipe whose stage runs are children of `parent` and carry the flow-run id."""
    data = recipe.model_dump(mode="json")
    data["tracking"] |= {
        "parent_run_id": parent,
        "tags": {**recipe.tracking.tags, "prefect.flow_run_id": flow_run_id()},
    }
    return validate_recipe(data)


def log_dataset(recipe: Recipe, run_id: str | None, data: Any) -> None:
    rows = [
        {"split": split, "file": s.file, "sha256": s.sha256, "tokens": s.n_tokens, "docs": s.n_docs}
        for split, info in data.splits.items()
        for s in info.shards
    ]
    digest = digest_of([r["sha256"] for r in rows])
    log_dataset_input(
        recipe.tracking, recipe.output_dir, run_id, f"tokens-{recipe.name}", rows, data.path, digest
    )
    tracker = make_tracker(recipe.tracking, recipe.output_dir, run_id, rank=0)
    tracker.log_artifact(Path(data.path) / "manifest.json", "data")
    tracker.log_artifact(Path(data.tokenizer.path) / "tokenizer.json", "tokenizer")


def finish_parent(recipe: Recipe, run_id: str | None, status: str, summary: dict[str, Any]) -> None:
    tracker = make_tracker(recipe.tracking, recipe.output_dir, run_id, rank=0)
    if summary:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "pipeline_summary.json"
            path.write_text(json.dumps(summary, indent=2, default=str))
            tracker.log_artifact(path)
        numbers = {f"pipeline/{k}_s": v for k, v in summary.get("stage_seconds", {}).items()}
        if "orchestration_overhead" in summary:
            numbers["pipeline/orchestration_overhead"] = summary["orchestration_overhead"]
        tracker.log_metrics(numbers, step=0)
        if "registered" in summary:
            set_run_tags(
                recipe.tracking,
                recipe.output_dir,
                run_id,
                {"lmforge.registered": f"{summary['registered']['name']}/{summary['registered']['version']}"},
            )
    finish_run(recipe.tracking, recipe.output_dir, run_id, status=status)
