"""Stage: the scaling sweep. `run_sweep(spec, data) -> SweepResult` trains the sweep's model sizes as Ray Tune
trials, each a full `run_pretrain`, and writes a results table (one row per (N, D) point) for the scaling fit.

A trial is one size trained for D = C / (6·N) tokens at a budget C; with `sweep.multi_horizon` it is one WSD run
to the largest budget that decays a branch at every smaller budget's token count (OLMo-core's and Marin's
ladders), so one run yields a point per budget. The batch grows with the run's tokens and warmup is a share of
the shortest horizon (`run_shape`, also used to size the rung). Every trial is an ordinary cached pretraining
step (nested in MLflow under the sweep's run): the sweep asks the step protocol which trials are finished, so a
rerun skips them and resumes interrupted ones; the sweep itself is a cached step too. The only module that
imports `ray.tune`.
"""

from __future__ import annotations

import itertools
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
from infra.cores import cores_each, parallel_cores
from infra.environment import environment
from infra.errors import Preempted
from infra.object_store import is_remote
from infra.ray_cluster import ensure_ray, quiet_exits_in_callbacks
from infra.steps import Artifact, Step, run_step
from infra.storage import atomic_write_json
from infra.tracking import tracked_run, tracking_uri
from training.config import PretrainSpec, SweepConfig, SweepSpec
from training.loop import TrainingHalted
from training.model.accounting import count_parameters
from training.optim.optimizers import decay_start
from training.preemption import STOP_FILE, stop_file_on_signals
from training.sizing import RunShape, count_n, run_shape, sized_model
from training.stages.lifecycle import TrainedModel, read_metrics, training_step
from training.stages.pretrain import PRETRAIN, run_pretrain

log = logging.getLogger(__name__)
SWEEP_VERSION = 3
RESULTS = "results.parquet"
TrialProgress = Callable[[int, int, dict[str, Any]], None]  # (finished, total, row)


class TrialPlan(BaseModel):
    """One run: a model size trained for D = C / (6·N) tokens at its largest budget C (rounded to whole steps),
    decaying a branch at each smaller budget's D when the sweep is multi-horizon."""

    model_config = ConfigDict(frozen=True)

    budgets: list[float]  # one point per budget, ascending; the last is the run's own horizon
    depth: int
    width: int
    lr: float
    seed: int = 0  # train.seed: a replica's initialisation and data order
    n_active: int  # N under the sweep's parameter-count convention (what 6·N·D counts)
    n_total: int
    shape: RunShape  # batch, steps per budget, warmup
    decay_fraction: float  # WSD's share of each horizon spent decaying
    model: dict[str, Any]

    @property
    def steps(self) -> list[int]:
        return self.shape.steps

    @property
    def batch(self) -> int:
        return self.shape.batch

    @property
    def tokens_per_step(self) -> int:
        return self.shape.tokens_per_step

    @property
    def flops(self) -> float:
        """FLOPs the run spends: its full horizon plus every decay branch."""
        decay = [s - decay_start(s, self.decay_fraction) for s in self.steps[:-1]]
        return 6.0 * self.n_active * self.tokens_per_step * (self.steps[-1] + sum(decay))

    @property
    def name(self) -> str:
        name = f"C{self.budgets[-1]:.3g}-d{self.depth}w{self.width}-lr{self.lr:g}".replace("+", "")
        return name + (f"-seed{self.seed}" if self.seed else "")


class SweepResult(Artifact):
    """A finished sweep (`path` is its directory)."""

    results: str  # the Parquet table, one row per (run, horizon)
    n_trials: int
    n_completed: int
    n_stopped: int  # not completed: stopped early by ASHA, or diverged
    n_points: int  # completed (N, D) points: several per run when multi-horizon
    flops: float  # FLOPs the completed runs spent
    points_per_flop_gain: float  # (points / FLOPs) over a one-point-per-run design's (points / FLOPs)
    skipped: list[str]  # (budget, size) pairs left out, with the reason
    warnings: list[str] = []  # data-constrained runs (more epochs than sweep.max_epochs)
    mlflow_run_id: str | None
    wall_seconds: float  # Tuner.fit() wall time
    trial_seconds: float  # sum of the trials' own run_pretrain times (this invocation only)
    overhead: float | None  # wall / (trial_seconds / concurrency); None when nothing ran

    @property
    def sweep_dir(self) -> str:
        return self.path


