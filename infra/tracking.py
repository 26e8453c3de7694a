"""MLflow: the tracking configuration, the default embedded store, and the `Tracker` implementation.

Default: `sqlite:///<output_dir>/mlflow.db` with artifacts under `<output_dir>/mlartifacts` (MLflow 3 refuses
the old `./mlruns` file store). Only rank 0 logs. A run is created by the driver and continued by id, so a
resumed training run keeps logging into the same MLflow run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator

from infra.secrets import SECRET_NAME, redact, url_has_password
from training.tracking import NullTracker, Tracker, flatten

log = logging.getLogger(__name__)


class TrackingConfig(BaseModel):
    """Where runs are recorded; `uri: null` means the embedded sqlite store under the output directory."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @field_validator("uri")
    @classmethod
    def _no_password(cls, uri: str | None) -> str | None:
        if uri and url_has_password(uri):
            raise ValueError(
                "tracking.uri carries a password; put credentials in MLFLOW_TRACKING_USERNAME / "
                "MLFLOW_TRACKING_PASSWORD (environment), never in a recipe"
            )
        return uri

    @field_validator("tags")
    @classmethod
    def _no_secret_tags(cls, tags: dict[str, str]) -> dict[str, str]:
        named = [k for k in tags if SECRET_NAME.search(k)]
        if named:
            raise ValueError(
                f"tracking.tags {named} look like secrets; secrets come from the environment, never a recipe"
            )
        return tags

    enabled: bool = True
    uri: str | None = None
    experiment: str = "lmforge"
    parent_run_id: str | None = None  # nest this stage's run under a pipeline or sweep run
    tags: dict[str, str] = {}  # extra tags on every run (e.g. the Prefect flow-run id)


def tracking_uri(cfg: TrackingConfig, output_dir: str | Path) -> str:
    """`tracking.uri`, else $LMFORGE_TRACKING_URI (e.g. from `lmforge up`), else sqlite under the outputs.

    Not $MLFLOW_TRACKING_URI: `mlflow.set_tracking_uri` rewrites that one inside a process."""
    return (
        cfg.uri
        or os.environ.get("LMFORGE_TRACKING_URI")
        or f"sqlite:///{Path(output_dir).resolve() / 'mlflow.db'}"
    )


def _experiment_id(cfg: TrackingConfig, output_dir: str | Path) -> str:
    import mlflow

    mlflow.set_tracking_uri(tracking_uri(cfg, output_dir))
    experiment = mlflow.get_experiment_by_name(cfg.experiment)
    if experiment is not None:
        return experiment.experiment_id
    local = tracking_uri(cfg, output_dir).startswith("sqlite:")
    location = (Path(output_dir).resolve() / "mlartifacts").as_uri() if local else None
    return mlflow.create_experiment(cfg.experiment, artifact_location=location)


def start_run(
    cfg: TrackingConfig, output_dir: str | Path, run_name: str, run_id: str | None, tags: dict[str, str]
) -> str | None:
    """Create (or find again) the MLflow run for a stage; returns its id, or None when tracking is off."""
    if not cfg.enabled:
        return None
    import mlflow

    client = mlflow.MlflowClient(tracking_uri(cfg, output_dir))
    if run_id is not None:
        return run_id
    tags = redact({**cfg.tags, **tags})
    if cfg.parent_run_id:
        tags["mlflow.parentRunId"] = cfg.parent_run_id
    run = client.create_run(_experiment_id(cfg, output_dir), run_name=run_name, tags=tags)
    return run.info.run_id


class MLflowTracker:
    """Logs to one existing MLflow run by id (rank 0 of a training job)."""

    def __init__(self, uri: str, run_id: str) -> None:
        import mlflow

        self.client = mlflow.MlflowClient(uri)
        self.run_id = run_id

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        fresh = [Param(k, str(v)[:6000]) for k, v in redact(flatten(params)).items() if k not in existing]
        for start in range(0, len(fresh), 100):
            self.client.log_batch(self.run_id, params=fresh[start : start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
        )

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if Path(path).is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def close(self) -> None:
        pass


def make_tracker(cfg: TrackingConfig, output_dir: str | Path, run_id: str | None, rank: int) -> Tracker:
    if rank != 0 or run_id is None or not cfg.enabled:
        return NullTracker()
    return MLflowTracker(tracking_uri(cfg, output_dir), run_id)


def finish_run(
    cfg: TrackingConfig, output_dir: str | Path, run_id: str | None, status: str = "FINISHED"
) -> None:
    if run_id is None or not cfg.enabled:
        return
    import mlflow

    mlflow.MlflowClient(tracking_uri(cfg, output_dir)).set_terminated(run_id, status=status)


def log_dataset_input(
    cfg: TrackingConfig,
    output_dir: str | Path,
    run_id: str | None,
    name: str,
    rows: list[dict[str, Any]],
    source: str,
    digest: str,
) -> None:
    """Record a dataset (one row per shard: file, sha256, tokens) as an MLflow input of `run_id`, by digest."""
    if run_id is None or not cfg.enabled:
        return
    import mlflow
    import pandas as pd

    mlflow.set_tracking_uri(tracking_uri(cfg, output_dir))
    dataset = mlflow.data.from_pandas(pd.DataFrame(rows), source=source, name=name, digest=digest[:36])
    with mlflow.start_run(run_id=run_id):
        mlflow.log_input(dataset, context="training")


def set_run_tags(
    cfg: TrackingConfig, output_dir: str | Path, run_id: str | None, tags: dict[str, str]
) -> None:
    if run_id is None or not cfg.enabled:
        return
    import mlflow

    client = mlflow.MlflowClient(tracking_uri(cfg, output_dir))
    for key, value in tags.items():
        client.set_tag(run_id, key, value)


def run_url(
    cfg: TrackingConfig, output_dir: str | Path, run_id: str | None, ui: str = "http://127.0.0.1:5000"
) -> str:
    """The run's page in the MLflow UI (served by `lmforge up` or `mlflow ui` at `ui`)."""
    if run_id is None or not cfg.enabled:
        return ""
    import mlflow

    uri = tracking_uri(cfg, output_dir)
    base = uri if uri.startswith("http") else os.environ.get("LMFORGE_MLFLOW_UI", ui)
    experiment = mlflow.MlflowClient(uri).get_run(run_id).info.experiment_id
    return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
