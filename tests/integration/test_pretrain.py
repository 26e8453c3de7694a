"""Pretraining end to end with real DeepSpeed, Ray Train and MLflow on the CPU: learning, agreement across
ZeRO stages and worker counts, golden losses, exact resume after SIGKILL, the non-finite-loss guard, export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data_pipeline.tokenize import run_tokenize
from flows.recipe import load_recipe
from tests.pretrain_helpers import (
    GOLDEN,
    MOE,
    continued,
    logged_losses,
    logged_once,
    losses,
    pretrain_here,
    smoke_overrides,
    stopped_copy,
    with_sets,
)
from training import checkpoint as ckpt
from training.stages.lifecycle import TrainedModel, read_metrics
from training.stages.pretrain import run_pretrain

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def pretrain(output_dir: Path, *extra: str, workers: int | None = None) -> TrainedModel:
    """The smoke recipe trained from this process: one worker in the process, or `workers` Ray Train workers on
    this module's Ray instance (shut down with the module: tests/conftest.py)."""
    return pretrain_here(output_dir, *extra, *([f"parallel.world_size={workers}"] if workers else []))


@pytest.fixture(scope="module")
def golden_run(smoke_base) -> TrainedModel:
    """The smoke recipe, 1 worker, fp32, ZeRO-0, 20 steps, in this process (shared with the SFT and eval tests)."""
    return smoke_base[1]


def test_golden_loss_curve(golden_run: TrainedModel) -> None:
    import deepspeed

    golden = json.loads(GOLDEN.read_text())
    installed = {"torch": torch.__version__.split("+")[0], "deepspeed": deepspeed.__version__}
    assert installed == golden["versions"], (
        f"the golden curve was made with {golden['versions']}, this install has {installed}: "
        "install with `make install` (constraints.txt) or regenerate it (tests/assets/golden/README.md)"
    )
    got = losses(Path(golden_run.run_dir))
    assert sorted(got) == list(range(1, 21))
    # Bit-exact on one machine (rerun twice: identical); 1e-4 leaves room for other CPUs' kernels (AVX2 vs
    # AVX-512 reduction orders), far below the step-to-step loss changes (~1e-2) that a real regression makes.
    assert [got[s] for s in sorted(got)] == pytest.approx(golden["losses"], abs=1e-4)


def test_training_learns_and_tracks_in_mlflow(golden_run: TrainedModel) -> None:
    import mlflow

    curve = losses(Path(golden_run.run_dir))
    assert sum(curve[s] for s in (18, 19, 20)) / 3 < sum(curve[s] for s in (1, 2, 3)) / 3 - 0.3
    recipe = load_recipe("smoke", smoke_overrides(Path(golden_run.run_dir).parents[1]))
    client = mlflow.MlflowClient(f"sqlite:///{Path(recipe.output_dir) / 'mlflow.db'}")
    run = client.get_run(golden_run.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["model.d_model"] == "64" and run.data.params["parallel.zero_stage"] == "0"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, 21))
    grad_norms = client.get_metric_history(run.info.run_id, "train/grad_norm")
    assert all(0 < m.value < 100 for m in grad_norms)  # fp32 ZeRO-0: measured from p.grad
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "val/loss"} <= set(
        run.data.metrics
    )
    assert run.data.tags["lmforge.config_digest"] == golden_run.key
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"spec.json", "data", "hf_export", "metrics.jsonl"} <= artifacts


def test_hf_export_gives_our_logits(golden_run: TrainedModel) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.model.config import ModelConfig
    from training.model.transformer import Transformer
    from training.parallel import fp32_state_dict

    assert golden_run.export_valid and golden_run.max_abs_logit_diff < 1e-5
    cfg = ModelConfig(**golden_run.model)
    ours = Transformer(cfg, seed=None)
    ours.load_state_dict(fp32_state_dict(Path(golden_run.checkpoint), cfg.tie_embeddings))
    theirs = AutoModelForCausalLM.from_pretrained(golden_run.hf_export, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(golden_run.hf_export)
    ids = tokenizer("def parse(text):\n    return json.loads(text)", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids).logits, theirs.eval()(ids).logits, rtol=0, atol=1e-5)