def plan_trials(spec: SweepSpec) -> tuple[list[TrialPlan], list[str]]:
    """The runs: per size (× lr), one multi-horizon run over every budget, or one run per budget; budgets whose
    horizon is shorter than `min_steps`, or whose run's warmup would be more than `max_warmup_share` of it, are left
    out (with the reason)."""
    sweep, base = spec.sweep, spec.base
    if sweep.multi_horizon and base.optim.schedule != "wsd":
        raise ValueError(
            f"sweep.multi_horizon decays WSD branches; set optim.schedule=wsd (it is {base.optim.schedule})"
        )
    budgets = sorted(sweep.budgets)
    groups = [budgets] if sweep.multi_horizon else [[b] for b in budgets]
    plans, skipped = [], []
    for size in sweep.all_sizes():
        model = sized_model(base.model, size.depth, size.width)
        n = count_n(model, sweep.param_count)
        for group in groups:
            shape = run_shape(base, sweep, n, group)
            where = f"at depth {size.depth} width {model.d_model} (N={n:,})"
            kept = [(c, st) for c, st in zip(group, shape.steps, strict=True) if st >= sweep.min_steps]
            skipped += [
                f"budget {c:.3g} FLOPs {where}: {st} steps < sweep.min_steps={sweep.min_steps}; raise the "
                "budget or drop the size"
                for c, st in zip(group, shape.steps, strict=True)
                if st < sweep.min_steps
            ]
            while kept and (shape := run_shape(base, sweep, n, [c for c, _ in kept])).warmup > (
                sweep.max_warmup_share * kept[0][1]
            ):  # the shortest horizon sets the warmup: without it, the next one may keep it
                c, st = kept.pop(0)
                skipped.append(
                    f"budget {c:.3g} FLOPs {where}: warmup {shape.warmup} steps is over "
                    f"sweep.max_warmup_share={sweep.max_warmup_share:g} of its {st} steps; raise the budget, "
                    "lower sweep.min_warmup_steps or drop the size"
                )
            if not kept:
                continue
            seeds = size.seeds or sweep.seeds or [base.train.seed]
            for lr, seed in itertools.product(sweep.lrs or [base.optim.lr], seeds):
                plans.append(
                    TrialPlan(
                        budgets=[c for c, _ in kept],
                        depth=size.depth,
                        width=model.d_model,
                        lr=lr,
                        seed=seed,
                        n_active=n,
                        n_total=count_parameters(model).total,
                        shape=shape,
                        decay_fraction=base.optim.decay_fraction,
                        model=model.model_dump(mode="json"),
                    )
                )
    return plans, skipped


