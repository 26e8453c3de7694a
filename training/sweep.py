"""Stage: the scaling sweep. `run_sweep(recipe, data) -> SweepResult` trains one model per (budget, size[, lr])
as Ray Tune trials, each a full `run_pretrain`, and writes a results table for the scaling-law fit.

Every trial is an ordinary content-addressed pretraining run (nested in MLflow under the sweep's run), so a
rerun skips finished trials and resumes interrupted ones; the sweep itself is content-addressed too. The only
module that imports `ray.tune`.
"""

from __future__ import annotations

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
from infra.storage import MANIFEST, atomic_write_json, stage_dir
from infra.tracking import finish_run, make_tracker, start_run, tracking_uri
from training.accounting import count_parameters
from training.launch import ensure_ray
from training.model import ModelConfig
from training.pretrain import CheckpointRef, data_digest, git_revision, read_metrics, run_key, run_pretrain

log = logging.getLogger(__name__)
SWEEP_VERSION = 1
RESULTS = "results.parquet"
TRIAL_FILE = "sweep_trial.json"  # a finished trial's results row, next to its run's manifest
TrialProgress = Callable[[int, int, dict[str, Any]], None]  # (finished, total, row)


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


class SweepResult(BaseModel):
    sweep_dir: str
    results: str  # the Parquet table
    n_trials: int
    n_completed: int
    n_stopped: int  # stopped early by ASHA
    skipped: list[str]  # (budget, size) pairs left out, with the reason
    mlflow_run_id: str | None
    wall_seconds: float  # Tuner.fit() wall time
    trial_seconds: float  # sum of the trials' own run_pretrain times (this invocation only)
    overhead: float | None  # wall / (trial_seconds / concurrency); None when nothing ran

    @classmethod
    def load(cls, sweep_dir: str | Path) -> SweepResult:
        return cls.model_validate_json((Path(sweep_dir) / MANIFEST).read_text())


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


def plan_trials(recipe: Any) -> tuple[list[TrialPlan], list[str]]:
    """The (budget × depth × lr) grid; pairs whose token count gives fewer than `min_steps` steps are skipped."""
    sweep, train = recipe.sweep, recipe.train
    tokens_per_step = train.global_batch(recipe.parallel.world_size) * train.seq_len
    plans, skipped = [], []
    for budget in sweep.budgets:
        for depth in sweep.depths:
            model = sized_model(recipe.model, depth)
            counts = count_parameters(model)
            steps = round(budget / (6.0 * counts.matmul_active) / tokens_per_step)
            if steps < sweep.min_steps:
                skipped.append(
                    f"budget {budget:.3g} FLOPs at depth {depth} (N={counts.matmul_active:,}): {steps} steps "
                    f"< sweep.min_steps={sweep.min_steps}; raise the budget or drop the size"
                )
                continue
            for lr in sweep.lrs or [recipe.optim.lr]:
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


