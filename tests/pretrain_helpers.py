"""Shared settings for pretraining tests: the committed corpus, the smoke recipe, subprocess launches."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    from training.stages.lifecycle import TrainedModel

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "assets" / "corpus" / "stdlib_docstrings.jsonl"
GOLDEN = ROOT / "tests" / "assets" / "golden" / "smoke_losses.json"
MOE = "model.moe={n_experts: 4, top_k: 2, d_ff_expert: 64}"


def smoke_overrides(output_dir: Path | str, *extra: str) -> list[str]:
    """The smoke recipe on the committed corpus (independent of the installed Python's stdlib)."""
    return [
        f"data.sources=[{CORPUS}]",
        "data.num_workers=1",
        "data.shard_tokens=50000",
        "data.val_fraction=0.1",
        "train.eval_every=10",
        "train.eval_batches=2",
        f"output_dir={output_dir}",
        *extra,
    ]


def pretrain_here(output_dir: Path | str, *extra: str) -> TrainedModel:
    """The smoke recipe pretrained from this process, as `lmforge pretrain` would (trained, resumed or found
    finished): a launch costs ~5 s of imports and startup, so tests launch only the runs they kill."""
    from data_pipeline.tokenize import run_tokenize
    from flows.recipe import load_recipe
    from training.stages.pretrain import run_pretrain

    recipe = load_recipe("smoke", smoke_overrides(output_dir, *extra))
    return run_pretrain(recipe.pretrain_spec(), run_tokenize(recipe.data, recipe.output_dir))


def clean_env() -> dict[str, str]:
    """This environment without the process-group variables an in-process DeepSpeed test may have set."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # process-group variables, and MLflow's URI (`mlflow.set_tracking_uri` in a test rewrites it)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MLFLOW_TRACKING_URI"):
        env.pop(name, None)
    return env


def lmforge_command(*args: str) -> list[str]:
    return [str(Path(sys.executable).with_name("lmforge")), *args]


def cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """Run `lmforge` in a fresh process (its own Ray cluster and process group), with one thread per process."""
    return subprocess.run(
        lmforge_command(*args), capture_output=True, text=True, timeout=timeout, env=clean_env()
    )


def kill_when(args: list[str], ready: Callable[[], bool], log: Path) -> None:
    """Run `lmforge *args` and SIGKILL its whole process group (driver, Ray, workers) as soon as `ready()`."""
    with log.open("w") as out:  # a file, not a pipe: a full pipe would stall the run
        process = subprocess.Popen(
            lmforge_command(*args),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=clean_env(),
            start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while not ready():
            assert process.poll() is None, (
                f"the run ended before it could be killed: {log.read_text()[-3000:]}"
            )
            assert time.monotonic() < deadline, f"not ready to kill in 300 s: {log.read_text()[-3000:]}"
            time.sleep(0.01)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        kill_session(process.pid)


def kill_session(session: int) -> None:
    """SIGKILL what is left of session `session`: Ray runs its workers in process groups of their own, which outlive
    a kill of the driver's group and went on training and checkpointing for seconds (an EP=2 run killed after step
    5 wrote step 10 afterwards)."""
    deadline = time.monotonic() + 60
    while True:
        left = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == session and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(proc)
            except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
                continue
        if not left:
            return
        assert time.monotonic() < deadline, f"processes of the killed launch still alive: {left}"
        for proc in left:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(left, timeout=5)


def kill_after_checkpoint(args: list[str], stage_dir: Path, step: int, log: Path) -> Path:
    """Run `lmforge *args`, SIGKILL it as soon as the checkpoint of `step` is complete under `stage_dir`, and
    return the killed run's directory."""
    kill_when(args, lambda: bool(list(stage_dir.glob(f"*/checkpoints/step-{step:08d}/COMPLETE"))), log)
    return next(stage_dir.iterdir())


def logged_once(run_dir: Path, upto: int) -> bool:
    """True when steps 1..`upto` were each logged exactly once, in order: a resume, not a restart."""
    return [step for step, _ in logged_losses(run_dir) if step <= upto] == list(range(1, upto + 1))


def with_sets(overrides: list[str]) -> list[str]:
    return [item for o in overrides for item in ("--set", o)]


def logged_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, train/loss) as metrics.jsonl holds them, in the order they were logged (repeats included; a line a
    kill tore is skipped, as the loop skips it)."""
    from training.loop import read_jsonl

    return [(r["step"], r["train/loss"]) for r in read_jsonl(run_dir / "metrics.jsonl") if "train/loss" in r]


def continued(run_dir: Path, before: int, checkpoint: int, curve: dict[int, float]) -> bool:
    """True when what was logged after the first `before` records starts at the step after `checkpoint` and is
    `curve` from there on, bit for bit (a restart from scratch starts at step 1)."""
    after = logged_losses(run_dir)[before:]
    return after == [(step, curve[step]) for step in sorted(curve) if step > checkpoint]


def losses(run_dir: Path) -> dict[int, float]:
    """train/loss per step from metrics.jsonl; after a resume the re-run steps' last values win."""
    return dict(logged_losses(run_dir))


# Fine-tuning and evaluation settings shared by the smoke runs of several test modules; none of them changes
# the pretraining run's key, so one pretrained smoke model serves the pretraining, SFT and evaluation tests.
SMOKE_SETTINGS = [
    "data.sft.max_examples=300",
    "sft.train.max_steps=24",
    "sft.train.eval_every=24",
    "sft.optim.lr=1e-2",
    "eval.max_documents=20",
    "eval.builtin_questions=20",
]


def quiet_runner():  # noqa: ANN201 - a flows.runner.Direct
    """The in-process stage runner without progress bars (tests resolve stages through the registry with it)."""
    from flows.runner import Direct

    class Quiet(Direct):
        def steps(self, name: str, total: int) -> None:
            return None

    return Quiet()


def stopped_copy(run_dir: Path, stage_dir: Path, step: int) -> Path:
    """A finished run's directory copied under `stage_dir` as a kill right after its checkpoint of `step` leaves
    it: the later checkpoints, the export, summaries and manifest gone, metrics.jsonl cut after `step`; the
    output directory's embedded MLflow store comes along (the run continues its MLflow run)."""
    import json
    import shutil

    from training import checkpoint as ckpt
    from training.loop import read_jsonl

    copy = stage_dir / run_dir.name
    stage_dir.mkdir(parents=True, exist_ok=True)
    if (run_dir.parents[1] / "mlflow.db").is_file():
        shutil.copy(run_dir.parents[1] / "mlflow.db", stage_dir.parent / "mlflow.db")
    shutil.copytree(
        run_dir, copy, ignore=shutil.ignore_patterns("hf", "adapter", "manifest.json", "*.png", "*summary*")
    )
    for done, path in ckpt.complete_checkpoints(copy / "checkpoints"):
        if done > step:
            shutil.rmtree(path)
    assert ckpt.latest_checkpoint(copy / "checkpoints") == ckpt.step_dir(copy / "checkpoints", step), (
        "not kept"
    )
    kept = [r for r in read_jsonl(copy / "metrics.jsonl") if r["step"] <= step]
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return copy