def trial_spec(spec: SweepSpec, plan: TrialPlan, parent_run_id: str | None) -> PretrainSpec:
    """One trial's pretraining spec: its size, batch, horizons (the schedule spans exactly its steps), warmup and
    learning rate. Paths and the tracking store are absolute: Tune runs trials in their own working directories."""
    base = spec.base
    changes: dict[str, Any] = {
        "name": f"{spec.name}-sweep-{plan.name}",
        "output_dir": spec.output_dir if is_remote(spec.output_dir) else str(Path(spec.output_dir).resolve()),
        "model": plan.model,
        **plan.shape.overrides(plan.lr),
        "train.max_steps": plan.steps[-1],
        "train.horizons": plan.steps[:-1],
        "train.eval_every": -(-plan.steps[-1] // spec.sweep.curve_points),  # the validation curve
        "train.checkpoint_every": plan.steps[-1],
        "train.seed": plan.seed,
        "probe": spec.sweep.probe,
        "tracking.parent_run_id": parent_run_id,
    }
    if base.tracking.enabled:
        changes["tracking.uri"] = tracking_uri(base.tracking, spec.output_dir)
    return override(base, changes)


def trial_rows(
    plan: TrialPlan,
    ref: TrainedModel | None,
    wall: float,
    status: str,
    last_loss: float | None,
    train_tokens: int,
) -> list[dict]:
    """One row per horizon of a run: (N, D, C) and the final validation loss (what the fits use), plus the
    probe's task metrics when measured."""
    metrics = read_metrics(Path(ref.run_dir)) if ref else []
    speed = [m["perf/tokens_per_s"] for m in metrics if "perf/tokens_per_s" in m][1:]  # first step warms up
    ends = {int(m["horizon/steps"]): m for m in metrics if "horizon/steps" in m}
    final = {}
    for m in metrics:  # the last evaluation at the run's own horizon
        if m.get("step") == plan.steps[-1] and "val/loss" in m:
            final = {f"horizon/{k.replace('/', '_')}": v for k, v in m.items() if k != "step"}
    ends[plan.steps[-1]] = final
    rows = []
    for budget, steps in zip(plan.budgets, plan.steps, strict=True):
        end = ends.get(steps, {})
        tokens = steps * plan.tokens_per_step
        rows.append(
            {
                "budget": budget,
                "depth": plan.depth,
                "width": plan.width,
                "lr": plan.lr,
                "seed": plan.seed,
                "N": plan.n_active,
                "N_total": plan.n_total,
                "D": tokens,
                "C": 6.0 * plan.n_active * tokens,
                "steps": steps,
                "batch": plan.batch,
                "warmup": plan.shape.warmup,
                "epochs": tokens / train_tokens if train_tokens else None,
                "loss": end.get("horizon/val_loss") if ref else None,
                "task_loss": end.get("horizon/probe_bpb"),
                "final_train_loss": last_loss if steps == plan.steps[-1] else None,
                "tokens_per_s": sum(speed) / len(speed) if speed else None,
                "wall_seconds": wall if steps == plan.steps[-1] else 0.0,
                "run_flops": plan.flops if steps == plan.steps[-1] else 0.0,
                "status": status,
                "run_dir": ref.run_dir if ref else None,
                "mlflow_run_id": ref.mlflow_run_id if ref else None,
            }
        )
    return rows


def _last_train_loss(run_dir: str) -> float | None:
    losses = [m["train/loss"] for m in read_metrics(run_dir) if "train/loss" in m]
    return losses[-1] if losses else None


def _trainable(
    config: dict[str, Any], specs: list[tuple[str, str]], data: str, report_every: int, stop_file: str
) -> None:
    """One Tune trial: a full `run_pretrain`, reporting the training loss every few steps (ASHA's signal). When the
    driver is asked to stop, it creates `stop_file`: the run checkpoints after its current step and ends."""
    from ray import tune

    quiet_exits_in_callbacks()
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
        if step % report_every == 0 and step < plan.steps[-1]:
            tune.report({"step": step, "train_loss": loss})

    t0 = time.perf_counter()
    train_tokens = manifest.splits["train"].n_tokens
    os.environ[STOP_FILE] = stop_file  # the loop checks it after every step (signals reach the driver only)
    if Path(stop_file).exists():  # asked to stop before this trial started: leave it to the rerun
        tune.report({"step": 0, "train_loss": float("nan"), "preempted": "not started"})
        return
    try:
        ref = run_pretrain(spec, manifest, progress=report)
    except Preempted as stopped:
        tune.report({"step": 0, "train_loss": last["loss"] or float("nan"), "preempted": str(stopped)})
        return
    except TrainingHalted as halted:  # diverged: a row without a loss, kept out of the fits
        log.warning("sweep trial %s diverged: %s", plan.name, halted)
        rows = trial_rows(plan, None, time.perf_counter() - t0, "diverged", last["loss"], train_tokens)
    else:
        rows = trial_rows(plan, ref, time.perf_counter() - t0, "completed", last["loss"], train_tokens)
    tune.report({"step": plan.steps[-1], "train_loss": last["loss"] or float("nan"), "rows": rows})


def planned_trials(spec: SweepSpec) -> tuple[list[TrialPlan], list[str]]:
    """`plan_trials`, refused in one line where it leaves no trial (the pipeline checks it before anything runs)."""
    plans, skipped = plan_trials(spec)
    if not plans:
        raise ValueError(
            "sweep has no trials: set sweep.budgets and sweep.depths"
            + (" (every pair was left out: " + "; ".join(skipped) + ")" if skipped else "")
        )
    return plans, skipped


def run_sweep(spec: SweepSpec, data: DatasetManifest, progress: TrialProgress | None = None) -> SweepResult:
    """Run (or resume, or return) the sweep and write `results.parquet`; see the module docstring."""
    plans, skipped = planned_trials(spec)
    # what the fit does with the sweep, and how many trials run at once, do not change its results
    execution = {"target_budget", "rung_multiple", "law_form", "bootstrap_resamples", "max_concurrent"}
    config = {
        "sweep": spec.sweep.model_dump(mode="json", exclude=execution),
        "runs": spec.base.key(),
    }
    step = Step("sweep", spec.name, SWEEP_VERSION, config, SweepResult, {"data": data})
    return run_step(
        spec.output_dir, step, lambda out, key: _sweep(spec, data, plans, skipped, out, progress, key)
    )


def _sweep(
    spec: SweepSpec,
    data: DatasetManifest,
    plans: list[TrialPlan],
    skipped: list[str],
    sweep_dir: Path,
    progress: TrialProgress | None,
    key: str = "",
) -> SweepResult:
    state_path = sweep_dir / "state.json"
    parent = json.loads(state_path.read_text()).get("mlflow_run_id") if state_path.is_file() else None
    tags = {"lmforge.stage": "sweep", "lmforge.config_digest": key, "lmforge.data_digest": data.digest()}
    with tracked_run(spec.tracking, spec.output_dir, f"sweep-{spec.name}", tags, parent) as run:
        atomic_write_json(state_path, {"mlflow_run_id": run.run_id})
        tracker = run.tracker()
        if parent is None:
            tracker.log_params({"sweep": spec.sweep.model_dump(mode="json"), "n_trials": len(plans)})
        rows: dict[str, list[dict[str, Any]]] = {}
        todo = []
        train_tokens = data.splits["train"].n_tokens
        for plan in plans:
            trial = trial_spec(spec, plan, run.run_id)
            done = training_step(PRETRAIN, trial, {"data": data}).finished(spec.output_dir)
            if done is not None:  # finished earlier: no time spent now
                last = _last_train_loss(done.path)
                rows[plan.name] = trial_rows(plan, done, 0.0, "completed", last, train_tokens)
            else:
                todo.append((plan, trial))
        if progress:
            for done, done_rows in enumerate(rows.values(), start=1):
                progress(done, len(plans), done_rows[-1])
        concurrency = concurrent_trials(spec.sweep, len(todo))
        log.info(
            "sweep: %d trial(s) at once (sweep.max_concurrent=%s)", concurrency, spec.sweep.max_concurrent
        )
        todo = [(plan, shared_cores(trial, concurrency)) for plan, trial in todo]
        wall, trial_seconds = _run_trials(
            spec.sweep, concurrency, todo, data, rows, progress, len(plans), sweep_dir
        )
        missing = [p.name for p in plans if p.name not in rows]
        if missing:  # Tune stops gracefully on Ctrl-C; hand the interrupt back to the caller
            raise KeyboardInterrupt(f"sweep interrupted: trials {missing} did not finish")
        ordered = [row for p in plans for row in rows[p.name]]
        pq.write_table(pa.Table.from_pylist(ordered), sweep_dir / RESULTS)
        tracker.log_artifact(sweep_dir / RESULTS)
        result = _summarise(
            spec, plans, rows, skipped, sweep_dir, run.run_id, wall, trial_seconds, concurrency
        )
        summary = {
            "sweep/completed": result.n_completed,
            "sweep/stopped": result.n_stopped,
            "sweep/points": result.n_points,
            "sweep/points_per_flop_gain": result.points_per_flop_gain,
            "sweep/wall_s": wall,
        }
        if result.overhead:
            summary["sweep/overhead"] = result.overhead
        tracker.log_metrics(summary, step=0)
        for warning in result.warnings:
            log.warning("%s", warning)
    return result


def _summarise(
    spec: SweepSpec,
    plans: list[TrialPlan],
    rows: dict[str, list[dict[str, Any]]],
    skipped: list[str],
    sweep_dir: Path,
    run_id: str | None,
    wall: float,
    trial_seconds: float,
    concurrency: int,
) -> SweepResult:
    """Counts, the multi-horizon gain (points per FLOP against one run per point) and data-constraint warnings."""
    completed = [p for p in plans if rows[p.name][-1]["status"] == "completed"]
    points = [r for p in completed for r in rows[p.name] if r["loss"] is not None]
    flops = sum(p.flops for p in completed)
    one_per_point = sum(r["C"] for r in points)  # each point trained by its own run
    warnings = [
        f"{p.name}: {rows[p.name][-1]['epochs']:.1f} epochs over the training tokens (> sweep.max_epochs="
        f"{spec.sweep.max_epochs:g}): a data-constrained point; add data or lower the budgets"
        for p in completed
        if (rows[p.name][-1]["epochs"] or 0) > spec.sweep.max_epochs
    ]
    return SweepResult(
        path=str(sweep_dir.resolve()),
        results=str((sweep_dir / RESULTS).resolve()),
        n_trials=len(plans),
        n_completed=len(completed),
        n_stopped=len(plans) - len(completed),
        n_points=len(points),
        flops=flops,
        points_per_flop_gain=one_per_point / flops if flops else 0.0,
        skipped=skipped,
        warnings=warnings,
        mlflow_run_id=run_id,
        wall_seconds=wall,
        trial_seconds=trial_seconds,
        overhead=wall / (trial_seconds / concurrency) if trial_seconds else None,
    )


def concurrent_trials(sweep: SweepConfig, n_trials: int) -> int:
    """Trials to run at once: `sweep.max_concurrent`; under auto, as many as this machine's cores run side by side
    at full pace (`infra.cores.parallel_cores`), `cpus_per_trial` each, on a private local Ray instance; 1 on a
    cluster (`RAY_ADDRESS`) or with GPUs, where it was not measured. Never more than the trials."""
    if sweep.max_concurrent != "auto":
        return min(sweep.max_concurrent, max(1, n_trials))
    if n_trials < 2 or os.environ.get("RAY_ADDRESS") or sweep.gpus_per_trial > 0:
        return 1
    return max(1, min(n_trials, int(parallel_cores() // sweep.cpus_per_trial)))


def shared_cores(trial: PretrainSpec, concurrency: int) -> PretrainSpec:
    """The trial with its share of the machine's cores as its torch threads when trials run side by side (where it
    sets none): a lone trial takes them all (`lifecycle`'s default), and two trials of two threads each on two cores
    ran 4-10x slower than alone (their threads spinning against each other)."""
    if concurrency == 1 or trial.parallel.threads_per_worker is not None:
        return trial
    return override(trial, {"parallel.threads_per_worker": cores_each(concurrency)})


def _run_trials(
    sweep: SweepConfig,
    concurrency: int,
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
    from ray.tune.logger import JsonLoggerCallback
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    ensure_ray(int(concurrency * sweep.cpus_per_trial))
    scheduler = (
        ASHAScheduler(
            time_attr="step",
            max_t=max(p.steps[-1] for p, _ in todo),
            grace_period=sweep.grace_steps,
            reduction_factor=sweep.reduction_factor,
        )
        if sweep.scheduler == "asha"
        else FIFOScheduler()
    )
    stop_file = (sweep_dir / "STOP").resolve()
    trainable = tune.with_parameters(
        _trainable,
        specs=[(p.model_dump_json(), t.model_dump_json()) for p, t in todo],
        data=data.model_dump_json(),
        report_every=sweep.report_every,
        stop_file=str(stop_file),
    )
    # results go to MLflow and results.parquet; of Tune's own logs only the JSON one, which its result grid reads
    # each trial's metrics from (without it, every sweep ended in a warning that no result.json was found)
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": sweep.cpus_per_trial, "gpu": sweep.gpus_per_trial}),
        param_space={"trial": tune.grid_search(list(range(len(todo))))},
        tune_config=tune.TuneConfig(
            metric="train_loss",
            mode="min",
            scheduler=scheduler,
            max_concurrent_trials=concurrency,
            reuse_actors=True,
        ),
        run_config=tune.RunConfig(
            storage_path=str((sweep_dir / "tune").resolve()),
            name=f"sweep-{int(time.time())}",
            verbose=0,
            callbacks=[
                JsonLoggerCallback(),
                *([_progress_callback(progress, len(rows), total)] if progress else []),
            ],
        ),
    )
    t0 = time.perf_counter()
    with (
        environment(TUNE_DISABLE_SIGINT_HANDLER="1"),  # Ctrl-C too: the trials checkpoint rather than die
        stop_file_on_signals(
            stop_file, "the sweep's running trials (those not started wait for the rerun)"
        ) as stop,
    ):
        grid = tuner.fit()
    wall, trial_seconds = time.perf_counter() - t0, 0.0
    stopped = []
    for result in grid:
        plan = todo[result.config["trial"]][0]
        metrics = result.metrics or {}
        if "preempted" in metrics or (stop.signal and "rows" not in metrics):
            stopped.append(plan.name)
        elif "rows" in metrics:
            rows[plan.name] = metrics["rows"]
            trial_seconds += metrics["rows"][-1]["wall_seconds"]
        elif result.error is None:  # stopped by the scheduler
            rows[plan.name] = trial_rows(plan, None, 0.0, "stopped", metrics.get("train_loss"), 0)
        else:
            raise RuntimeError(f"sweep trial {plan.name} failed: {result.error}") from result.error
    # a signal after the last trial finished stops nothing
    if stop.signal is not None and len(rows) < total:
        raise Preempted(
            f"{stop.signal}: the sweep stopped with {len(rows)} of {total} trials finished; "
            f"{', '.join(stopped) or 'none'} stopped at a checkpoint; rerun the same command to resume them"
        )
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
                rows = (trial.last_result or {}).get("rows", [{"status": "stopped"}])
                self.progress(self.done, self.total, rows[-1])

    return ProgressCallback(progress, done, total)
