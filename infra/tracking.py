"""MLflow: the tracking configuration, the `Tracker` protocol the training loop logs through, and one run object.

Default: `sqlite:///<output_dir>/mlflow.db` with artifacts under `<output_dir>/mlartifacts` (MLflow 3 refuses
the old `./mlruns` file store). Only rank 0 logs. A `TrackedRun` (store URI + run id, serialisable) is created
by the driver and continued by id, so a resumed training run keeps logging into the same MLflow run;
`tracked_run` finishes it FINISHED, or FAILED on any exception.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, field_validator

from infra.errors import Preempted, UserError, root_cause
from infra.mirror import working_dir
from infra.mlflow_template import seed_store
from infra.object_store import is_remote
from infra.secrets import SECRET_NAME, redact, url_has_password

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

    Not $MLFLOW_TRACKING_URI: `mlflow.set_tracking_uri` rewrites that one inside a process. Outputs on object
    storage need a tracking server: a sqlite file on one node's disk is not seen by workers or restarts elsewhere."""
    uri = cfg.uri or os.environ.get("LMFORGE_TRACKING_URI")
    if uri is None and is_remote(output_dir):
        raise UserError(
            f"output_dir={output_dir} is on object storage but MLflow would use a sqlite file on this node; set "
            "tracking.uri (or LMFORGE_TRACKING_URI) to a tracking server, e.g. `lmforge up` or docker/compose.yaml's, "
            "or tracking.enabled=false"
        )
    return uri or f"sqlite:///{working_dir(output_dir).resolve() / 'mlflow.db'}"


class Tracker(Protocol):
    """Rank 0's metrics, parameters and artifacts sink."""

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...

    def flush(self) -> None:
        """Send buffered metrics (a tracker may buffer them; see `MLflowTracker`)."""
        ...


class NullTracker:
    """Logs nothing: ranks other than 0, unit tests, and runs with tracking disabled."""

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def flush(self) -> None:
        pass


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"model": {"d_model": 64}} -> {"model.d_model": 64}: a config as MLflow parameters."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def find_experiment(uri: str, name: str) -> str | None:
    """The id of experiment `name` in the store at `uri`, or None (absent, or the store cannot be reached)."""
    try:
        import mlflow

        experiment = mlflow.MlflowClient(uri).get_experiment_by_name(name)
    except Exception:  # noqa: BLE001 - a link without the experiment still opens the UI
        return None
    return experiment.experiment_id if experiment else None


def _experiment_id(uri: str, cfg: TrackingConfig, output_dir: str | Path) -> str:
    import mlflow

    mlflow.set_tracking_uri(uri)
    experiment = mlflow.get_experiment_by_name(cfg.experiment)
    if experiment is not None:
        return experiment.experiment_id
    location = (
        (working_dir(output_dir).resolve() / "mlartifacts").as_uri() if uri.startswith("sqlite:") else None
    )
    return mlflow.create_experiment(cfg.experiment, artifact_location=location)


class TrackedRun(BaseModel):
    """One MLflow run: where its store is and its id; both None when tracking is off. Passed to workers as is."""

    model_config = ConfigDict(frozen=True)

    uri: str | None = None
    run_id: str | None = None

    @property
    def enabled(self) -> bool:
        return self.uri is not None and self.run_id is not None

    def tracker(self, rank: int = 0, buffer_seconds: float = 0.0) -> Tracker:
        """MLflow on rank 0 of an enabled run, else a tracker that logs nothing; `buffer_seconds` > 0 batches
        metrics (the training loop's per-step metrics: one store write per step doubled small models' steps)."""
        if rank != 0 or not self.enabled:
            return NullTracker()
        return MLflowTracker(self.uri, self.run_id, buffer_seconds)

    def finish(self, status: str = "FINISHED") -> None:
        if self.enabled:
            import mlflow

            mlflow.MlflowClient(self.uri).set_terminated(self.run_id, status=status)

    def fail(self, status: str = "FAILED") -> None:
        """Mark the run FAILED (or KILLED) while an error propagates: best effort and quiet, because that error is
        what the user must see (a full disk refuses this write too, and MLflow's store would log it with a
        140-line traceback)."""
        store_log = logging.getLogger("mlflow.store.db.utils")
        was_disabled, store_log.disabled = store_log.disabled, True
        try:
            self.finish(status)
        except Exception as error:  # noqa: BLE001 - the original error is re-raised by the caller
            log.warning("could not mark MLflow run %s %s (%s)", self.run_id, status, root_cause(error))
        finally:
            store_log.disabled = was_disabled

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.enabled:
            import mlflow

            client = mlflow.MlflowClient(self.uri)
            for key, value in redact(tags).items():
                client.set_tag(self.run_id, key, value)

    def url(self, ui: str = "http://127.0.0.1:5000") -> str:
        """The run's page in the MLflow UI (served by `lmforge up` or `mlflow ui` at `ui`)."""
        if not self.enabled:
            return ""
        import mlflow

        base = self.uri if self.uri.startswith("http") else os.environ.get("LMFORGE_MLFLOW_UI", ui)
        experiment = mlflow.MlflowClient(self.uri).get_run(self.run_id).info.experiment_id
        return f"{base.rstrip('/')}/#/experiments/{experiment}/runs/{self.run_id}"

    def log_dataset(self, name: str, rows: list[dict[str, Any]], source: str, digest: str) -> None:
        """Record a dataset (one row per shard: file, sha256, tokens) as an input of this run, by digest."""
        if not self.enabled:
            return
        import mlflow
        import pandas as pd
        from mlflow.data.dataset_source_registry import get_registered_sources

        mlflow.set_tracking_uri(self.uri)
        # the local source type named explicitly: resolving a bare path asks every source type and warns
        local = next(s for s in get_registered_sources() if s._get_source_type() == "local")
        source_uri = Path(source).resolve().as_uri()
        with warnings.catch_warnings(), mlflow.start_run(run_id=self.run_id):
            # shard counts are integers and never missing: MLflow's hint about integer columns is noise here
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
            frame = pd.DataFrame(rows)
            dataset = mlflow.data.from_pandas(frame, source=local(source_uri), name=name, digest=digest[:36])
            mlflow.log_input(dataset, context="training")


