"""Stage: the scaling sweep. `run_sweep(spec, data) -> SweepResult` trains one model per (budget, size[, lr])
as Ray Tune trials, each a full `run_pretrain`, and writes a results table for the scaling-law fit.

Every trial is an ordinary cached pretraining step (nested in MLflow under the sweep's run): the sweep asks the
step protocol which trials are finished, so a rerun skips them and resumes interrupted ones; the sweep itself is
a cached step too. The only module that imports `ray.tune`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from pydantic import BaseModel, ConfigDict

from data_pipeline.shards import DatasetManifest
from infra.config import override
from infra.steps import Artifact, Step, run_step
from infra.storage import atomic_write_json
from infra.tracking import TrackingConfig, tracked_run, tracking_uri
from training.accounting import count_parameters
from training.config import SweepConfig
from training.launch import ensure_ray
from training.model import ModelConfig
from training.pretrain import PRETRAIN, PretrainSpec, run_pretrain
from training.stage import TrainedModel, git_revision, read_metrics, training_step

log = logging.getLogger(__name__)
SWEEP_VERSION = 2
RESULTS = "results.parquet"
TrialProgress = Callable[[int, int, dict[str, Any]], None]  # (finished, total, row)


class SweepSpec(BaseModel):
    """What the sweep receives: the grid and the pretraining spec every trial derives from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    output_dir: str
    sweep: SweepConfig
    base: PretrainSpec  # each trial overrides its size, horizon and learning rate
    tracking: TrackingConfig = TrackingConfig()


class TrialPlan(BaseModel):
    """One trial: a model size trained for D = C / (6·N) tokens (rounded to whole optimizer steps)."""

    model_config = ConfigDict(frozen=True)

    budget: float
    depth: int
    lr: float
    n_active: int  # parameters in matrix multiplies per token (what 6·N·D counts)
    n_total: int
    steps: int
    tokens: int
    model: dict[str, Any]

    @property
    def flops(self) -> float:
        return 6.0 * self.n_active * self.tokens

    @property
    def name(self) -> str:
        return f"C{self.budget:.3g}-d{self.depth}-lr{self.lr:g}".replace("+", "")


class SweepResult(Artifact):
    """A finished sweep (`path` is its directory)."""

    results: str  # the Parquet table
    n_trials: int
    n_completed: int
    n_stopped: int  # stopped early by ASHA
    skipped: list[str]  # (budget, size) pairs left out, with the reason
    mlflow_run_id: str | None
    wall_seconds: float  # Tuner.fit() wall time
    trial_seconds: float  # sum of the trials' own run_pretrain times (this invocation only)
    overhead: float | None  # wall / (trial_seconds / concurrency); None when nothing ran

    @property
    def sweep_dir(self) -> str:
        return self.path


def sized_model(base: ModelConfig, depth: int) -> ModelConfig:
    """The recipe's architecture at another depth, keeping its aspect ratio, head size and kv grouping."""
    head_dim = base.d_model // base.n_heads
    fields = base.model_dump(exclude={"d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff"})
    return ModelConfig.from_depth(
        depth,
        aspect_ratio=base.d_model // base.n_layers,
        head_dim=head_dim,
        kv_ratio=base.n_heads // base.n_kv_heads,
        **fields,
    )


def plan_trials(spec: SweepSpec) -> tuple[list[TrialPlan], list[str]]:
    """The (budget × depth × lr) grid; pairs whose token count gives fewer than `min_steps` steps are skipped."""
    sweep, base = spec.sweep, spec.base
    tokens_per_step = base.train.global_batch(base.parallel.world_size) * base.train.seq_len
    plans, skipped = [], []
    for budget in sweep.budgets:
        for depth in sweep.depths:
            model = sized_model(base.model, depth)
            counts = count_parameters(model)
            steps = round(budget / (6.0 * counts.matmul_active) / tokens_per_step)
            if steps < sweep.min_steps:
                skipped.append(
                    f"budget {budget:.3g} FLOPs at depth {depth} (N={counts.matmul_active:,}): {steps} steps "
                    f"< sweep.min_steps={sweep.min_steps}; raise the budget or drop the size"
                )
                continue
            for lr in sweep.lrs or [base.optim.lr]:
                plans.append(
                    TrialPlan(
                        budget=budget,
                        depth=depth,
                        lr=lr,
                        n_active=counts.matmul_active,
                        n_total=counts.total,
                        steps=steps,
                        tokens=steps * tokens_per_step,
                        model=model.model_dump(mode="json"),
                    )
                )
    return plans, skipped