def test_export_must_reproduce_the_engines_validation_loss(golden_run: TrainedModel, tmp_path: Path) -> None:
    """Not circular: the export is checked against the loss the trained engine measured, so weights that went
    wrong between engine and export (a bad ZeRO gather, say) make it invalid."""
    from data_pipeline.loader import PackedLoader
    from data_pipeline.shards import DatasetManifest
    from training.model.config import ModelConfig
    from training.model.export import EngineCheck, export_hf
    from training.parallel import fp32_state_dict

    record = json.loads((Path(golden_run.hf_export) / "export.json").read_text())
    assert record["engine_val_loss"] == golden_run.final_val_loss
    assert record["engine_rel_diff"] <= 1e-5 and record["valid"]  # fp32: the same numbers, summed differently
    cfg = ModelConfig(**golden_run.model)
    data = DatasetManifest.load(next((Path(golden_run.run_dir).parents[1] / "tokenize").iterdir()))
    recipe_train = json.loads((Path(golden_run.run_dir) / "spec.json").read_text())["train"]
    val = PackedLoader(
        data,
        "val",
        seq_len=recipe_train["seq_len"],
        batch_size=recipe_train["micro_batch_size"],
        shuffle=False,
    )
    check = EngineCheck(
        golden_run.final_val_loss, list(val.epoch_batches(recipe_train["eval_batches"])), 1e-4
    )
    state = fp32_state_dict(Path(golden_run.checkpoint), cfg.tie_embeddings)
    assert export_hf(state, cfg, data.tokenizer.path, tmp_path / "same", check)["valid"]
    shuffled = {}  # what a gather that concatenates two ranks' partitions in the wrong order gives
    for name, tensor in state.items():
        halves = tensor.flatten().chunk(2)
        shuffled[name] = torch.cat(halves[::-1]).view_as(tensor) if len(halves) == 2 else tensor
    wrong = export_hf(shuffled, cfg, data.tokenizer.path, tmp_path / "wrong", check)
    assert wrong["max_abs_logit_diff"] < 1e-5  # the logit comparison alone cannot tell
    assert not wrong["valid"] and wrong["engine_rel_diff"] > 1e-3


def test_rerun_of_a_finished_run_returns_it(golden_run: TrainedModel) -> None:
    manifest = Path(golden_run.run_dir) / "manifest.json"
    stamp = manifest.stat().st_mtime_ns
    recipe = load_recipe("smoke", smoke_overrides(Path(golden_run.run_dir).parents[1]))
    assert run_pretrain(recipe.pretrain_spec(), run_tokenize(recipe.data, recipe.output_dir)) == golden_run
    assert manifest.stat().st_mtime_ns == stamp
    # settings that cannot change the weights do not re-key the run: another recipe section, threads, restarts
    other = recipe.override(
        "eval.max_documents=7", "parallel.threads_per_worker=1", "parallel.max_failures=3"
    )
    assert run_pretrain(other.pretrain_spec(), run_tokenize(other.data, other.output_dir)) == golden_run
    assert manifest.stat().st_mtime_ns == stamp


# Each case: overrides, workers, and whether it must reproduce the golden fp32 ZeRO-0 curve. Same global batch
# (8): 1 worker x 2 micro-batches or 2 workers x 1. ZeRO-2 partitions optimiser state and gradients, ZeRO-3 also
# the weights (gathered on export); bf16 at ZeRO-0 keeps its fp32 masters in lmforge's `MasterWeights`; the bf16
# EP=2 case splits the experts over the two ranks. fp32 ZeRO-0 resume is the e2e kill-and-rerun's; 2 workers with
# ZeRO-2 in fp32 (the golden curve) killed and resumed is the two-node Ray test's. K-FAC (hooks, factors and
# inverses as optimiser state) resumes here too; every matrix optimiser in tests/integration/test_engine.py.
RESUME_CASES = {
    "zero2": (["parallel.zero_stage=2"], None, True),
    "zero3": (["parallel.zero_stage=3"], None, True),
    "moe": ([MOE], None, False),
    "moe-bf16": ([MOE, "parallel.precision=bf16"], None, False),
    "kfac": (["optim.name=kfac", "optim.matrix_lr=0.01", "optim.precondition_every=4"], None, False),
    "moe-ep2-bf16-2workers": (
        [MOE, "parallel.ep_size=2", "parallel.zero_stage=2", "parallel.precision=bf16"],
        2,
        False,
    ),
}
# 20 steps, as the golden run (the cadence changes no weight); the step-5 checkpoint is kept to resume from
RESUME_STEPS = ["train.checkpoint_every=5", "train.keep_checkpoints=4"]


