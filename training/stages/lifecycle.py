"""One lifecycle for every training stage (pretraining, SFT, and the objectives that follow).

`run_training_stage(stage, spec, inputs)` owns what they share: the cached step (directory named by the spec's
key and the inputs' digests; a finished run is returned as is), resume from the newest complete checkpoint into
the same MLflow run, the run finished FAILED on any error, the launch (one worker in-process, N on Ray Train),
worker setup (threads, process group, seed, engine, loop) and the manifest. A stage supplies only what differs,
as a `TrainingStage`: its model, its loaders, its objective (token cross-entropy by default) and its finalize
step (export, verification, summary).
"""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from data_pipeline.loader import SampledLoader
from infra import mirror
from infra.cores import cores_each
from infra.object_store import is_remote, open_store
from infra.steps import Artifact, Step, run_step
from infra.storage import atomic_write_json
from infra.tracking import TrackedRun, Tracker, tracked_run
from training import checkpoint as ckpt
from training.config import TrainConfig, TrainingSpec, worker_counts
from training.launch import run_stage_workers
from training.loop import Batches, LoopSetup, read_jsonl, resume, train_loop
from training.model.accounting import flops_per_token
from training.model.config import ModelConfig
from training.model.export import export_damage
from training.objective import Objective, TokenCrossEntropy
from training.perf import process_peak, published_peak

log = logging.getLogger(__name__)
Progress = Callable[[int, float, float], None]  # (step, loss, tokens/s), rank 0


class TrainedModel(Artifact):
    """A finished training run: final checkpoint, verified Hugging Face export, headline numbers. `path` is the run
    directory; `kind` says what the model is."""

    kind: Literal[
        "pretrain",
        "imported",
        "sft-full",
        "lora",
        "dpo-full",
        "dpo-lora",
        "distill",
        "reward",
        "rl-full",
        "rl-lora",
    ]
    checkpoint: str
    hf_export: str
    export_valid: bool
    max_abs_logit_diff: float | None
    step: int
    final_val_loss: float | None
    tokenizer_digest: str
    mlflow_run_id: str | None
    model: dict[str, Any]
    adapter: str | None = None  # LoRA: the PEFT adapter directory (loads on the base's export)
    base_run_dir: str | None = None  # fine-tuning: the run it started from
    summary: dict[str, float] = {}  # stage-specific headline numbers (e.g. held-out loss before and after)
    # the Hugging Face directory its lineage started from, with its config and weight digests (`imported` runs and
    # every run tuned from one): the `source_model` tag of its MLflow run and registered versions
    source_model: str | None = None

    @property
    def run_dir(self) -> str:
        return self.path

    def damage(self) -> str | None:
        """A damaged final checkpoint or export (missing, truncated or altered files), else None."""
        checkpoint = Path(self.checkpoint)
        if self.kind == "imported":  # its weights are its export's (`training/stages/imported.py`)
            return export_damage(self.hf_export)
        if not (checkpoint / ckpt.COMPLETE).is_file():
            return f"{checkpoint}: final checkpoint missing"
        return ckpt.damage(checkpoint) or export_damage(self.hf_export)


@dataclass(frozen=True)
class TrainingJob:
    """What each worker receives: the stage definition, its spec, upstream artifacts, where and under which run."""

    stage: TrainingStage
    spec: TrainingSpec
    inputs: Mapping[str, Artifact]
    run_dir: Path
    run: TrackedRun
    key: str  # the step's key digest, recorded in every checkpoint
    remote: str | None = None  # the run directory's URI when outputs live on object storage


