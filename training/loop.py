"""The one training loop, shared by every training stage: they differ only in the batches they feed it.

Each optimiser step draws `accumulation_steps` micro-batches and runs them through the `Engine` under the
stage's `Objective` (token cross-entropy unless a stage says otherwise). The loss is the step's global mean:
each micro-batch's mean is weighted by its share of the units (loss-carrying tokens) across all micro-batches and
ranks (`loss_scale`), so SFT batches with few response tokens weigh less (not a mean of means); in pretraining
every weight is exactly 1. A micro-batch whose loss is not finite on any
rank is not back-propagated (a zero loss keeps the ranks' collectives in step) and the step is taken at learning
rate 0, so weights stay bit-identical; such steps are counted, and the run stops after `max_bad_steps` in a
row. (Adam's moments still decay once on a skipped step.) A non-finite gradient norm after a step cannot be
undone and stops the run at once. Phases: eval, step, log, checkpoint.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from data_pipeline.loader import Batch
from infra.tracking import Tracker
from training import checkpoint as ckpt
from training.config import OptimConfig, TrainConfig
from training.engine import Engine, loss_scale
from training.moe import RouterStats
from training.objective import Objective, TokenCrossEntropy
from training.optim import lr_at

log = logging.getLogger(__name__)


class TrainingHalted(RuntimeError):
    """The run cannot continue (non-finite losses or gradients); the message says what and where to resume."""


class Batches(Protocol):
    def next_batch(self) -> Batch: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class LoopState:
    """Counters that must survive a resume (saved in each checkpoint's meta.json)."""

    step: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    consecutive_bad: int = 0


@dataclass(frozen=True)
class LoopSetup:
    """Everything the loop needs besides the engine and data."""

    run_dir: Path
    rank: int
    world_size: int
    flops_per_token: int
    peak_flops: float  # per device
    meta: dict[str, Any]  # written into every checkpoint (config digest, MLflow run id, ...)
    progress: Callable[[int, float, float], None] | None = None  # (step, loss, tokens/s), rank 0


def all_reduce_sum(value: Tensor) -> Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value)
    return value


def all_reduce_mean(value: Tensor) -> Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        return all_reduce_sum(value) / dist.get_world_size()
    return value


def zero_loss(module: torch.nn.Module) -> Tensor:
    """A loss of exactly 0 that reaches every parameter, so backward hooks fire as on a real micro-batch."""
    return sum(p.sum() * 0.0 for p in module.parameters() if p.requires_grad)


