"""The MLflow tracker on a real (sqlite) store: buffered metrics reach the run on flush, none are lost."""

from __future__ import annotations

import time

import mlflow

from infra.tracking import TrackingConfig, nested_run_id, open_run


def test_buffered_metrics_arrive_on_flush(tmp_path):
    run = open_run(TrackingConfig(), tmp_path, "buffered", {})
    tracker = run.tracker(buffer_seconds=3600.0)
    for step in range(1, 6):
        tracker.log_metrics({"train/loss": 1.0 / step}, step)
    client = mlflow.MlflowClient(run.uri)
    assert client.get_metric_history(run.run_id, "train/loss") == []  # held back, one write instead of five
    tracker.flush()
    history = client.get_metric_history(run.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, 1.0 / s) for s in range(1, 6)]
    unbuffered = run.tracker()
    unbuffered.log_metrics({"x": 2.0}, 0)
    assert client.get_run(run.run_id).data.metrics["x"] == 2.0
    run.finish()


def test_a_resumed_stage_moves_under_the_pipeline_run_that_finishes_it(tmp_path):
    """An interrupted pipeline's stage run was nested under the FAILED pipeline run; the rerun that resumes it is
    its parent now, and the earlier parent is kept in a tag."""
    first = open_run(TrackingConfig(), tmp_path, "pipeline", {})
    second = open_run(TrackingConfig(), tmp_path, "pipeline (rerun)", {})
    stage = open_run(TrackingConfig(parent_run_id=first.run_id), tmp_path, "pretrain", {})
    resumed = open_run(
        TrackingConfig(parent_run_id=second.run_id), tmp_path, "pretrain", {}, resume_id=stage.run_id
    )
    assert resumed.run_id == stage.run_id
    tags = mlflow.MlflowClient(stage.uri).get_run(stage.run_id).data.tags
    assert (
        tags["mlflow.parentRunId"] == second.run_id and tags["lmforge.earlier_parent_run_id"] == first.run_id
    )


def test_a_stages_lineage_run_is_found_under_its_own_pipeline_run(tmp_path):
    """What a Prefect artifact links to for a stage that trains nothing: its newest record under this pipeline."""
    pipeline, other = (open_run(TrackingConfig(), tmp_path, name, {}) for name in ("pipeline", "other"))
    cfg = TrackingConfig(parent_run_id=pipeline.run_id)
    assert nested_run_id(cfg, tmp_path, "tokenize") is None
    open_run(
        TrackingConfig(parent_run_id=other.run_id), tmp_path, "tokenize-x", {"lmforge.stage": "tokenize"}
    )
    older = open_run(cfg, tmp_path, "tokenize-a", {"lmforge.stage": "tokenize"})
    time.sleep(0.01)  # start times are in milliseconds
    newer = open_run(cfg, tmp_path, "tokenize-b", {"lmforge.stage": "tokenize"})
    open_run(cfg, tmp_path, "fit-a", {"lmforge.stage": "fit"})
    assert older.run_id != newer.run_id
    assert nested_run_id(cfg, tmp_path, "tokenize") == newer.run_id
    assert (
        nested_run_id(TrackingConfig(enabled=False, parent_run_id=pipeline.run_id), tmp_path, "fit") is None
    )