def trial_spec(spec: SweepSpec, plan: TrialPlan, parent_run_id: str | None) -> PretrainSpec:
    """One trial's pretraining spec: its size, horizon (the schedule spans exactly its steps) and learning rate.
    Paths and the tracking store are absolute: Tune runs trials in their own working directories."""
    base = spec.base
    changes: dict[str, Any] = {
        "name": f"{spec.name}-sweep-{plan.name}",
        "output_dir": str(Path(spec.output_dir).resolve()),
        "model": plan.model,
        "train.max_steps": plan.steps,
        "train.eval_every": plan.steps,
        "train.checkpoint_every": plan.steps,
        "optim.lr": plan.lr,
        "optim.warmup_steps": min(base.optim.warmup_steps, max(1, plan.steps // 10)),
        "tracking.parent_run_id": parent_run_id,
    }
    if base.tracking.enabled:
        changes["tracking.uri"] = tracking_uri(base.tracking, spec.output_dir)
    return override(base, changes)


def trial_row(
    plan: TrialPlan, ref: TrainedModel | None, wall: float, status: str, last_loss: float | None
) -> dict:
    metrics = read_metrics(Path(ref.run_dir)) if ref else []
    val = [m["val/loss"] for m in metrics if "val/loss" in m]
    speed = [m["perf/tokens_per_s"] for m in metrics if "perf/tokens_per_s" in m][1:]  # first step warms up
    return {
        "budget": plan.budget,
        "depth": plan.depth,
        "lr": plan.lr,
        "N": plan.n_active,
        "N_total": plan.n_total,
        "D": plan.tokens,
        "C": plan.flops,
        "steps": plan.steps,
        "loss": ref.final_val_loss if ref else None,  # final validation loss: what the fits use
        "best_val_loss": min(val) if val else None,
        "final_train_loss": last_loss,
        "tokens_per_s": sum(speed) / len(speed) if speed else None,
        "wall_seconds": wall,
        "status": status,
        "run_dir": ref.run_dir if ref else None,
        "mlflow_run_id": ref.mlflow_run_id if ref else None,
    }


def _last_train_loss(run_dir: str) -> float | None:
    losses = [m["train/loss"] for m in read_metrics(run_dir) if "train/loss" in m]
    return losses[-1] if losses else None


def _trainable(config: dict[str, Any], specs: list[tuple[str, str]], data: str, report_every: int) -> None:
    """One Tune trial: a full `run_pretrain`, reporting the training loss every few steps (ASHA's signal)."""
    from ray import tune

    # a trial is a fresh one-process run: drop process-group variables inherited from the driver's environment
    # (an in-process run there sets MASTER_PORT to a port its own process group still holds)
    if not torch.distributed.is_initialized():
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
    plan_json, spec_json = specs[config["trial"]]
    plan, spec = TrialPlan.model_validate_json(plan_json), PretrainSpec.model_validate_json(spec_json)
    manifest = DatasetManifest.model_validate_json(data)
    last = {"loss": None}

    def report(step: int, loss: float, tokens_per_s: float) -> None:
        last["loss"] = loss
        if step % report_every == 0 and step < plan.steps:
            tune.report({"step": step, "train_loss": loss})

    t0 = time.perf_counter()
    ref = run_pretrain(spec, manifest, progress=report)
    row = trial_row(plan, ref, time.perf_counter() - t0, "completed", last["loss"])
    tune.report({"step": plan.steps, "train_loss": last["loss"] or float("nan"), "row": row})


def run_sweep(spec: SweepSpec, data: DatasetManifest, progress: TrialProgress | None = None) -> SweepResult:
    """Run (or resume, or return) the sweep and write `results.parquet`; see the module docstring."""
    plans, skipped = plan_trials(spec)
    if not plans:
        raise ValueError(
            "sweep has no trials: set sweep.budgets and sweep.depths"
            + (" (every pair was left out: " + "; ".join(skipped) + ")" if skipped else "")
        )
    config = {"sweep": spec.sweep.model_dump(mode="json"), "runs": spec.base.key()}
    step = Step("sweep", spec.name, SWEEP_VERSION, config, SweepResult, {"data": data})
    return run_step(
        spec.output_dir, step, lambda out, _key: _sweep(spec, data, plans, skipped, out, progress)
    )


def _sweep(
    spec: SweepSpec,
    data: DatasetManifest,
    plans: list[TrialPlan],
    skipped: list[str],
    sweep_dir: Path,
    progress: TrialProgress | None,
) -> SweepResult:
    state_path = sweep_dir / "state.json"
    parent = json.loads(state_path.read_text()).get("mlflow_run_id") if state_path.is_file() else None
    tags = {"lmforge.stage": "sweep", "lmforge.git": git_revision(), "lmforge.data_digest": data.digest()}
    with tracked_run(spec.tracking, spec.output_dir, f"sweep-{spec.name}", tags, parent) as run:
        atomic_write_json(state_path, {"mlflow_run_id": run.run_id})
        tracker = run.tracker()
        if parent is None:
            tracker.log_params({"sweep": spec.sweep.model_dump(mode="json"), "n_trials": len(plans)})
        rows: dict[str, dict[str, Any]] = {}
        todo = []
        for plan in plans:
            trial = trial_spec(spec, plan, run.run_id)
            done = training_step(PRETRAIN, trial, {"data": data}).finished(spec.output_dir)
            if done is not None:  # finished earlier: no time spent now
                rows[plan.name] = trial_row(plan, done, 0.0, "completed", _last_train_loss(done.path))
            else:
                todo.append((plan, trial))
        if progress:
            for row in rows.values():
                progress(len(rows), len(plans), row)
        wall, trial_seconds = _run_trials(spec.sweep, todo, data, rows, progress, len(plans), sweep_dir)
        missing = [p.name for p in plans if p.name not in rows]
        if missing:  # Tune stops gracefully on Ctrl-C; hand the interrupt back to the caller
            raise KeyboardInterrupt(f"sweep interrupted: trials {missing} did not finish")
        ordered = [rows[p.name] for p in plans]
        pq.write_table(pa.Table.from_pylist(ordered), sweep_dir / RESULTS)
        tracker.log_artifact(sweep_dir / RESULTS)
        completed = [r for r in ordered if r["status"] == "completed"]
        concurrency = min(spec.sweep.max_concurrent, max(1, len(todo)))
        result = SweepResult(
            path=str(sweep_dir.resolve()),
            results=str((sweep_dir / RESULTS).resolve()),
            n_trials=len(plans),
            n_completed=len(completed),
            n_stopped=len(ordered) - len(completed),
            skipped=skipped,
            mlflow_run_id=run.run_id,
            wall_seconds=wall,
            trial_seconds=trial_seconds,
            overhead=wall / (trial_seconds / concurrency) if trial_seconds else None,
        )
        summary = {"sweep/completed": len(completed), "sweep/stopped": result.n_stopped, "sweep/wall_s": wall}
        if result.overhead:
            summary["sweep/overhead"] = result.overhead
        tracker.log_metrics(summary, step=0)
    return result


def _run_trials(
    sweep: SweepConfig,
    todo: list[tuple[TrialPlan, PretrainSpec]],
    data: DatasetManifest,
    rows: dict[str, dict[str, Any]],
    progress: TrialProgress | None,
    total: int,
    sweep_dir: Path,
) -> tuple[float, float]:
    """Run the unfinished trials as Tune trials, adding their rows; returns (Tune wall time, sum of trial times)."""
    if not todo:
        return 0.0, 0.0
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    ensure_ray(int(sweep.max_concurrent * sweep.cpus_per_trial))
    scheduler = (
        ASHAScheduler(
            time_attr="step",
            max_t=max(p.steps for p, _ in todo),
            grace_period=sweep.grace_steps,
            reduction_factor=sweep.reduction_factor,
        )
        if sweep.scheduler == "asha"
        else FIFOScheduler()
    )
    trainable = tune.with_parameters(
        _trainable,
        specs=[(p.model_dump_json(), t.model_dump_json()) for p, t in todo],
        data=data.model_dump_json(),
        report_every=sweep.report_every,
    )
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": sweep.cpus_per_trial, "gpu": sweep.gpus_per_trial}),
        param_space={"trial": tune.grid_search(list(range(len(todo))))},
        tune_config=tune.TuneConfig(
            metric="train_loss",
            mode="min",
            scheduler=scheduler,
            max_concurrent_trials=sweep.max_concurrent,
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            storage_path=str((sweep_dir / "tune").resolve()),
            name=f"sweep-{int(time.time())}",
            verbose=0,
            callbacks=[_progress_callback(progress, len(rows), total)] if progress else None,
        ),
    )
    t0 = time.perf_counter()
    grid = tuner.fit()
    wall, trial_seconds = time.perf_counter() - t0, 0.0
    for result in grid:
        plan = todo[result.config["trial"]][0]
        metrics = result.metrics or {}
        if "row" in metrics:
            rows[plan.name] = metrics["row"]
            trial_seconds += metrics["row"]["wall_seconds"]
        elif result.error is None:  # stopped by the scheduler
            rows[plan.name] = trial_row(plan, None, 0.0, "stopped", metrics.get("train_loss"))
        else:
            raise RuntimeError(f"sweep trial {plan.name} failed: {result.error}") from result.error
    return wall, trial_seconds


def _progress_callback(progress: TrialProgress, done: int, total: int) -> Any:
    """A Tune callback that calls `progress(finished, total, row)` as trials complete.

    Tune pickles its callbacks with the experiment state, and the progress function is often a live progress bar
    (which cannot be pickled): it is kept out of the pickle, and the class's methods capture nothing from this
    function (cloudpickle pickles a local class by value, closures included).
    """
    from ray.tune import Callback

    class ProgressCallback(Callback):
        def __init__(self, progress: TrialProgress | None, done: int, total: int) -> None:
            self.progress, self.done, self.total = progress, done, total

        def __getstate__(self) -> dict[str, Any]:
            return {**self.__dict__, "progress": None}

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.done += 1
            if self.progress is not None:
                row = (trial.last_result or {}).get("row", {"status": "stopped"})
                self.progress(self.done, self.total, row)

    return ProgressCallback(progress, done, total)