class TrainingStage(ABC):
    """A training objective over the one lifecycle. Instances are stateless and importable (workers get them)."""

    name: ClassVar[str]  # output directory under <output_dir>/ and the MLflow run-name prefix
    version: ClassVar[int]  # bump when the same spec and inputs would train different weights

    def check(self, spec: TrainingSpec, inputs: Mapping[str, Artifact]) -> None:  # noqa: B027 - optional hook
        """Refuse bad input (one line naming the problem and the fix) before anything starts."""

    def run_name(self, spec: TrainingSpec) -> str:
        return spec.name

    def tags(self, spec: TrainingSpec, inputs: Mapping[str, Artifact]) -> dict[str, str]:
        return {}

    def log_inputs(self, inputs: Mapping[str, Artifact], tracker: Tracker) -> None:  # noqa: B027 - optional hook
        """Attach the inputs' manifests to the run (once, when the run is created)."""

    @abstractmethod
    def model_config(self, job: TrainingJob) -> ModelConfig: ...

    @abstractmethod
    def build_model(self, job: TrainingJob) -> nn.Module:
        """The module to train, on the CPU in fp32 (the engine moves and casts it)."""

    @abstractmethod
    def loaders(self, job: TrainingJob, rank: int, world: int) -> tuple[Batches, SampledLoader | None]:
        """This rank's training batches and (optionally) the validation loader."""

    def probe(self, job: TrainingJob) -> Callable[[nn.Module], dict[str, float]] | None:
        """Extra metrics measured on the module at every final evaluation (none unless overridden)."""
        return None

    def objective(self, job: TrainingJob) -> Objective:
        """What the loop minimises (next-token cross-entropy over the loss-carrying tokens unless overridden)."""
        return TokenCrossEntropy()

    @abstractmethod
    def finalize(self, job: TrainingJob, final: Path, tracker: Tracker) -> TrainedModel:
        """Export and verify the final checkpoint, measure the summary; the manifest is written by the runner."""


def trained_model(
    job: TrainingJob,
    final: Path,
    tracker: Tracker,
    kind: str,
    verification: dict[str, Any],
    metrics: dict[str, float],
    **fields: Any,
) -> TrainedModel:
    """What every `finalize` ends with: `metrics` and the verified export (`<run>/hf`) logged at the final step,
    and the run's `TrainedModel` (the stage adds its own `fields`: val loss, tokenizer, model, adapter ...)."""
    step = int(ckpt.read_meta(final)["loop"]["step"])
    export_dir = job.run_dir / "hf"
    tracker.log_metrics(metrics, step)
    tracker.log_artifact(export_dir, "hf_export")
    return TrainedModel(
        path=str(job.run_dir),
        kind=kind,
        checkpoint=str(final.resolve()),
        hf_export=str(export_dir.resolve()),
        export_valid=bool(verification["valid"]),
        max_abs_logit_diff=verification["max_abs_logit_diff"],
        step=step,
        mlflow_run_id=job.run.run_id,
        **({"source_model": source_model(job.inputs)} | fields),
    )


def source_model(inputs: Mapping[str, Any]) -> str | None:
    """The Hugging Face directory the inputs' lineage started from (see `TrainedModel.source_model`), if any."""
    return next((m.source_model for m in inputs.values() if getattr(m, "source_model", None)), None)


def training_step(
    stage: TrainingStage, spec: TrainingSpec, inputs: Mapping[str, Artifact]
) -> Step[TrainedModel]:
    """The cached step of a training run (ask it `finished(root)` to know whether the run is done)."""
    return Step(stage.name, stage.run_name(spec), stage.version, spec.key(), TrainedModel, dict(inputs))


def run_training_stage(
    stage: TrainingStage,
    spec: TrainingSpec,
    inputs: Mapping[str, Artifact],
    progress: Progress | None = None,
) -> TrainedModel:
    """Train (or resume, or return) `stage` on `inputs` with `spec`."""
    stage.check(spec, inputs)
    step = training_step(stage, spec, inputs)
    remote = step.store(spec.output_dir).uri if is_remote(spec.output_dir) else None
    return run_step(
        spec.output_dir,
        step,
        lambda run_dir, key: _train(stage, spec, inputs, run_dir, key, progress, remote),
    )