def router_metrics(stats: list[RouterStats]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for layer, s in enumerate(stats):
        counts = s.tokens_per_expert.float()
        metrics[f"moe/layer{layer}/load_cv"] = float(counts.std() / counts.mean().clamp_min(1e-9))
        metrics[f"moe/layer{layer}/max_expert_fraction"] = float(counts.max() / counts.sum().clamp_min(1))
        metrics[f"moe/layer{layer}/aux_loss"] = float(s.aux_loss.detach())
        metrics[f"moe/layer{layer}/z_loss"] = float(s.z_loss.detach())
    return metrics


@torch.no_grad()
def evaluate(engine: Engine, batches: Iterator[Batch], objective: Objective) -> float:
    """The objective's mean over every unit of `batches` on all ranks."""
    engine.train(False)
    total = torch.zeros(2, dtype=torch.float64, device=engine.device)  # (sum of losses, units)
    for batch in batches:
        # on every rank, even without units: ZeRO-3's forward is a collective
        outcome = objective(engine, batch)
        n = objective.units(batch)
        if n:
            total += torch.stack([outcome.loss.double() * n, total.new_tensor(float(n))])
    engine.train(True)
    total = all_reduce_sum(total)
    return float(total[0] / total[1]) if total[1] else float("nan")


def train_loop(
    engine: Engine,
    train: Batches,
    val: Callable[[], Iterator[Batch]] | None,
    cfg: TrainConfig,
    optim: OptimConfig,
    setup: LoopSetup,
    tracker: Tracker,
    state: LoopState,
    objective: Objective | None = None,
) -> LoopState:
    """Run optimiser steps from `state.step` to `cfg.max_steps`; checkpoints land in `<run_dir>/checkpoints`."""
    objective = objective or TokenCrossEntropy()
    accumulation = engine.accumulation_steps
    tokens_per_step = cfg.global_batch(setup.world_size) * cfg.seq_len
    metrics_file = setup.run_dir / "metrics.jsonl"
    checkpoints = setup.run_dir / "checkpoints"

    def log(metrics: dict[str, float], step: int) -> None:
        if setup.rank == 0:
            tracker.log_metrics(metrics, step)
            with metrics_file.open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")

    while state.step < cfg.max_steps:
        # --- eval
        if val is not None and state.step % cfg.eval_every == 0:
            log({"val/loss": evaluate(engine, val(), objective)}, state.step)

        # --- step
        started = time.perf_counter()
        lr = lr_at(state.step, optim, cfg.max_steps)
        micro_batches = [train.next_batch() for _ in range(accumulation)]
        counts = [objective.units(batch) for batch in micro_batches]
        n_global = int(all_reduce_sum(torch.tensor(sum(counts), dtype=torch.float64, device=engine.device)))
        losses, bad = [], False
        stats: list[RouterStats] = []
        extra: dict[str, list[Tensor]] = {}
        for batch, n in zip(micro_batches, counts, strict=True):
            outcome = objective(engine, batch)
            weight = loss_scale(n, n_global, accumulation, setup.world_size) if n else 0.0
            weighted = outcome.loss * weight if n else zero_loss(engine.module)
            loss = weighted + outcome.aux_loss
            finite = all_reduce_mean(torch.isfinite(loss.detach()).float().to(engine.device)) == 1.0
            if finite:
                engine.backward(loss)
                losses.append(weighted.detach().float())
                stats = outcome.router_stats
                for name, value in outcome.metrics.items():
                    extra.setdefault(name, []).append(value.detach().float())
            else:
                bad = True
                engine.backward(zero_loss(engine.module))
        # the step happens either way (ranks stay in lockstep); at learning rate 0 it moves no weight
        grad_norm = engine.step(0.0 if bad else lr)
        state.step += 1
        state.tokens += tokens_per_step
        elapsed = time.perf_counter() - started

        # --- log
        if bad:
            state.skipped_steps += 1
            state.consecutive_bad += 1
            log({"train/skipped_steps": state.skipped_steps}, state.step)
            if state.consecutive_bad >= cfg.max_bad_steps:
                raise TrainingHalted(
                    f"{state.consecutive_bad} consecutive steps had a non-finite loss (last at step {state.step}); "
                    f"lower optim.lr or check the data; the last good checkpoint is {ckpt.latest_checkpoint(checkpoints)}"
                )
        else:
            state.consecutive_bad = 0
            if not torch.isfinite(torch.tensor(grad_norm)):
                raise TrainingHalted(
                    f"non-finite gradient norm at step {state.step}: the weights are no longer usable; resume from "
                    f"{ckpt.latest_checkpoint(checkpoints)} with a lower optim.lr or a smaller optim.grad_clip"
                )
            loss = float(all_reduce_mean(torch.stack(losses).mean())) if losses else float("nan")
            tokens_per_s = tokens_per_step / elapsed
            metrics = {
                "train/loss": loss,
                "train/lr": lr,
                "train/grad_norm": grad_norm,
                "perf/tokens_per_s": tokens_per_s,
                "perf/mfu": setup.flops_per_token * tokens_per_s / (setup.peak_flops * setup.world_size),
                "train/tokens": float(state.tokens),
                **router_metrics(stats),
                **{
                    name: float(all_reduce_mean(torch.stack(values).mean())) for name, values in extra.items()
                },
            }
            log(metrics, state.step)
            if setup.progress is not None and setup.rank == 0:
                setup.progress(state.step, loss, tokens_per_s)

        # --- checkpoint
        if state.step % cfg.checkpoint_every == 0 or state.step == cfg.max_steps:
            save_checkpoint(engine, train, setup, state, cfg.keep_checkpoints)

    if val is not None:
        log({"val/loss": evaluate(engine, val(), objective)}, state.step)
    return state


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save_checkpoint(engine: Engine, train: Batches, setup: LoopSetup, state: LoopState, keep: int) -> Path:
    """All ranks write into a staging directory; rank 0 renames it into place and marks it complete."""
    root = setup.run_dir / "checkpoints"
    if setup.rank == 0:
        ckpt.prepare_staging(root, state.step)
    barrier()
    staging = ckpt.staging_dir(root, state.step)
    engine.save(staging)
    ckpt.save_rank_state(staging, setup.rank, train.state_dict())
    barrier()
    if setup.rank == 0:
        ckpt.commit(root, state.step, {**setup.meta, "loop": asdict(state)}, keep)
    barrier()
    return ckpt.step_dir(root, state.step)


def resume(engine: Engine, train: Batches, setup: LoopSetup) -> LoopState:
    """Load the newest complete checkpoint, if any: engine, RNG, loader position and loop counters."""
    latest = ckpt.latest_checkpoint(setup.run_dir / "checkpoints")
    if latest is None:
        return LoopState()
    engine.load(latest)
    rank_state = ckpt.load_rank_state(latest, setup.rank)
    ckpt.set_rng_state(rank_state["rng"])
    train.load_state_dict(rank_state["loader"])
    state = LoopState(**ckpt.read_meta(latest)["loop"])
    log.info("resumed from %s at step %d", latest, state.step)
    return state
