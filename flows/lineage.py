"""MLflow lineage of a pipeline run: the parent run, nesting every stage under it, the dataset input, the
final summary (parameters, fit, chosen size, eval headline) as an artifact."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_pipeline.shards import DatasetManifest
from evaluation.scaling_report import ScalingFit
from infra.registry import RegisteredVersion
from infra.storage import sha256_file
from infra.tracking import TrackedRun, open_run
from training.stages.lifecycle import TrainedModel

if TYPE_CHECKING:
    from flows.recipe import Recipe


# stages whose MLflow record is a lineage run of their own (they train nothing), by the `lmforge.stage` it is tagged
# with: the rung completes the fit's record (prediction against measurement)
RECORDED_AS = {"tokenize": "tokenize", "rung": "fit", "register": "register"}


def flow_run_id() -> str:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id or "")
    except Exception:  # noqa: BLE001 - outside a flow run
        return ""


def _log_json(run: TrackedRun, name: str, value: Any) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / name
        path.write_text(json.dumps(value, indent=2, default=str))
        run.tracker().log_artifact(path)


def start_parent(recipe: Recipe, params: Any) -> TrackedRun:
    """The pipeline's parent run, tagged with config hash, git revision and the Prefect flow-run id."""
    tags = {
        "lmforge.stage": "pipeline",
        "lmforge.config_digest": recipe.digest(),
        "prefect.flow_run_id": flow_run_id(),
    }
    run = open_run(recipe.tracking, recipe.output_dir, f"pipeline-{recipe.name}", tags)
    run.tracker().log_params(
        {"pipeline": params.model_dump(mode="json"), "recipe": recipe.model_dump(mode="json")}
    )
    _log_json(run, "recipe.json", recipe.model_dump(mode="json"))
    return run


def nest_under(recipe: Recipe, parent: TrackedRun) -> Recipe:
    """The recipe whose stage runs are children of `parent` and carry the flow-run id."""
    tags = {**recipe.tracking.tags, "prefect.flow_run_id": flow_run_id()}
    return recipe.override({"tracking.parent_run_id": parent.run_id, "tracking.tags": tags})


def log_dataset(recipe: Recipe, run: TrackedRun, data: DatasetManifest) -> None:
    rows = [
        {"split": split, "file": s.file, "sha256": s.sha256, "tokens": s.n_tokens, "docs": s.n_docs}
        for split, info in data.splits.items()
        for s in info.shards
    ]
    run.log_dataset(f"tokens-{recipe.name}", rows, data.path, data.digest())
    tracker = run.tracker()
    tracker.log_artifact(Path(data.path) / "manifest.json", "data")
    tracker.log_artifact(Path(data.tokenizer.path) / "tokenizer.json", "tokenizer")


def finish_parent(run: TrackedRun, status: str, summary: dict[str, Any]) -> None:
    if summary:
        _log_json(run, "pipeline_summary.json", summary)
        numbers = {f"pipeline/{k}_s": v for k, v in summary.get("stage_seconds", {}).items()}
        if "orchestration_overhead" in summary:
            numbers["pipeline/orchestration_overhead"] = summary["orchestration_overhead"]
        run.tracker().log_metrics(numbers, step=0)
        if registered := summary.get("stages", {}).get("register"):
            run.set_tags({"lmforge.registered": f"{registered['model']}/{registered['version']}"})
    run.finish(status)


def record_stage(
    recipe: Recipe,
    stage: str,
    digest: str,
    metrics: dict[str, float],
    params: dict[str, Any] | None = None,
    artifacts: tuple[Path, ...] = (),
    tags: dict[str, str] | None = None,
) -> str | None:
    """A run of its own, nested under the pipeline's, for a stage that trains nothing (tokenize, fit, register),
    so the lineage shows every stage with its config digest, git revision, numbers and files. Outside a pipeline
    (a stage's own command) the stage's own runs are its record: nothing is added."""
    if not recipe.tracking.enabled or recipe.tracking.parent_run_id is None:
        return None
    run_tags = {"lmforge.stage": stage, "lmforge.config_digest": digest, **(tags or {})}
    run = open_run(recipe.tracking, recipe.output_dir, f"{stage}-{recipe.name}", run_tags)
    tracker = run.tracker()
    tracker.log_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}, step=0)
    if params:
        tracker.log_params(params)
    for path in artifacts:
        if path.exists():
            tracker.log_artifact(path, stage)
    tracker.flush()
    run.finish()
    return run.run_id


def record_tokenize(recipe: Recipe, data: DatasetManifest) -> None:
    train, val = data.splits["train"], data.splits["val"]
    numbers = {"tokens/train": train.n_tokens, "tokens/val": val.n_tokens, "docs/train": train.n_docs}
    tags = {"lmforge.data_digest": data.digest(), "lmforge.run_dir": data.path}
    params = {"data": recipe.data.model_dump(mode="json")}
    record_stage(recipe, "tokenize", data.key, numbers, params, (Path(data.path) / "manifest.json",), tags)


def record_fit(recipe: Recipe, law: ScalingFit, fitted: Path, budget: float) -> None:
    """The law, its optimum and the rung's prediction against its measurement; fit.json and the plots."""
    numbers = {f"fit/{k}": v for k, v in law.law.items()} | {"fit/n_opt": law.sizing_n_opt}
    rung = law.rung
    if rung is not None and rung.measured_loss is not None:
        numbers |= {"fit/rung_predicted_loss": rung.loss, "fit/rung_measured_loss": rung.measured_loss}
        numbers |= {"fit/rung_rel_error": rung.rel_error, "fit/rung_held": float(rung.held)}
        if rung.curve is not None and rung.curve.max_rel_error is not None:
            numbers["fit/rung_curve_max_rel_error"] = rung.curve.max_rel_error
    files = (fitted / "fit.json", *sorted(fitted.glob("*.png")))
    digest = sha256_file(fitted / "fit.json")
    tags = {"lmforge.run_dir": str(fitted)} | ({"lmforge.law_form": law.choice.form} if law.choice else {})
    record_stage(recipe, "fit", digest, numbers, {"budget": budget}, files, tags)


def record_register(recipe: Recipe, version: RegisteredVersion, model: TrainedModel) -> None:
    numbers = {f"gate/{k}": float(v) for k, v in version.gates.items()}
    tags = {"lmforge.registered": f"{version.name}/{version.version}", "lmforge.alias": str(version.alias)}
    params = {"gates_skipped": ",".join(version.skipped) or "none"}
    record_stage(recipe, "register", model.key, numbers, params, tags=tags)