def uninterrupted(
    out: Path, golden: TrainedModel, settings: list[str], workers: int | None, like_golden: bool
) -> TrainedModel:
    """A 20-step run that learns, agrees with the golden curve (fp32 cases) and exports the engine's weights."""
    run = pretrain(out, *RESUME_STEPS, *settings, workers=workers)
    curve = losses(Path(run.run_dir))
    assert sorted(curve) == list(range(1, 21))
    assert sum(curve[s] for s in (18, 19, 20)) < sum(curve[s] for s in (1, 2, 3)) - 0.6  # it learns
    if (
        like_golden
    ):  # fp32 sums in another order (per-rank means, then an all-reduce): equal to ~1e-6 relative
        reference = losses(Path(golden.run_dir))
        assert all(curve[s] == pytest.approx(reference[s], rel=1e-5) for s in reference), (curve, reference)
    record = json.loads((Path(run.hf_export) / "export.json").read_text())
    bound = 1e-5 if like_golden else 5e-3  # bf16: the export is fp32, the engine computed in bf16
    assert run.export_valid and record["engine_rel_diff"] <= bound  # the gathered weights are the engine's
    return run


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_exact_resume_from_a_checkpoint(case: str, golden_run: TrainedModel, tmp_path: Path) -> None:
    """After the uninterrupted run, its directory as a kill right after the step-5 checkpoint leaves it (the later
    checkpoints, export and manifest gone, metrics cut there, plus what a kill in the middle of a save leaves: a
    staging directory and a renamed one without its marker), run again: it continues from that checkpoint into
    the same MLflow run and matches the uninterrupted one bit for bit. (SIGKILLs of whole launches: the e2e
    pipeline's (ZeRO-0), DPO's, LoRA SFT's and the two-node Ray job's (ZeRO-2, two workers, a worker killed).)"""
    settings, workers, like_golden = RESUME_CASES[case]
    extra = [*RESUME_STEPS, *settings]
    straight = uninterrupted(tmp_path / "straight", golden_run, settings, workers, like_golden)
    curve = losses(Path(straight.run_dir))

    out = tmp_path / "killed"
    run_dir = stopped_copy(Path(straight.run_dir), out / "pretrain", 5)
    done = [s for s, _ in ckpt.complete_checkpoints(run_dir / "checkpoints")]
    first_run_id = ckpt.read_meta(ckpt.latest_checkpoint(run_dir / "checkpoints"))["mlflow_run_id"]
    killed_records = len(logged_losses(run_dir))
    # what a kill in the middle of a save leaves: a staging directory and a renamed one without its marker
    ckpt.prepare_staging(run_dir / "checkpoints", 200)
    (run_dir / "checkpoints" / "step-00000199").mkdir()

    resumed = pretrain(out, *extra, workers=workers)
    assert resumed.mlflow_run_id == first_run_id is not None  # the same MLflow run continues
    assert losses(Path(resumed.run_dir)) == curve  # every step, bit for bit
    # the rerun's own first step is the one after the checkpoint, with the uninterrupted run's loss
    assert continued(run_dir, killed_records, done[-1], curve), logged_losses(run_dir)
    assert logged_once(run_dir, done[-1]), "steps before the checkpoint were trained twice: a restart"
    from training.parallel import fp32_state_dict

    a = fp32_state_dict(Path(straight.checkpoint), False)
    b = fp32_state_dict(Path(resumed.checkpoint), False)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if (
        case == "moe-ep2-bf16-2workers"
    ):  # and continued on 1 worker, the experts put back together (EP 2 -> 1)
        moved_dir = stopped_copy(Path(straight.run_dir), tmp_path / "ep1" / "pretrain", 5)
        moved = pretrain(
            tmp_path / "ep1", *RESUME_STEPS, MOE, "parallel.zero_stage=2", "parallel.precision=bf16"
        )
        assert moved.mlflow_run_id == first_run_id and logged_once(moved_dir, 5)
        # bf16 through another expert layer: the first step after the move within 2e-5, all within 5e-4 (measured
        # 1.4e-6 and 1.3e-4; with Adam's moments lost in the move, steps go past 5e-4)
        after = losses(moved_dir)
        assert sorted(after) == list(range(1, 21)) and after[6] == pytest.approx(curve[6], rel=2e-5)
        assert all(after[s] == pytest.approx(curve[s], rel=5e-4) for s in curve), (after, curve)
    if "moe" in case:
        records = [
            json.loads(line) for line in (Path(resumed.run_dir) / "metrics.jsonl").read_text().splitlines()
        ]
        last = next(r for r in reversed(records) if "train/loss" in r)
        assert "moe/layer0/load_cv" in last and "moe/layer1/aux_loss" in last