def _train(
    stage: TrainingStage,
    spec: TrainingSpec,
    inputs: Mapping[str, Artifact],
    run_dir: Path,
    key: str,
    progress: Progress | None,
    remote: str | None,
) -> TrainedModel:
    # the run continues the MLflow run it started, even when it died before its first checkpoint
    started = run_dir / "run.json"
    previous = json.loads(started.read_text())["mlflow_run_id"] if started.is_file() else None
    tags = {
        "lmforge.stage": stage.name,
        "lmforge.config_digest": key,
        "lmforge.run_dir": str(run_dir.resolve()),
        **stage.tags(spec, inputs),
        **({"source_model": origin} if (origin := source_model(inputs)) else {}),
    }
    name = f"{stage.name}-{stage.run_name(spec)}"
    with tracked_run(spec.tracking, spec.output_dir, name, tags, previous) as run:
        tracker = run.tracker()
        if previous is None:
            atomic_write_json(started, {"mlflow_run_id": run.run_id})
            tracker.log_params(spec.model_dump(mode="json", exclude={"tracking", "output_dir"}))
            atomic_write_json(run_dir / "spec.json", spec.model_dump(mode="json"))
            tracker.log_artifact(run_dir / "spec.json")
            stage.log_inputs(inputs, tracker)
        store = open_store(remote) if remote else None
        if store is not None:  # a worker on another node continues the same MLflow run
            for name in ("run.json", "spec.json"):
                if (run_dir / name).is_file():
                    store.upload(run_dir / name, name)
        job = TrainingJob(stage, spec, dict(inputs), run_dir.resolve(), run, key, remote)
        counts = worker_counts(spec.train, spec.parallel)
        if spec.parallel.min_workers and len(counts) == 1 and spec.parallel.world_size > 1:
            log.warning(
                "%s is not elastic (parallel.min_workers=%d): set train.global_batch_size, split evenly over fewer "
                "workers, so that it can go on with fewer",
                stage.name,
                spec.parallel.min_workers,
            )
        run_stage_workers(train_worker, job, spec.parallel, run_dir, stage.name, progress, store, counts)
        if store is not None:  # the workers' newest checkpoint and metrics, wherever they ran
            mirror.pull_unfinished(store, run_dir)
        final = ckpt.latest_checkpoint(run_dir / "checkpoints")
        if final is None:
            raise RuntimeError(f"{run_dir}: training ended without a complete checkpoint")
        return stage.finalize(job, final, tracker)


def train_worker(config: dict[str, Any], progress: Progress | None = None) -> None:
    """One training process (in-process, or a Ray Train worker): engine, this rank's loaders, resume, loop."""
    from training.parallel import build_engine, init_distributed

    job: TrainingJob = config["job"]
    spec, train = job.spec, job.spec.train
    for artifact in job.inputs.values():  # a node that has not seen them yet pulls them from the store
        artifact.materialize()
    init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    parallel = spec.parallel.model_copy(update={"world_size": world})  # this attempt's (elastic: maybe fewer)
    torch.set_num_threads(parallel.threads_per_worker or cores_each(world))
    torch.manual_seed(train.seed)
    model = job.stage.build_model(job)
    engine = build_engine(model, spec.optim, parallel, train)
    loader, val_loader = job.stage.loaders(job, rank, world)
    cfg = job.stage.model_config(job)
    setup = LoopSetup(
        run_dir=job.run_dir,
        rank=rank,
        world_size=world,
        flops_per_token=flops_per_token(cfg, train.seq_len).training,
        peak_flops=peak_flops_for(spec.parallel.precision, train, cfg, rank, engine.device),
        meta={"mlflow_run_id": job.run.run_id, "config_digest": job.key, "layout": parallel.layout()},
        progress=progress,
        probe=job.stage.probe(job),
        remote=open_store(job.remote) if job.remote else None,
    )
    # before the resume restores the RNG: building an objective may draw from it (a reference model's init)
    objective = job.stage.objective(job)
    state = resume(engine, loader, setup)
    n_val = train.eval_batches_per_rank(world)
    val = (lambda: val_loader.epoch_batches(n_val)) if val_loader is not None else None
    tracker = job.run.tracker(rank, buffer_seconds=2.0)
    # each attempt's layout, at the step it starts from (a run may continue on another)
    tracker.log_metrics({f"layout/{name}": value for name, value in parallel.layout().items()}, state.step)
    try:
        train_loop(engine, loader, val, train, spec.optim, setup, tracker, state, objective)
    finally:  # metrics up to a crash are kept too
        tracker.flush()


def peak_flops_for(
    precision: str, train: TrainConfig, cfg: ModelConfig, rank: int, device: torch.device
) -> float:
    """Per-device peak for MFU: configured, else the published GPU peak, else a GEMM measured at the model's
    shapes in the training dtype (rank 0 only: it alone logs MFU)."""
    peak = train.peak_flops or published_peak(device)
    if peak is not None:
        return peak
    if rank != 0:
        return 1.0
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[precision]
    return process_peak(dtype, device, train.micro_batch_size * train.seq_len, cfg.d_model, cfg.d_ff)


def read_metrics(run_dir: str | Path) -> list[dict[str, float]]:
    """Every record of the run's metrics.jsonl, in logging order (a resumed run re-logs the steps it redoes)."""
    return read_jsonl(Path(run_dir) / "metrics.jsonl")


def val_losses(run_dir: str | Path) -> list[float]:
    return [m["val/loss"] for m in read_metrics(run_dir) if "val/loss" in m]