def trial_recipe(recipe: Any, plan: TrialPlan, parent_run_id: str | None) -> Any:
    """The recipe of one trial: its size, horizon (the schedule spans exactly its steps) and learning rate."""
    from flows.recipe import validate_recipe

    data = recipe.model_dump(mode="json")
    data["name"] = f"{recipe.name}-sweep-{plan.name}"
    # absolute: Tune runs trials in their own working directories
    data["output_dir"] = str(Path(recipe.output_dir).resolve())
    if recipe.tracking.enabled:
        data["tracking"]["uri"] = tracking_uri(recipe.tracking, recipe.output_dir)
    data["model"] = plan.model
    data["train"] |= {"max_steps": plan.steps, "eval_every": plan.steps, "checkpoint_every": plan.steps}
    data["optim"] |= {"lr": plan.lr, "warmup_steps": min(recipe.optim.warmup_steps, max(1, plan.steps // 10))}
    data["tracking"] |= {"parent_run_id": parent_run_id}
    data["sweep"] = {}
    return validate_recipe(data)


def trial_row(
    plan: TrialPlan, ref: CheckpointRef | None, wall: float, status: str, last_loss: float | None
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


def _trainable(config: dict[str, Any], specs: list[tuple[str, str]], data: str, report_every: int) -> None:
    """One Tune trial: a full `run_pretrain`, reporting the training loss every few steps (ASHA's signal)."""
    from ray import tune

    from flows.recipe import Recipe

    # a trial is a fresh one-process run: drop process-group variables inherited from the driver's environment
    # (an in-process run there sets MASTER_PORT to a port its own process group still holds)
    if not torch.distributed.is_initialized():
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(name, None)
    plan_json, recipe_json = specs[config["trial"]]
    plan, recipe = TrialPlan.model_validate_json(plan_json), Recipe.model_validate_json(recipe_json)
    manifest = DatasetManifest.model_validate_json(data)
    last = {"loss": None}

    def report(step: int, loss: float, tokens_per_s: float) -> None:
        last["loss"] = loss
        if step % report_every == 0 and step < plan.steps:
            tune.report({"step": step, "train_loss": loss})

    t0 = time.perf_counter()
    ref = run_pretrain(recipe, manifest, progress=report)
    row = trial_row(plan, ref, time.perf_counter() - t0, "completed", last["loss"])
    atomic_write_json(Path(ref.run_dir) / TRIAL_FILE, row)
    tune.report({"step": plan.steps, "train_loss": last["loss"] or float("nan"), "row": row})


def run_sweep(recipe: Any, data: DatasetManifest, progress: TrialProgress | None = None) -> SweepResult:
    """Run (or resume, or return) the recipe's sweep and write `results.parquet`; see the module docstring."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    sweep = recipe.sweep
    plans, skipped = plan_trials(recipe)
    if not plans:
        raise ValueError(
            "sweep has no trials: set sweep.budgets and sweep.depths"
            + (" (every pair was left out: " + "; ".join(skipped) + ")" if skipped else "")
        )
    key = {"version": SWEEP_VERSION, "sweep": sweep.model_dump(mode="json"), "runs": run_key(recipe, data)}
    sweep_dir = stage_dir(recipe.output_dir, "sweep", recipe.name, key)
    if (sweep_dir / MANIFEST).is_file():
        return SweepResult.load(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    state_path = sweep_dir / "state.json"
    parent = _read_json(state_path).get("mlflow_run_id")
    tags = {"lmforge.stage": "sweep", "lmforge.git": git_revision(), "lmforge.data_digest": data_digest(data)}
    run_id = start_run(recipe.tracking, recipe.output_dir, f"sweep-{recipe.name}", parent, tags)
    atomic_write_json(state_path, {"mlflow_run_id": run_id})
    tracker = make_tracker(recipe.tracking, recipe.output_dir, run_id, rank=0)
    if parent is None:
        tracker.log_params({"sweep": sweep.model_dump(mode="json"), "n_trials": len(plans)})

    rows: dict[str, dict[str, Any]] = {}
    todo = []
    for plan in plans:
        trial = trial_recipe(recipe, plan, run_id)
        run_dir = stage_dir(recipe.output_dir, "pretrain", trial.name, run_key(trial, data))
        done = _read_json(run_dir / TRIAL_FILE) if (run_dir / MANIFEST).is_file() else {}
        if done:
            rows[plan.name] = done | {"wall_seconds": 0.0}  # finished earlier: no time spent now
        else:
            todo.append((plan, trial))
    if progress:
        for row in rows.values():
            progress(len(rows), len(plans), row)

    wall = trial_seconds = 0.0
    if todo:
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
            specs=[(p.model_dump_json(), r.model_dump_json()) for p, r in todo],
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
                callbacks=[_progress_callback(progress, len(rows), len(plans))] if progress else None,
            ),
        )
        t0 = time.perf_counter()
        grid = tuner.fit()
        wall = time.perf_counter() - t0
        for result in grid:
            plan = todo[result.config["trial"]][0]
            metrics = result.metrics or {}
            if "row" in metrics:
                rows[plan.name] = metrics["row"]
                trial_seconds += metrics["row"]["wall_seconds"]
            elif result.error is None:  # stopped by the scheduler
                rows[plan.name] = trial_row(plan, None, 0.0, "stopped", metrics.get("train_loss"))
            else:
                finish_run(recipe.tracking, recipe.output_dir, run_id, status="FAILED")
                raise RuntimeError(f"sweep trial {plan.name} failed: {result.error}") from result.error

    ordered = [rows[p.name] for p in plans]
    table = pa.Table.from_pylist(ordered)
    pq.write_table(table, sweep_dir / RESULTS)
    tracker.log_artifact(sweep_dir / RESULTS)
    completed = [r for r in ordered if r["status"] == "completed"]
    result = SweepResult(
        sweep_dir=str(sweep_dir.resolve()),
        results=str((sweep_dir / RESULTS).resolve()),
        n_trials=len(plans),
        n_completed=len(completed),
        n_stopped=len(ordered) - len(completed),
        skipped=skipped,
        mlflow_run_id=run_id,
        wall_seconds=wall,
        trial_seconds=trial_seconds,
        overhead=wall / (trial_seconds / min(sweep.max_concurrent, len(todo))) if trial_seconds else None,
    )
    summary = {"sweep/completed": len(completed), "sweep/stopped": result.n_stopped, "sweep/wall_s": wall}
    if result.overhead:
        summary["sweep/overhead"] = result.overhead
    tracker.log_metrics(summary, step=0)
    atomic_write_json(sweep_dir / MANIFEST, result.model_dump(mode="json"))
    finish_run(recipe.tracking, recipe.output_dir, run_id)
    return result


def _read_json(path: Path) -> dict[str, Any]:
    import json

    return json.loads(path.read_text()) if path.is_file() else {}


def _progress_callback(progress: TrialProgress, done: int, total: int) -> Any:
    """A Tune callback that calls `progress(finished, total, row)` as trials complete."""
    from ray.tune import Callback

    class ProgressCallback(Callback):
        def __init__(self) -> None:
            self.done = done

        def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
            self.done += 1
            progress(self.done, total, (trial.last_result or {}).get("row", {"status": "stopped"}))

    return ProgressCallback()