def test_a_run_continues_on_another_number_of_workers(
    golden_run: TrainedModel, tmp_path: Path, caplog
) -> None:
    """ZeRO-2 (optimiser state and gradients partitioned over the ranks): saved on 1 worker, continued on 2 (DeepSpeed's
    universal checkpoint reshards the partitions), saved there and continued on 1 again; the same command with another
    `parallel.world_size`, in the same run directory and MLflow run. Every step's loss is the uninterrupted run's
    (the golden one: 1 or 2 workers agree to ~1e-6 in fp32, reduction order) and each attempt's layout is in MLflow."""
    import logging

    import mlflow

    settings = [*RESUME_STEPS, "parallel.zero_stage=2"]
    golden = losses(Path(golden_run.run_dir))
    on_one = pretrain(tmp_path / "one", *settings)
    out = tmp_path / "moved"
    run_dir = stopped_copy(Path(on_one.run_dir), out / "pretrain", 5)
    on_two = pretrain(out, *settings, workers=2)  # one Ray launch: 2 workers from step 5 to 20
    assert Path(on_two.run_dir) == run_dir and on_two.mlflow_run_id == on_one.mlflow_run_id
    import ray

    # the private instance has no autoscaler: Ray Train started no coordinator actor to ask one (training/launch.py)
    assert ray.util.list_named_actors(all_namespaces=True) == []
    assert logged_once(run_dir, 5), "steps before the checkpoint were trained twice: a restart"
    again = stopped_copy(run_dir, tmp_path / "again" / "pretrain", 10)
    with caplog.at_level(logging.INFO, logger="training.loop"):
        back = pretrain(tmp_path / "again", *settings)  # 1 worker from step 10
    assert "saved on 2 worker(s) with ep_size 1, now on 1 worker(s) with ep_size 1" in caplog.text
    assert logged_once(again, 10)
    for run in (on_two, back):
        curve = losses(Path(run.run_dir))
        assert sorted(curve) == list(range(1, 21))
        assert all(curve[s] == pytest.approx(golden[s], rel=2e-5) for s in golden), (curve, golden)
        # validated on the same sequences on 1 or 2 workers (steps 0, 10 and 20)
        assert val_by_step(run) == pytest.approx(val_by_step(golden_run), rel=2e-5)
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'again' / 'mlflow.db'}")
    history = client.get_metric_history(back.mlflow_run_id, "layout/world_size")
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (5, 2.0), (10, 1.0)]
    from training.parallel import fp32_state_dict

    a = fp32_state_dict(Path(golden_run.checkpoint), False)
    b = fp32_state_dict(Path(back.checkpoint), False)
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-5) for k in a)


