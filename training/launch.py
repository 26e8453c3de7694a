"""Launch N training workers with Ray Train (`TorchTrainer`): gloo CPU workers here, NCCL GPU workers on a cluster.
The only module that imports `ray.train`.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from infra.environment import environment
from infra.errors import Preempted, UserError
from infra.object_store import Store
from infra.ray_cluster import ensure_ray, quiet_exits_in_callbacks
from training.config import ParallelConfig
from training.preemption import STOP_FILE, stop_file_on_signals

log = logging.getLogger(__name__)
# how often Ray Train's controller looks at its workers on a private instance (Ray's default, 2 s, found each
# finished run ~1 s late on average)
POLL_INTERVAL_S = "0.25"
SETTLE_S = 3.0  # how long the cluster's free resources must hold still before an elastic restart counts them


def run_workers(
    worker: Callable[[dict[str, Any]], None],
    spec: dict[str, Any],
    workers: int,
    use_gpu: bool,
    storage: Path | Store,
    name: str,
    max_failures: int = 0,
    placement: str = "PACK",
) -> None:
    """Run `worker(spec)` on `workers` Ray Train workers (one process group) and wait for them.

    Without a running cluster (`RAY_ADDRESS` unset) a local one is started with enough logical CPUs. Worker
    failures restart all workers up to `max_failures` times; they resume from the newest complete checkpoint.
    `placement` is Ray's placement-group strategy (STRICT_SPREAD: one worker per node). Ray Train keeps its run
    state under `storage`: a local directory, or the run's directory on object storage (shared by every node).
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    private = ensure_ray(workers + 1)
    scaling = ScalingConfig(
        num_workers=workers,
        use_gpu=use_gpu,
        resources_per_worker=None if use_gpu else {"CPU": 1},
        placement_strategy=placement,
    )
    # signals reach this process only: on one, the workers' loops find the stop file, checkpoint and return
    stop_file = None if isinstance(storage, Store) else (storage / "STOP").resolve()
    if stop_file is not None:
        stop_file.with_suffix(".done").unlink(missing_ok=True)  # an earlier attempt's mark
    trainer = _lean(TorchTrainer, private)(
        _stoppable,
        train_loop_config={**spec, "worker": worker, "stop_file": str(stop_file) if stop_file else None},
        scaling_config=scaling,
        run_config=RunConfig(
            storage_path=storage.key("ray") if isinstance(storage, Store) else str(storage.resolve()),
            storage_filesystem=storage.fs if isinstance(storage, Store) else None,
            name=name,
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    log.info("launching %d Ray Train workers (gpu=%s)", workers, use_gpu)
    if stop_file is None:  # a run directory on object storage: no stop file the workers all see
        fit(trainer)
        return
    with stop_file_on_signals(stop_file, "the workers") as stop:
        fit(trainer)
    if stop_file.with_suffix(".done").exists():
        raise Preempted(
            f"{stop.signal}: the {workers} workers stopped after writing a checkpoint under {stop_file.parent.parent}; "
            "rerun the same command to resume from it"
        )


BAD_INPUT = re.compile(r"(?:DataError|ConfigError): (.+)")


def fit(trainer: Any) -> None:
    """`trainer.fit()`; bad input a worker refused (a `DataError` or `ConfigError` in its traceback) ends as that
    one line here, as it would have in one process, not as Ray's traceback of the worker group."""
    try:
        trainer.fit()
    except Exception as error:
        refused = BAD_INPUT.search(str(error))
        if refused is None:
            raise
        raise UserError(refused.group(1).strip()) from None


def _stoppable(config: dict[str, Any]) -> None:
    """A Ray Train worker: `config["worker"](config)`, which watches `config["stop_file"]` after every step; a
    worker stopped by it returns normally (an error would make Ray Train restart the group) and leaves a mark."""
    quiet_exits_in_callbacks()
    if config["stop_file"]:
        os.environ[STOP_FILE] = config["stop_file"]
    try:
        config["worker"](config)
    except Preempted:
        if config["stop_file"]:
            Path(config["stop_file"]).with_suffix(".done").touch()


def _lean(trainer: type, private: bool) -> type:
    """`trainer` without the helpers lmforge's runs do not need, each an actor process that imports Ray Train
    (~1.3 s of CPU) on the way to the first step, and again at every restart of the workers: the Ray Data dataset
    manager (lmforge's workers read their shards themselves). On a private Ray instance (one that dies with this
    process, on one node) also the placement-group cleaner, which frees the workers' resources if the controller
    dies (its state-API polling, with no dashboard there, also held every shutdown for 12 s: "Monitor thread did
    not exit"), the preemption watcher (no node of a private instance is preempted) and the resource request to
    an autoscaler (it has none); its controller also looks at the workers every 0.25 s, not 2 s. On a cluster all
    stay as Ray makes them, but the cleaner gets a shorter state-API timeout."""

    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    from ray.train.v2._internal.execution.scaling_policy import FixedScalingPolicy

    class _WithoutAutoscaler(FixedScalingPolicy):
        """A fixed worker count that asks no autoscaler for its resources: a private instance has none, and the
        autoscaling coordinator Ray Train would start for that (an actor that imports Ray Data) held every start
        ~1.8 s."""

        def after_controller_start(self, train_run_context: Any) -> None:
            return None

        def _maybe_send_resource_request(self) -> None:
            return None

        def _cancel_resource_request(self) -> None:
            return None

    class LeanTrainer(trainer):
        def _create_default_callbacks(self) -> list[Any]:
            callbacks = []
            for callback in super()._create_default_callbacks():
                if isinstance(callback, DatasetsCallback) and not self.datasets:
                    continue
                if isinstance(callback, PlacementGroupCleanerCallback):
                    if private:
                        continue
                    # on a cluster its each look at the controller (the state API) may wait out its whole timeout,
                    # 10 s by default, and stopping the cleaner waits for that look: every run ended 12 s later
                    callback = PlacementGroupCleanerCallback(get_actor_timeout_s=2.0)
                callbacks.append(callback)
            return callbacks

        def _initialize_and_run_controller(self, **kwargs: Any) -> Any:
            if not private:
                return super()._initialize_and_run_controller(**kwargs)
            if type(kwargs["scaling_policy"]) is FixedScalingPolicy:
                kwargs["scaling_policy"] = _WithoutAutoscaler(kwargs["scaling_policy"].scaling_config)
            # read by the controller, which takes them with it when it starts
            with environment(
                RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0", RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=POLL_INTERVAL_S
            ):
                return super()._initialize_and_run_controller(**kwargs)

    return LeanTrainer


def run_elastic(
    worker: Callable[[dict[str, Any]], None],
    spec: dict[str, Any],
    counts: list[int],
    use_gpu: bool,
    storage: Path | Store,
    name: str,
    max_failures: int,
    placement: str,
) -> None:
    """`run_workers` on `counts[0]` workers; after a failure (up to `max_failures` of them), again on the largest
    of `counts` the cluster has free workers for, never waiting for more. The workers resume from the newest
    checkpoint on their new layout (training/parallel/reshard.py)."""
    from ray.train import TrainingFailedError

    workers = counts[0]
    for failures in range(max_failures + 1):
        try:
            return run_workers(worker, spec, workers, use_gpu, storage, name, 0, placement)
        except TrainingFailedError as error:
            if failures == max_failures:
                raise
            before, workers = workers, free_count(counts, use_gpu)
            first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            log.warning(
                "the attempt on %d workers failed (%s); going on with %d (failure %d of at most %d)",
                before,
                first_line,
                workers,
                failures + 1,
                max_failures,
            )


def free_count(counts: list[int], use_gpu: bool, timeout_s: float = 120.0) -> int:
    """The largest of `counts` (descending) the cluster has free workers for, once its free resources have held
    still for `SETTLE_S` (a failed worker group takes a moment to hand back its own)."""
    import ray

    resource = "GPU" if use_gpu else "CPU"  # a worker takes one
    deadline = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while True:
        free, now = int(ray.available_resources().get(resource, 0)), time.monotonic()
        if free != last:
            last, since = free, now
        fits = [n for n in counts if n <= free]
        if fits and now - since >= SETTLE_S:
            return fits[0]
        if now > deadline:
            raise UserError(
                f"after a worker failure the cluster has {free} free {resource}(s), fewer than the "
                f"{counts[-1]} workers parallel.min_workers allows; rerun when it has more (the run resumes "
                "from its newest checkpoint)"
            )
        time.sleep(0.5)


def run_stage_workers(
    worker: Callable[..., None],
    job: Any,
    parallel: ParallelConfig,
    run_dir: Path,
    name: str,
    progress: Callable[[int, float, float], None] | None = None,
    store: Store | None = None,
    counts: list[int] | None = None,
) -> None:
    """`worker({"job": job})`: one worker runs in this process (and reports progress); more run on Ray Train
    (its state on `store` when the run directory lives on object storage). `counts`: the worker counts an elastic
    run may go on with after a failure (`training.config.worker_counts`), largest first."""
    config = {"job": job}
    common = (torch.cuda.is_available(), store or run_dir / "ray", name)
    if parallel.world_size == 1:
        worker(config, progress)
    elif counts is not None and len(counts) > 1:
        run_elastic(worker, config, counts, *common, parallel.max_failures, parallel.placement.upper())
    else:
        run_workers(
            worker, config, parallel.world_size, *common, parallel.max_failures, parallel.placement.upper()
        )