@lru_cache(maxsize=1)
def git_revision() -> str:
    """The checkout's commit (every run is tagged with it), or "unknown" outside a git checkout."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def existing_run(cfg: TrackingConfig, output_dir: str | Path, run_id: str | None) -> TrackedRun:
    """The `TrackedRun` of a run created earlier (by id), in the store this config points at."""
    if not cfg.enabled or run_id is None:
        return TrackedRun()
    return TrackedRun(uri=tracking_uri(cfg, output_dir), run_id=run_id)


def nested_run_id(cfg: TrackingConfig, output_dir: str | Path, stage: str) -> str | None:
    """The newest run tagged `lmforge.stage = stage` under `cfg.parent_run_id` (a stage's lineage record), if any."""
    if not cfg.enabled or cfg.parent_run_id is None:
        return None
    import mlflow

    client = mlflow.MlflowClient(tracking_uri(cfg, output_dir))
    experiment = client.get_run(cfg.parent_run_id).info.experiment_id
    where = f"tags.`lmforge.stage` = '{stage}' and tags.`mlflow.parentRunId` = '{cfg.parent_run_id}'"
    runs = client.search_runs([experiment], where, order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None


def open_run(
    cfg: TrackingConfig,
    output_dir: str | Path,
    run_name: str,
    tags: dict[str, str],
    resume_id: str | None = None,
) -> TrackedRun:
    """Create the MLflow run for a stage (nested under `cfg.parent_run_id`), or continue `resume_id` (moved under
    this invocation's parent: a resumed stage belongs to the pipeline run that finished it, not the FAILED one
    that was interrupted, which the run's `lmforge.earlier_parent_run_id` tag keeps)."""
    if not cfg.enabled or resume_id is not None:
        run = existing_run(cfg, output_dir, resume_id)
        if cfg.enabled and cfg.parent_run_id and run.run_id:
            reparent(run, cfg.parent_run_id)
        return run
    import mlflow

    uri = tracking_uri(cfg, output_dir)
    seed_store(uri)  # a new store: a copy of a migrated empty one
    tags = redact({"lmforge.git": git_revision(), **cfg.tags, **tags})
    if cfg.parent_run_id:
        tags["mlflow.parentRunId"] = cfg.parent_run_id
    client = mlflow.MlflowClient(uri)
    run = client.create_run(_experiment_id(uri, cfg, output_dir), run_name=run_name, tags=tags)
    return TrackedRun(uri=uri, run_id=run.info.run_id)


def reparent(run: TrackedRun, parent_run_id: str) -> None:
    """Nest `run` under `parent_run_id`, remembering the parent it had."""
    import mlflow

    client = mlflow.MlflowClient(run.uri)
    earlier = client.get_run(run.run_id).data.tags.get("mlflow.parentRunId")
    if earlier != parent_run_id:
        client.set_tag(run.run_id, "mlflow.parentRunId", parent_run_id)
        if earlier:
            client.set_tag(run.run_id, "lmforge.earlier_parent_run_id", earlier)


@contextmanager
def tracked_run(
    cfg: TrackingConfig,
    output_dir: str | Path,
    run_name: str,
    tags: dict[str, str],
    resume_id: str | None = None,
) -> Iterator[TrackedRun]:
    """`open_run` for the duration of a block: FINISHED when it returns, FAILED when it raises (KILLED when
    preempted), the error re-raised."""
    run = open_run(cfg, output_dir, run_name, tags, resume_id)
    try:
        yield run
    except BaseException as error:
        run.fail("KILLED" if isinstance(error, Preempted) else "FAILED")
        raise
    run.finish()


class MLflowTracker:
    """Logs to one existing MLflow run by id (rank 0 of a training job). With `buffer_seconds` > 0, metrics are
    sent in batches at most that often (and on `flush`, which the owner calls when it is done)."""

    MAX_BATCH = 1000  # MLflow's limit of metrics per log_batch

    def __init__(self, uri: str, run_id: str, buffer_seconds: float = 0.0) -> None:
        import mlflow

        self.client = mlflow.MlflowClient(uri)
        self.run_id = run_id
        self.buffer_seconds = buffer_seconds
        self.pending: list[Any] = []
        self.flushed = time.monotonic()

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        fresh = [Param(k, str(v)[:6000]) for k, v in redact(flatten(params)).items() if k not in existing]
        for start in range(0, len(fresh), 100):
            self.client.log_batch(self.run_id, params=fresh[start : start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.pending += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if time.monotonic() - self.flushed >= self.buffer_seconds or len(self.pending) >= self.MAX_BATCH:
            self.flush()

    def flush(self) -> None:
        while self.pending:
            batch, self.pending = self.pending[: self.MAX_BATCH], self.pending[self.MAX_BATCH :]
            self.client.log_batch(self.run_id, metrics=batch)
        self.flushed = time.monotonic()

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if Path(path).is_dir():
            self.client.log_artifacts(self.run_id, str(path), artifact_path)
        else:
            self.client.log_artifact(self.run_id, str(path), artifact_path)
