"""The one training loop, shared by every training stage: they differ only in the batches they feed it.

Each optimiser step draws `accumulation_steps` micro-batches and runs them through the `Engine` under the
stage's `Objective` (token cross-entropy unless a stage says otherwise). The loss is the step's global mean:
each micro-batch's mean is weighted by its share of the units (loss-carrying tokens) across all micro-batches and
ranks (`loss_scale`), so SFT batches with few response tokens weigh less (not a mean of means); in pretraining
every weight is exactly 1. A micro-batch whose loss is not finite on any
rank is not back-propagated (a zero loss keeps the ranks' collectives in step) and the step is taken at learning
rate 0, so weights stay bit-identical; such steps are counted, and the run stops after `max_bad_steps` in a
row. (Adam's moments still decay once on a skipped step.) A non-finite gradient norm after a step cannot be
undone and stops the run at once. A loss spike (`spike_limit`) is skipped like a non-finite loss and counts toward
the roll-back. A gradient-norm spike (same rule over the norms) is counted and logged only: its update is already
applied when the norm is known (DeepSpeed's ZeRO optimisers compute it inside their step), and at 6σ healthy
small-model runs have several (30 in 12 of the 156 runs of one test-suite run, none a loss spike): too many to act on.
Phases: eval,
(decay branch), step, log, checkpoint. With `train.horizons` a WSD run also decays a branch to each shorter horizon
and restores its stable state (`decay_branch`). A step is guarded by the hang watchdog (`training/watchdog.py`);
SIGTERM/SIGINT end the run with a checkpoint at the next step boundary (`training/preemption.py`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from data_pipeline.loader import Batch
from infra import mirror
from infra.errors import Preempted
from infra.object_store import Store
from infra.tracking import Tracker
from training import checkpoint as ckpt
from training import remote_checkpoint
from training.config import OptimConfig, TrainConfig, describe_layout
from training.engine import Engine, loss_scale
from training.model.moe import RouterStats
from training.objective import Objective, TokenCrossEntropy
from training.optim.optimizers import decay_start, lr_at
from training.preemption import StopRequest, stop_on_signals
from training.watchdog import Watchdog

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
    spikes: int = 0
    # the losses and gradient norms of the last `train.spike_window` accepted steps (the spike detector's windows)
    recent_losses: list[float] = field(default_factory=list)
    recent_grad_norms: list[float] = field(default_factory=list)
    grad_spikes: int = 0
    # the steps of the spikes within the last `train.rollback_window` steps, and the roll-backs so far
    spike_steps: list[int] = field(default_factory=list)
    rollbacks: int = 0


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
    probe: Callable[[torch.nn.Module], dict[str, float]] | None = None  # metrics at each final evaluation
    remote: Store | None = None  # the run directory on object storage: checkpoints are mirrored there


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


@dataclass
class StepOutcome:
    """One optimiser step: its global mean loss (None when skipped), gradient norm and extra metrics; `spike` is
    the loss of the micro-batch that made it a skipped spike."""

    loss: float | None
    grad_norm: float
    metrics: dict[str, float]
    spike: float | None = None
    local_s: float = 0.0  # this rank's own work: drawing the micro-batches and the forward passes


def spike_limit(recent: list[float], cfg: TrainConfig) -> float | None:
    """The loss above which a micro-batch is a spike: the recent accepted steps' mean plus `spike_sigmas` standard
    deviations, and at least `spike_min_rise` above the mean (OLMo-core's skip-step rule, with a floor for flat
    curves); None while fewer than half of `spike_window` steps are known, or with `spike_window` 0."""
    if cfg.spike_window == 0 or len(recent) < max(2, cfg.spike_window // 2):
        return None
    window = torch.tensor(recent[-cfg.spike_window :], dtype=torch.float64)
    mean, std = float(window.mean()), float(window.std(correction=0))
    return max(mean + cfg.spike_sigmas * std, mean * (1 + cfg.spike_min_rise))


def optimizer_step(
    engine: Engine,
    train: Batches,
    objective: Objective,
    lr: float,
    world_size: int,
    spike_above: float | None = None,
) -> StepOutcome:
    """Draw `accumulation_steps` micro-batches, back-propagate each at its share of the global units, step. A
    micro-batch whose loss (its mean over the ranks) exceeds `spike_above` is not back-propagated and the step is
    taken at learning rate 0, as for a non-finite loss."""
    accumulation = engine.accumulation_steps
    started = time.perf_counter()
    micro_batches = [train.next_batch() for _ in range(accumulation)]
    local_s = time.perf_counter() - started
    counts = [objective.units(batch) for batch in micro_batches]
    n_global = int(all_reduce_sum(torch.tensor(sum(counts), dtype=torch.float64, device=engine.device)))
    losses, bad, spike = [], False, None
    stats: list[RouterStats] = []
    extra: dict[str, list[Tensor]] = {}
    for batch, n in zip(micro_batches, counts, strict=True):
        started = time.perf_counter()
        outcome = objective(engine, batch)
        local_s += time.perf_counter() - started
        weight = loss_scale(n, n_global, accumulation, world_size) if n else 0.0
        weighted = outcome.loss * weight if n else zero_loss(engine.module)
        loss = weighted + outcome.aux_loss
        # one collective that every rank enters (a rank whose micro-batch carries no loss too): how many ranks
        # are finite, the sum of the losses and how many ranks have one
        checks = [
            torch.isfinite(loss.detach()).float(),
            outcome.loss.detach().float() if n else 0.0,
            float(n > 0),
        ]
        finite_ranks, loss_sum, loss_ranks = all_reduce_sum(
            torch.stack([torch.as_tensor(c, device=engine.device) for c in checks])
        ).tolist()
        finite = finite_ranks == (dist.get_world_size() if dist.is_initialized() else 1)
        if finite and spike_above is not None and loss_ranks and loss_sum / loss_ranks > spike_above:
            finite, spike = False, loss_sum / loss_ranks
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
    if bad:
        return StepOutcome(None, grad_norm, {}, spike, local_s)
    metrics = {
        **router_metrics(stats),
        **{name: float(all_reduce_mean(torch.stack(values).mean())) for name, values in extra.items()},
    }
    loss = float(all_reduce_mean(torch.stack(losses).mean())) if losses else float("nan")
    return StepOutcome(loss, grad_norm, metrics, local_s=local_s)


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
    """Run optimiser steps from `state.step` to `cfg.max_steps`; checkpoints land in `<run_dir>/checkpoints`.
    With `cfg.horizons` (WSD only) the run also decays a branch to each shorter horizon (see `decay_branch`)."""
    objective = objective or TokenCrossEntropy()
    tokens_per_step = cfg.global_batch(setup.world_size) * cfg.seq_len
    metrics_file = setup.run_dir / "metrics.jsonl"
    checkpoints = setup.run_dir / "checkpoints"
    branches = {decay_start(h, optim.decay_fraction): h for h in cfg.horizons if h < cfg.max_steps}
    done = {int(m["horizon/steps"]) for m in read_jsonl(metrics_file) if "horizon/steps" in m}
    if setup.rank == 0:
        end_line(metrics_file)  # a line torn by a crash must not swallow the first record appended now

    def log(metrics: dict[str, float], step: int) -> None:
        if setup.rank == 0:
            tracker.log_metrics(metrics, step)
            with metrics_file.open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")

    def evaluation() -> dict[str, float]:
        metrics = {"val/loss": evaluate(engine, val(), objective)} if val is not None else {}
        if setup.probe is not None:
            engine.train(False)
            metrics |= setup.probe(engine.module)
            engine.train(True)
        return metrics

    pending: PendingCheckpoint | None = None
    local_times: list[float] = []  # this rank's own work per step since the last straggler report
    watchdog = Watchdog(setup.run_dir, setup.rank, cfg.hang_factor, cfg.hang_min_seconds)
    with stop_on_signals() as stop, contextlib.closing(watchdog):
        while state.step < cfg.max_steps:
            # --- eval
            if val is not None and state.step % cfg.eval_every == 0:
                log({"val/loss": evaluate(engine, val(), objective)}, state.step)

            # --- a decay branch to a shorter horizon, from the stable phase
            horizon = branches.get(state.step)
            if horizon is not None and horizon not in done:
                if pending is not None:  # the branch saves and loads a snapshot of its own
                    finish_checkpoint(engine, setup, pending, cfg.keep_checkpoints)
                    pending = None
                metrics = decay_branch(
                    engine, train, objective, optim, setup, state.step, horizon, evaluation
                )
                log(
                    {**metrics, "horizon/steps": horizon, "horizon/tokens": horizon * tokens_per_step},
                    horizon,
                )

            # --- step
            started = time.perf_counter()
            lr = lr_at(state.step, optim, cfg.max_steps)
            limit = spike_limit(state.recent_losses, cfg)
            watchdog.arm(state.step + 1)
            outcome = optimizer_step(engine, train, objective, lr, setup.world_size, limit)
            elapsed = time.perf_counter() - started
            watchdog.disarm(elapsed)
            state.step += 1
            state.tokens += tokens_per_step
            local_times.append(outcome.local_s)
            if cfg.straggler_window and setup.world_size > 1 and state.step % cfg.straggler_window == 0:
                log(straggler_report(local_times, cfg.straggler_factor, state.step, setup.rank), state.step)
                local_times = []

            # --- log
            if outcome.loss is None:
                state.skipped_steps += 1
                state.consecutive_bad += 1
                skipped = {"train/skipped_steps": state.skipped_steps}
                if outcome.spike is not None:
                    state.spikes += 1
                    skipped |= {"train/spikes": state.spikes, "train/spike_loss": outcome.spike}
                    what = f"step {state.step} skipped: a micro-batch's loss {outcome.spike:.4f}"
                    log_spike(what, limit, cfg, train, setup.rank)
                log(skipped, state.step)
            else:
                state.consecutive_bad = 0
                state.recent_losses = (
                    [*state.recent_losses, outcome.loss][-cfg.spike_window :] if cfg.spike_window else []
                )
                check_grad_norm(outcome.grad_norm, state.step, checkpoints)
                norm_limit = spike_limit(state.recent_grad_norms, cfg)
                if norm_limit is not None and outcome.grad_norm > norm_limit:
                    state.grad_spikes += 1
                    spike = {
                        "train/grad_spikes": state.grad_spikes,
                        "train/grad_spike_norm": outcome.grad_norm,
                    }
                    log(spike, state.step)
                    what = f"step {state.step}: the gradient norm {outcome.grad_norm:.4f} (its update is applied)"
                    log_spike(what, norm_limit, cfg, train, setup.rank, logging.DEBUG)
                elif cfg.spike_window:
                    state.recent_grad_norms = [*state.recent_grad_norms, outcome.grad_norm][
                        -cfg.spike_window :
                    ]
                tokens_per_s = tokens_per_step / elapsed
                metrics = {
                    "train/loss": outcome.loss,
                    "train/lr": lr,
                    "train/grad_norm": outcome.grad_norm,
                    "perf/tokens_per_s": tokens_per_s,
                    "perf/step_s": elapsed,
                    "perf/mfu": setup.flops_per_token * tokens_per_s / (setup.peak_flops * setup.world_size),
                    "train/tokens": float(state.tokens),
                    **outcome.metrics,
                }
                log(metrics, state.step)
                if setup.progress is not None and setup.rank == 0:
                    setup.progress(state.step, outcome.loss, tokens_per_s)
            if outcome.spike is not None:  # a skipped loss spike: toward the roll-back
                state.spike_steps = [
                    s for s in [*state.spike_steps, state.step] if s > state.step - cfg.rollback_window
                ]
                if rolls_back(state, cfg):
                    if pending is not None:
                        finish_checkpoint(engine, setup, pending, cfg.keep_checkpoints)
                        pending = None
                    rolled = roll_back(engine, train, setup, state)
                    if rolled is not None:
                        log(
                            {"train/rollbacks": rolled.rollbacks, "train/rollback_to": rolled.step},
                            state.step,
                        )
                        state = rolled
                        continue
            if outcome.loss is None and state.consecutive_bad >= cfg.max_bad_steps:
                what = "a loss spike" if outcome.spike is not None else "a non-finite loss"
                raise TrainingHalted(
                    f"{state.consecutive_bad} consecutive steps were skipped (the last for {what}, at step "
                    f"{state.step}); lower optim.lr or check the data (a lasting rise is not a spike: raise "
                    f"train.spike_sigmas or set train.spike_window=0); the last good checkpoint is "
                    f"{ckpt.latest_checkpoint(checkpoints)}"
                )

            # --- checkpoint (with async_checkpoint the previous one is completed first, this one at the next);
            # a stop request (SIGTERM, SIGINT) checkpoints now, waits for it, and ends the run
            stopping = stop_requested(stop, setup.world_size, engine.device)
            if state.step % cfg.checkpoint_every == 0 or state.step == cfg.max_steps or stopping:
                tracker.flush()  # a resume from this checkpoint never re-logs what went before it: it must be sent
                if pending is not None:
                    finish_checkpoint(engine, setup, pending, cfg.keep_checkpoints)
                pending = start_checkpoint(engine, train, setup, state)
                if not cfg.async_checkpoint or stopping:
                    written = finish_checkpoint(engine, setup, pending, cfg.keep_checkpoints)
                    pending = None
                if stopping:
                    raise Preempted(
                        f"{stop.reason()} at step {state.step}: training stopped after writing the checkpoint "
                        f"{written}; rerun the same command to resume from it"
                    )

    if pending is not None:
        finish_checkpoint(engine, setup, pending, cfg.keep_checkpoints)
    final = evaluation()
    if final:
        log(final, state.step)
    return state


def stop_requested(stop: StopRequest, world_size: int, device: torch.device) -> bool:
    """Whether to stop after this step; with a stop file and several ranks, all ranks agree (a collective)."""
    asked = stop.reason() is not None
    if stop.file is not None and world_size > 1:
        asked = bool(all_reduce_sum(torch.tensor(float(asked), device=device)) > 0)
        if asked and stop.signal is None:
            stop.by_file()
    return asked


def straggler_report(local_times: list[float], factor: float, step: int, rank: int) -> dict[str, float]:
    """All ranks: compare the ranks' median local work per step over the window; the slowest rank's ratio to the
    median rank, and on rank 0 a warning naming it (and its host) when that ratio reaches `factor`. A collective."""
    mine = (float(torch.tensor(local_times).median()) if local_times else 0.0, socket.gethostname())
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    medians = [seconds for seconds, _ in everyone]
    slowest = max(range(len(medians)), key=medians.__getitem__)
    typical = float(torch.tensor(medians).median())
    ratio = medians[slowest] / typical if typical > 0 else 1.0
    if rank == 0 and ratio >= factor:
        log.warning(
            "rank %d (%s) is a straggler: its own work per step (micro-batches and forward passes) took %.1fx "
            "the median rank's (%.3f s vs %.3f s) over the %d steps to step %d; check that node's load and data",
            slowest,
            everyone[slowest][1],
            ratio,
            medians[slowest],
            typical,
            len(local_times),
            step,
        )
    return {"perf/straggler_ratio": ratio, "perf/slowest_rank": float(slowest)}


MAX_ROLLBACKS = 10  # per run: a run that keeps spiking after this many roll-backs stops (TrainingHalted)


def roll_back(engine: Engine, train: Batches, setup: LoopSetup, state: LoopState) -> LoopState | None:
    """Reload the newest checkpoint written before the first recent spike (weights, optimiser, RNG, counters) and
    keep the loader where it is, so the batches trained since that checkpoint are skipped; None (and a warning)
    when no such checkpoint is complete on every rank. Every rank decides alike: spikes are collective."""
    checkpoints = setup.run_dir / "checkpoints"
    if state.rollbacks >= MAX_ROLLBACKS:
        raise TrainingHalted(
            f"{state.rollbacks} roll-backs did not stop the loss spikes (the last at step {state.step}); lower "
            f"optim.lr or check the data; the last good checkpoint is {ckpt.latest_checkpoint(checkpoints)}"
        )
    first = state.spike_steps[0]
    before = [(step, path) for step, path in ckpt.complete_checkpoints(checkpoints) if step < first]
    target = max(before)[0] if before else -1
    if dist.is_initialized() and dist.get_world_size() > 1:  # every rank must hold the same checkpoint
        agreed = torch.tensor([target, -target], dtype=torch.int64, device=engine.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        target = int(agreed[0]) if int(agreed[0]) == -int(agreed[1]) else -1
    if target < 0 or setup.remote is not None or ckpt.damage(ckpt.step_dir(checkpoints, target)) is not None:
        if setup.rank == 0:
            log.warning(
                "%d loss spikes since step %d but no checkpoint before them to roll back to%s: the steps were "
                "skipped and training goes on",
                len(state.spike_steps),
                first,
                " (not with a run directory on object storage)" if setup.remote is not None else "",
            )
        state.spike_steps = []
        return None
    checkpoint = ckpt.step_dir(checkpoints, target)
    saved, _ = load_checkpoint(engine, setup, checkpoint)
    barrier()
    # the checkpoints of the abandoned steps: a resume must not pick them, pruning must not count them
    if setup.rank == 0:
        for step, path in ckpt.complete_checkpoints(checkpoints):
            if step > target:
                ckpt.discard(path)
    barrier()
    if setup.rank == 0:
        log.warning(
            "rolled back from step %d to the checkpoint of step %d after %d loss spikes (steps %s); the batches "
            "since are skipped, the loader goes on at %s",
            state.step,
            target,
            len(state.spike_steps),
            ", ".join(map(str, state.spike_steps)),
            train.state_dict(),
        )
    return replace(
        saved,
        skipped_steps=state.skipped_steps,
        spikes=state.spikes,
        grad_spikes=state.grad_spikes,
        spike_steps=[],
        rollbacks=state.rollbacks + 1,
    )


def rolls_back(state: LoopState, cfg: TrainConfig) -> bool:
    """Whether the recent loss spikes call for a roll-back."""
    return 0 < cfg.rollback_spikes <= len(state.spike_steps)


def log_spike(
    what: str, limit: float | None, cfg: TrainConfig, train: Batches, rank: int, level: int = logging.WARNING
) -> None:
    """One line naming the step, the spiking value against the limit, and where the loader was (the batch)."""
    if rank == 0:
        log.log(
            level,
            "%s is a spike (limit %.4f from the last %d steps); loader at %s",
            what,
            limit,
            cfg.spike_window,
            train.state_dict(),
        )


def check_grad_norm(grad_norm: float, step: int, checkpoints: Path) -> None:
    if not torch.isfinite(torch.tensor(grad_norm)):
        raise TrainingHalted(
            f"non-finite gradient norm at step {step}: the weights are no longer usable; resume from "
            f"{ckpt.latest_checkpoint(checkpoints)} with a lower optim.lr or a smaller optim.grad_clip"
        )


def decay_branch(
    engine: Engine,
    train: Batches,
    objective: Objective,
    optim: OptimConfig,
    setup: LoopSetup,
    start: int,
    horizon: int,
    evaluation: Callable[[], dict[str, float]],
) -> dict[str, float]:
    """Multi-horizon WSD (as OLMo-core's and Marin's ladders): from the stable phase at `start`, decay to
    `horizon` as a run of that length would, evaluate, then restore the stable state (weights, optimiser,
    loader position, RNG) from a snapshot and carry on. One run yields one (N, D) point per horizon."""
    snapshot = setup.run_dir / "branch"
    if setup.rank == 0:
        ckpt.prepare_staging(snapshot, start)
    barrier()
    staging = ckpt.staging_dir(snapshot, start)
    engine.save(staging)
    engine.saved()
    ckpt.save_rank_state(staging, setup.rank, train.state_dict())
    for step in range(start, horizon):  # a non-finite step here is skipped (lr 0) like any other
        outcome = optimizer_step(engine, train, objective, lr_at(step, optim, horizon), setup.world_size)
        if outcome.loss is not None:
            check_grad_norm(outcome.grad_norm, step + 1, setup.run_dir / "checkpoints")
    metrics = {f"horizon/{k.replace('/', '_')}": v for k, v in evaluation().items()}
    engine.load(staging)
    rank_state = ckpt.load_rank_state(staging, setup.rank)
    ckpt.set_rng_state(rank_state["rng"])
    train.load_state_dict(rank_state["loader"])
    barrier()
    if setup.rank == 0:
        shutil.rmtree(snapshot, ignore_errors=True)
    return metrics


def end_line(path: Path) -> None:
    """Terminate a file's last line if a crash left it unterminated (appends then start on a line of their own)."""
    if path.is_file() and path.stat().st_size:
        with path.open("rb+") as f:
            f.seek(-1, 2)
            if f.read(1) != b"\n":
                f.write(b"\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file; a torn line (what a crash or a full disk leaves mid-write) is skipped
    with a warning naming the file and line, so a resumed run can still finish."""
    records = []
    for number, line in enumerate(path.read_text().splitlines() if path.is_file() else [], start=1):
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            log.warning("%s:%d: skipped a torn record (%d characters)", path, number, len(line))
    return records


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


@dataclass(frozen=True)
class PendingCheckpoint:
    """A checkpoint whose files are (being) written into its staging directory, not yet marked complete."""

    step: int
    meta: dict[str, Any]


def start_checkpoint(engine: Engine, train: Batches, setup: LoopSetup, state: LoopState) -> PendingCheckpoint:
    """All ranks write into a staging directory (an engine with `train.async_checkpoint` may still be writing
    when this returns)."""
    root = setup.run_dir / "checkpoints"
    if setup.rank == 0:
        ckpt.prepare_staging(root, state.step)
    barrier()
    staging = ckpt.staging_dir(root, state.step)
    staging.mkdir(parents=True, exist_ok=True)  # a rank on another node (run directory on object storage)
    engine.save(staging)
    ckpt.save_rank_state(staging, setup.rank, train.state_dict())
    return PendingCheckpoint(state.step, {**setup.meta, "loop": asdict(state)})


def finish_checkpoint(engine: Engine, setup: LoopSetup, pending: PendingCheckpoint, keep: int) -> Path:
    """Once every rank's files are on disk, rank 0 renames the staging directory into place and marks it
    complete (with the digests the engine computed while writing, where it did)."""
    root = setup.run_dir / "checkpoints"
    staging = ckpt.staging_dir(root, pending.step)
    written = {path.relative_to(staging).as_posix(): record for path, record in engine.saved().items()}
    # on object storage, every rank uploads its own files before the gather that lets rank 0 mark it complete
    if setup.remote is not None:
        written |= remote_checkpoint.upload_rank_files(
            setup.remote, staging, pending.step, written, setup.rank
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[dict[str, Any]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(everyone, written)
        written = {k: v for records in everyone for k, v in records.items()}
    if setup.rank == 0:
        final = ckpt.commit(root, pending.step, pending.meta, keep, written)
        if setup.remote is not None:
            remote_checkpoint.publish(setup.remote, setup.run_dir, final, keep)
    barrier()
    if setup.rank != 0 and setup.remote is not None:  # a node apart from rank 0's keeps no staging copy
        shutil.rmtree(staging, ignore_errors=True)
    return ckpt.step_dir(root, pending.step)


def save_checkpoint(engine: Engine, train: Batches, setup: LoopSetup, state: LoopState, keep: int) -> Path:
    """All ranks write into a staging directory; rank 0 renames it into place and marks it complete."""
    return finish_checkpoint(engine, setup, start_checkpoint(engine, train, setup, state), keep)


def resume(engine: Engine, train: Batches, setup: LoopSetup) -> LoopState:
    """Load the newest complete checkpoint, if any: engine, RNG, loader position and loop counters. With a remote
    run directory, this node first pulls the newest one from the store unless it has it (a worker restarted on
    another node)."""
    if setup.remote is not None:
        mirror.pull_unfinished(setup.remote, setup.run_dir, plain_files=setup.rank == 0)
    barrier()
    checkpoints = setup.run_dir / "checkpoints"
    latest = ckpt.latest_checkpoint(checkpoints)
    if latest is None:
        if ckpt.complete_checkpoints(checkpoints):  # each named in a warning above
            log.warning("every checkpoint under %s is damaged: training restarts from step 0", checkpoints)
        return LoopState()
    state, loader_state = load_checkpoint(engine, setup, latest)
    train.load_state_dict(loader_state)
    return state


def load_checkpoint(engine: Engine, setup: LoopSetup, checkpoint: Path) -> tuple[LoopState, dict[str, Any]]:
    """Engine state, this rank's RNG and the loop counters from `checkpoint`, on this attempt's layout whatever
    the layout that wrote it (`setup.meta["layout"]`); returns the counters and the saved loader position.

    After a layout change, rank r takes the RNG of saved rank r mod (saved world size): dropout masks of the new
    ranks repeat those of the old ones (the data, a step-boundary position, continues exactly)."""
    meta = ckpt.read_meta(checkpoint)
    now, saved_on = setup.meta.get("layout"), meta.get("layout")
    moved = now is not None and saved_on is not None and saved_on != now
    engine.load(checkpoint, saved_on if moved else None)
    rank_state = ckpt.load_rank_state(
        checkpoint, setup.rank % saved_on["world_size"] if moved else setup.rank
    )
    ckpt.set_rng_state(rank_state["rng"])
    state = LoopState(**meta["loop"])
    if (
        setup.rank == 0 and moved
    ):  # a warning: the one line a CLI user sees of it (sums now round differently)
        log.warning(
            "resumed from %s at step %d, saved on %s, now on %s",
            checkpoint,
            state.step,
            describe_layout(saved_on),
            describe_layout(now),
        )
    elif setup.rank == 0:
        log.info("resumed from %s at step %d", checkpoint, state.step)
    return state, rank_state["loader"]
