"""The scaling sweep with real Ray Tune trials, each a DeepSpeed pretraining run tracked in MLflow."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from logging.handlers import BufferingHandler
from pathlib import Path

import mlflow
import pyarrow.parquet as pq
import pytest

from data_pipeline.tokenize import run_tokenize
from flows.recipe import load_recipe
from infra.tracking import tracking_uri
from tests.pretrain_helpers import clean_env, lmforge_command, smoke_overrides, with_sets
from training.stages.sweep import plan_trials, run_sweep

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def sweep_setup(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    recipe = load_recipe(
        "smoke",
        smoke_overrides(
            out,
            "sweep.budgets=[5e9,1e10]",
            "sweep.depths=[1,2]",
            "sweep.multi_horizon=true",
            "sweep.probe=humaneval",
            "optim.schedule=wsd",
        ),
    )
    data = run_tokenize(recipe.data, recipe.output_dir)
    seen, warnings = [], BufferingHandler(capacity=10_000)  # keeps every record it is given
    warnings.setLevel(logging.WARNING)
    tune_log = logging.getLogger("ray.tune")  # Ray's loggers do not reach pytest's capture
    tune_log.addHandler(warnings)
    try:
        result = run_sweep(
            recipe.sweep_spec(),
            data,
            progress=lambda done, total, row: seen.append((done, total, row["status"])),
        )
    finally:
        tune_log.removeHandler(warnings)
    return recipe, data, result, seen, [record.getMessage() for record in warnings.buffer]


def test_sweep_trains_every_trial_and_writes_the_table(sweep_setup):
    """Multi-horizon: one run per size gives a point at each budget (a decay branch at the smaller one)."""
    recipe, _, result, seen, warnings = sweep_setup
    plans, _ = plan_trials(recipe.sweep_spec())
    rows = pq.read_table(result.results).to_pylist()
    assert len(plans) == result.n_trials == result.n_completed == 2
    assert len(rows) == result.n_points == 4
    assert not warnings, warnings  # Tune found every trial's results (it warned when it could not)
    pairs = [
        (plan, budget, steps)
        for plan in plans
        for budget, steps in zip(plan.budgets, plan.steps, strict=True)
    ]
    for (plan, budget, steps), row in zip(pairs, rows, strict=True):
        assert row["status"] == "completed"
        assert (
            row["N"] == plan.n_active and row["steps"] == steps and row["D"] == steps * plan.tokens_per_step
        )
        assert row["C"] == pytest.approx(6 * row["N"] * row["D"])
        assert row["C"] == pytest.approx(budget, rel=0.1)  # whole steps round the token count
        assert 3.0 < row["loss"] < 6.5 and 0.5 < row["task_loss"] < 10  # HumanEval bits per byte
        assert row["tokens_per_s"] > 0 and row["epochs"] > 0
    # the run's full horizon ends lower than its decay branch; the run's wall time is on the full horizon's row
    for plan in plans:
        short, full = [r for r in rows if r["N"] == plan.n_active]
        assert full["loss"] < short["loss"]
        assert full["wall_seconds"] > 0 and short["wall_seconds"] == 0
    # one run per size spends less than a run per point would
    # each run costs its full horizon plus its decay branches: more than the full horizons, less than a run per point
    full_horizons, one_per_point = (
        sum(r["C"] for r in rows if r["wall_seconds"] > 0),
        sum(r["C"] for r in rows),
    )
    assert result.flops == pytest.approx(sum(p.flops for p in plans), rel=1e-12)
    assert full_horizons < result.flops < one_per_point
    assert result.points_per_flop_gain == pytest.approx(one_per_point / result.flops, rel=1e-12)
    assert 1.2 < result.points_per_flop_gain < 1.5
    # at the same budget the smaller model sees more tokens
    by_budget = {}
    for row in rows:
        by_budget.setdefault(row["budget"], []).append(row)
    for group in by_budget.values():
        small, large = sorted(group, key=lambda r: r["N"])
        assert small["D"] > large["D"]
    assert [s[0] for s in seen] == [1, 2] and all(s[1] == 2 for s in seen)
    # Tune's overhead: its wall time over the trials' own times (the rows' wall_seconds), per concurrent slot
    assert result.trial_seconds == pytest.approx(sum(r["wall_seconds"] for r in rows), rel=1e-12)
    concurrency = min(recipe.sweep.max_concurrent, result.n_trials)
    assert result.overhead == pytest.approx(
        result.wall_seconds / (result.trial_seconds / concurrency), rel=1e-12
    )
    assert result.wall_seconds >= max(r["wall_seconds"] for r in rows)


def test_trials_are_nested_mlflow_runs_under_the_sweep(sweep_setup):
    recipe, _, result, _, _ = sweep_setup
    client = mlflow.MlflowClient(tracking_uri(recipe.tracking, recipe.output_dir))
    parent = client.get_run(result.mlflow_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["sweep/completed"] == 2 and parent.data.metrics["sweep/points"] == 4
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{result.mlflow_run_id}'"
    )
    rows = pq.read_table(result.results).to_pylist()
    assert sorted(r.info.run_id for r in children) == sorted({r["mlflow_run_id"] for r in rows})
    assert all(r.info.status == "FINISHED" for r in children)
    assert [a.path for a in client.list_artifacts(result.mlflow_run_id)] == ["results.parquet"]


def test_rerun_skips_finished_work(sweep_setup):
    recipe, data, result, _, _ = sweep_setup
    again = run_sweep(recipe.sweep_spec(), data)
    assert again == result  # the finished sweep is returned as is


def test_rerun_after_a_lost_sweep_manifest_reuses_finished_trials(sweep_setup):
    recipe, data, result, _, _ = sweep_setup
    manifest, table = Path(result.sweep_dir) / "manifest.json", Path(result.results)
    saved = {manifest: manifest.read_bytes(), table: table.read_bytes()}
    manifest.unlink()
    try:
        again = run_sweep(recipe.sweep_spec(), data)
        rebuilt = pq.read_table(again.results).to_pylist()
    finally:  # the other tests of this module read the original sweep (its table too: rebuilt rows ran no trial)
        for path, content in saved.items():
            path.write_bytes(content)
    assert again.wall_seconds == 0.0 and again.trial_seconds == 0.0  # no trial ran
    assert [r["loss"] for r in rebuilt] == pq.read_table(result.results).column("loss").to_pylist()
    assert again.mlflow_run_id == result.mlflow_run_id


def test_asha_stops_poor_learning_rates_early(tmp_path):
    recipe = load_recipe(
        "smoke",
        smoke_overrides(
            tmp_path,
            "sweep.budgets=[1e10]",
            "sweep.depths=[1]",
            "sweep.lrs=[3e-3,1e-5,3e-6,1e-6]",
            "sweep.scheduler=asha",
            "sweep.grace_steps=10",
            "sweep.report_every=5",
            "sweep.reduction_factor=2",
            "tracking.enabled=false",
        ),
    )
    result = run_sweep(recipe.sweep_spec(), run_tokenize(recipe.data, recipe.output_dir))
    rows = pq.read_table(result.results).to_pylist()
    assert result.n_stopped >= 1 and result.n_completed >= 1
    stopped = [r for r in rows if r["status"] == "stopped"]
    assert all(r["loss"] is None and r["lr"] < 3e-3 for r in stopped)
    assert any(r["status"] == "completed" and r["lr"] == 3e-3 for r in rows)


def test_cli_sweep_stops_its_trials_at_a_checkpoint_and_the_rerun_finishes_them(sweep_setup):
    """SIGTERM to `lmforge sweep` (its live progress bar, a rich bar in a Tune callback, cannot be pickled: it runs):
    the running trial (a Ray actor's thread, which signals never reach) checkpoints after its current step and the
    command ends in one line; the rerun resumes the trial from that checkpoint, every step trained once."""
    recipe, _, _, _, _ = sweep_setup
    out = Path(recipe.output_dir)
    args = lmforge_command(
        "sweep", "smoke", *with_sets(smoke_overrides(out, "sweep.budgets=[1e11]", "sweep.depths=[2]"))
    )
    sweep = subprocess.Popen(args, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "pretrain"
    deadline = time.monotonic() + 300
    while (
        sum(
            '"train/loss"' in line
            for f in metrics.glob("smoke-sweep-C1e11-*/metrics.jsonl")
            for line in f.open()
        )
        < 10
    ):
        assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()[1][-3000:]
        time.sleep(0.2)
    signalled = time.monotonic()
    sweep.send_signal(signal.SIGTERM)
    _, stderr = sweep.communicate(timeout=120)
    print(f"SIGTERM to exit: {time.monotonic() - signalled:.1f} s")
    errors = [line for line in stderr.splitlines() if line.startswith("lmforge: error:")]
    assert sweep.returncode == 2 and "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1 and "SIGTERM: the sweep stopped with 0 of 1 trials finished" in errors[0], errors
    (run,) = metrics.glob("smoke-sweep-C1e11-*")
    checkpoints = [int(c.parent.name[5:]) for c in run.glob("checkpoints/step-*/COMPLETE")]
    assert checkpoints and max(checkpoints) < 248 and not (run / "manifest.json").exists()
    # the rerun: the function the command calls, here (the launch's own path ran above, up to the stop)
    rerun = load_recipe("smoke", smoke_overrides(out, "sweep.budgets=[1e11]", "sweep.depths=[2]"))
    result = run_sweep(rerun.sweep_spec(), run_tokenize(rerun.data, rerun.output_dir))
    assert result.n_trials == result.n_completed == 1
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").open() if '"train/loss"' in line]
    assert steps == list(range(1, 249))