def test_an_elastic_run_goes_on_with_the_workers_the_cluster_has_left(
    golden_run: TrainedModel, tmp_path: Path
) -> None:
    """`parallel.min_workers=1`: a worker of a 2-worker run is killed after the step-5 checkpoint while another job
    takes all but one of the cluster's CPUs; instead of waiting for two, the run goes on with one (its loop resumes
    on the new layout) and ends on the uninterrupted run's losses (the golden curve, up to reduction order)."""
    import os
    import signal
    import threading
    import time

    import psutil
    import ray

    from infra.ray_cluster import ensure_ray

    out = tmp_path / "elastic"
    settings = [*RESUME_STEPS, "parallel.min_workers=1", "parallel.max_failures=1"]
    finished: list[TrainedModel | BaseException] = []

    def run() -> None:
        try:
            finished.append(pretrain(out, *settings, workers=2))
        except BaseException as error:  # noqa: BLE001 - handed to the test thread
            finished.append(error)

    # Ray started from this (main) thread: its processes die with the thread that started them (PR_SET_PDEATHSIG),
    # and the driver thread ends before the module's other tests use them
    ensure_ray(3)
    driver = threading.Thread(target=run, daemon=True)
    driver.start()
    deadline = time.monotonic() + 300
    while not any(ckpt.complete_checkpoints(d / "checkpoints") for d in (out / "pretrain").glob("*")):
        assert driver.is_alive() and time.monotonic() < deadline, finished
        time.sleep(0.1)
    (run_dir,) = (out / "pretrain").iterdir()
    workers = [
        p
        for p in psutil.Process(os.getpid()).children(recursive=True)
        if "ray::RayTrainWorker" in " ".join(p.cmdline())
    ]
    assert len(workers) == 2, workers
    # another job asks for all CPUs but one: it starts once the killed group hands its CPUs back
    holder = ray.remote(num_cpus=int(ray.cluster_resources()["CPU"]) - 1)(Holder).remote()
    os.kill(workers[1].pid, signal.SIGKILL)
    driver.join(timeout=300)
    ray.kill(holder)
    (result,) = finished
    assert isinstance(result, TrainedModel), result
    layouts = [
        r["layout"]["world_size"]
        for r in map(ckpt.read_meta, (p for _, p in ckpt.complete_checkpoints(run_dir / "checkpoints")))
    ]
    assert layouts[-1] == 1, layouts
    curve, golden = losses(run_dir), losses(Path(golden_run.run_dir))
    assert sorted(curve) == list(range(1, 21))
    assert all(curve[s] == pytest.approx(golden[s], rel=2e-5) for s in golden), (curve, golden)


class Holder:
    """A stand-in for another job's actor holding CPUs."""

    def ready(self) -> bool:
        return True


def val_by_step(run: TrainedModel) -> dict[int, float]:
    return {int(r["step"]): r["val/loss"] for r in read_metrics(run.run_dir) if "val/loss" in r}


def test_damaged_final_checkpoint_is_reported_and_repaired(tmp_path: Path, caplog) -> None:
    """A truncated file in the newest checkpoint of a finished run: loading it names the damage in one line; a
    rerun falls back to the intact earlier checkpoint and rebuilds the same weights."""
    from infra.errors import UserError
    from training.parallel import fp32_state_dict

    recipe = load_recipe(
        "smoke",
        smoke_overrides(tmp_path, "train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=2"),
    )
    data = run_tokenize(recipe.data, recipe.output_dir)
    first = run_pretrain(recipe.pretrain_spec(), data)
    weights = fp32_state_dict(Path(first.checkpoint), False)
    biggest = max((p for p in Path(first.checkpoint).rglob("*.pt")), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:1000])

    with pytest.raises(UserError, match=rf"is damaged \({biggest}: 1000 bytes, .*\); rerun the command"):
        TrainedModel.load(first.run_dir)
    with caplog.at_level("WARNING"):
        repaired = run_pretrain(recipe.pretrain_spec(), data)
    assert "finished but is damaged" in caplog.text
    assert "step-00000004 is damaged" in caplog.text and "falling back" in caplog.text
    assert repaired.step == 4 and repaired.checkpoint == first.checkpoint
    again = fp32_state_dict(Path(repaired.checkpoint), False)
    assert weights.keys() == again.keys() and all(torch.equal(weights[k], again[k]) for k in weights)
    assert TrainedModel.load(first.run_dir) == repaired


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 6 MiB file system (tmpfs): room for the smoke data, the MLflow database and two checkpoints."""
    import subprocess

    mount = tmp_path / "disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({made.stderr.decode().strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_names_the_checkpoint_write_in_one_line(small_disk: Path, caplog, capfd) -> None:
    """The disk fills during a checkpoint, and then refuses MLflow's FAILED status too: the error names the
    checkpoint file and ENOSPC (not SQLAlchemy's hint about the second write), MLflow's store logs no traceback,
    and the two complete checkpoints stay loadable."""
    from infra.errors import expected_failure

    with caplog.at_level("WARNING"), pytest.raises(Exception) as raised:  # noqa: PT011 - inspected below
        pretrain_here(small_disk, "train.checkpoint_every=5", "train.max_steps=40")
    line = expected_failure(raised.value)
    assert line and line.startswith(f"disk full writing {small_disk}/pretrain/"), line
    assert "/checkpoints/.tmp-step-" in line and "[Errno 28] No space left on device" in line
    printed = capfd.readouterr().err  # MLflow's loggers print to stderr themselves (they do not propagate)
    assert "Traceback" not in printed and "SQLAlchemy database error" not in printed, printed[-2000:]
    assert [r.getMessage() for r in caplog.records if "could not mark MLflow run" in r.getMessage()]
    (run_dir,) = (small_disk / "pretrain").iterdir()
    done = [step for step, _ in ckpt.complete_checkpoints(run_dir / "checkpoints")]
    assert done and all(
        ckpt.damage(path) is None for _, path in ckpt.complete_checkpoints(run_dir / "checkpoints")
    )


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_checkpoints_the_current_step_and_the_rerun_continues(tmp_path: Path, workers: int) -> None:
    """What a scheduler does before it kills: SIGTERM to `lmforge pretrain` mid-run (no periodic checkpoint due).
    It ends within a minute in one line (exit 2), with a complete checkpoint at the step it stopped after and its
    MLflow run KILLED; the rerun continues from there and ends where an uninterrupted run does, bit for bit. With
    two Ray Train workers (threads of Ray actors, which signals never reach) both stop at the same step through the
    stop file, and the rerun continues on one worker (equal up to reduction order)."""
    import os
    import signal
    import subprocess
    import time

    import mlflow

    from tests.pretrain_helpers import clean_env, lmforge_command

    extra = ["train.max_steps=60", "train.checkpoint_every=1000", "train.eval_every=1000"]
    out = tmp_path / "stopped"
    args = lmforge_command(
        "pretrain", "smoke", "--workers", str(workers), *with_sets(smoke_overrides(out, *extra))
    )
    launch = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env()
    )
    deadline = time.monotonic() + 300
    while not any(step >= 3 for step, _ in _logged(out)):
        assert launch.poll() is None and time.monotonic() < deadline, launch.communicate()
        time.sleep(0.01)
    os.kill(launch.pid, signal.SIGTERM)
    seen = max(step for step, _ in _logged(out))
    sent = time.monotonic()
    _, stderr = launch.communicate(timeout=120)
    assert time.monotonic() - sent < 60 and launch.returncode == 2, stderr[-3000:]
    (line,) = [x for x in stderr.splitlines() if x.startswith("lmforge:")]
    (run_dir,) = (out / "pretrain").iterdir()
    stopped_at = max(step for step, _ in logged_losses(run_dir))
    assert 3 <= seen <= stopped_at <= seen + 10 < 60  # at the step it was on, not dozens of steps later
    if workers == 1:
        assert f"SIGTERM at step {stopped_at}: training stopped after writing the checkpoint" in line
    else:
        assert f"SIGTERM: the 2 workers stopped after writing a checkpoint under {run_dir}" in line
    assert [s for s, _ in ckpt.complete_checkpoints(run_dir / "checkpoints")] == [stopped_at]
    run_id = ckpt.read_meta(ckpt.latest_checkpoint(run_dir / "checkpoints"))["mlflow_run_id"]
    assert mlflow.MlflowClient(f"sqlite:///{out / 'mlflow.db'}").get_run(run_id).info.status == "KILLED"

    resumed = pretrain_here(out, *extra)  # on 1 worker, whatever stopped it
    straight = pretrain_here(tmp_path / "straight", *extra)
    assert resumed.mlflow_run_id == run_id and logged_once(run_dir, stopped_at)
    curve, reference = losses(run_dir), losses(Path(straight.run_dir))
    if workers == 1:
        assert curve == reference
    else:  # ZeRO-0 fp32: the module file holds the whole optimiser state, which one worker loads as it is
        assert sorted(curve) == sorted(reference)
        assert all(curve[s] == pytest.approx(reference[s], rel=2e-5) for s in reference), (curve, reference)


def _logged(out: Path) -> list[tuple[int, float]]:
    runs = list((out / "pretrain").glob("*/metrics.jsonl")) if (out / "pretrain").is_dir() else []
    return logged_losses(runs[0].parent) if runs else []
