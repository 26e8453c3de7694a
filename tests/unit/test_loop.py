"""The one training loop on the plain-PyTorch engine: the step's loss is the global token mean."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from data_pipeline.loader import IGNORE_INDEX, Batch
from infra.tracking import NullTracker
from training import checkpoint as ckpt
from training.config import OptimConfig, TrainConfig
from training.engine import PlainEngine, loss_scale
from training.loop import LoopSetup, LoopState, train_loop
from training.model.config import ModelConfig
from training.model.transformer import Transformer
from training.objective import Outcome, TokenCrossEntropy

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)


class Fixed:
    """A loader that yields the given batches in order."""

    def __init__(self, batches: list[Batch]) -> None:
        self.batches, self.position = batches, 0

    def next_batch(self) -> Batch:
        self.position += 1
        return self.batches[self.position - 1]

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


def sft_like_batches() -> list[Batch]:
    """Two micro-batches with very different numbers of loss-carrying (response) tokens: 14 and 2."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for keep in (7, 1):
        inputs = torch.randint(0, 64, (2, 8), generator=generator)
        targets = torch.randint(0, 64, (2, 8), generator=generator)
        targets[:, keep:] = IGNORE_INDEX
        batches.append(Batch(inputs, targets))
    return batches


def one_sgd_step(batches: list[Batch], tmp_path: Path) -> dict[str, torch.Tensor]:
    """Weights after one loop step with SGD at lr 1 (so the update is minus the gradient)."""
    model = Transformer(CFG, seed=1)
    engine = PlainEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), len(batches), grad_clip=0.0)
    optim = OptimConfig(lr=1.0, warmup_steps=0, schedule="constant", grad_clip=0.0)
    train = TrainConfig(seq_len=8, micro_batch_size=2, global_batch_size=2 * len(batches), max_steps=1)
    setup = LoopSetup(run_dir=tmp_path, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
    train_loop(engine, Fixed(batches), None, train, optim, setup, NullTracker(), LoopState())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_accumulated_step_equals_the_global_token_mean(tmp_path: Path) -> None:
    batches = sft_like_batches()
    stepped = one_sgd_step(batches, tmp_path)
    reference = Transformer(CFG, seed=1)
    before = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    inputs = torch.cat([b.inputs for b in batches])
    targets = torch.cat([b.targets for b in batches])
    logits = reference(inputs).logits
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX).backward()
    grads = {n: p.grad for n, p in reference.named_parameters()}
    for name, grad in grads.items():
        torch.testing.assert_close(stepped[name], before[name] - grad, rtol=1e-5, atol=1e-6)
    # a mean of the two micro-batch means would weigh the 2-token batch like the 14-token one
    mean_of_means = Transformer(CFG, seed=1)
    sum(
        F.cross_entropy(mean_of_means(b.inputs).logits.flatten(0, 1), b.targets.flatten()) / 2
        for b in batches
    ).backward()
    name = "model.layers.0.self_attn.q_proj.weight"
    other = dict(mean_of_means.named_parameters())[name].grad
    assert (other - grads[name]).abs().max() > 10 * (stepped[name] - (before[name] - grads[name])).abs().max()


def test_uniform_batches_keep_the_mean_of_means_exactly() -> None:
    assert loss_scale(128, 128 * 4 * 2, accumulation=4, world_size=2) == 1.0
    assert loss_scale(2, 16, accumulation=2, world_size=1) == 0.25


class PerSequence:
    """A stage-defined objective: mean over sequences of each sequence's mean token loss, plus a metric."""

    def units(self, batch: Batch) -> int:
        return batch.inputs.shape[0]

    def __call__(self, engine: PlainEngine, batch: Batch) -> Outcome:
        logits = engine.forward(batch).logits
        per_token = F.cross_entropy(
            logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(batch.targets.shape)
        mask = (batch.targets != IGNORE_INDEX).float()
        per_sequence = (per_token * mask).sum(1) / mask.sum(1)
        return Outcome(loss=per_sequence.mean(), metrics={"seq/max_loss": per_sequence.max()})


def test_a_stage_objective_replaces_the_loss_and_adds_metrics(tmp_path: Path) -> None:
    import json

    batches = sft_like_batches()
    model = Transformer(CFG, seed=1)
    engine = PlainEngine(model, torch.optim.SGD(model.parameters(), lr=1.0), 2, grad_clip=0.0)
    optim = OptimConfig(lr=1.0, warmup_steps=0, schedule="constant", grad_clip=0.0)
    train = TrainConfig(seq_len=8, micro_batch_size=2, global_batch_size=4, max_steps=1)
    setup = LoopSetup(run_dir=tmp_path, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
    train_loop(engine, Fixed(batches), None, train, optim, setup, NullTracker(), LoopState(), PerSequence())
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    reference = Transformer(CFG, seed=1)
    with torch.no_grad():
        expected = torch.stack(
            [PerSequence()(PlainEngine(reference, None, 1, 0.0), b).loss for b in batches]
        ).mean()
    assert record["train/loss"] == pytest.approx(float(expected), rel=1e-6)  # 4 sequences, equal weights
    assert "seq/max_loss" in record


def random_batches(n: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(3)
    return [
        Batch(
            torch.randint(0, 64, (2, 8), generator=generator),
            torch.randint(0, 64, (2, 8), generator=generator),
        )
        for _ in range(n)
    ]


def wsd_run(tmp_path: Path, max_steps: int, horizons: tuple[int, ...] = ()) -> tuple[dict, list[dict]]:
    """Weights and metrics records of an AdamW WSD run on fixed batches, validated on the first batch."""
    from training.loop import read_jsonl

    tmp_path.mkdir()
    model = Transformer(CFG, seed=1)
    optim = OptimConfig(lr=1e-2, warmup_steps=2, schedule="wsd", decay_fraction=0.25)
    engine = PlainEngine(model, torch.optim.AdamW(model.parameters(), lr=optim.lr), 1, grad_clip=1.0)
    train = TrainConfig(seq_len=8, micro_batch_size=2, max_steps=max_steps, eval_every=100, horizons=horizons)
    setup = LoopSetup(run_dir=tmp_path, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
    batches = random_batches(max_steps + 10)
    train_loop(
        engine, Fixed(batches), lambda: iter(batches[:1]), train, optim, setup, NullTracker(), LoopState()
    )
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, read_jsonl(
        tmp_path / "metrics.jsonl"
    )


def test_decay_branches_match_separate_runs_and_leave_the_main_run_unchanged(tmp_path: Path) -> None:
    """A 16-step run with horizons 8 and 12: each branch's loss equals a separate 8- or 12-step run's final loss,
    and the 16-step run's weights are bit-identical to a run without branches."""
    main, records = wsd_run(tmp_path / "multi", 16, horizons=(8, 12))
    plain, _ = wsd_run(tmp_path / "plain", 16)
    for name in main:
        assert torch.equal(main[name], plain[name]), name
    branches = {int(r["horizon/steps"]): r["horizon/val_loss"] for r in records if "horizon/steps" in r}
    assert sorted(branches) == [8, 12]
    for horizon, loss in branches.items():
        _, alone = wsd_run(tmp_path / f"alone-{horizon}", horizon)
        assert loss == pytest.approx([r["val/loss"] for r in alone if "val/loss" in r][-1], rel=1e-6)
    assert not (tmp_path / "multi" / "branch").exists()


def test_a_torn_metrics_line_is_skipped_with_a_warning(tmp_path: Path, caplog) -> None:
    """What a crash mid-write leaves (then a resumed run appends after it) must not make the run unfinishable."""
    from training.loop import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 3.0}\n{"step": 2, "train/lo\n{"step": 2, "val/loss": 2.5}\n')
    assert read_jsonl(path) == [{"step": 1, "train/loss": 3.0}, {"step": 2, "val/loss": 2.5}]
    assert "metrics.jsonl:2: skipped a torn record" in caplog.text
    # a crash that tore the last line: the resumed loop terminates it before appending
    from training.loop import end_line

    path.write_text('{"step": 1, "train/loss": 3.0}\n{"step": 2, "train/lo')
    end_line(path)
    with path.open("a") as f:
        f.write('{"step": 2, "train/loss": 2.9}\n')
    assert read_jsonl(path)[-1] == {"step": 2, "train/loss": 2.9}


def test_the_loop_terminates_a_torn_last_line_before_it_appends(tmp_path: Path) -> None:
    """The loop itself repairs what a crash left: a run directory whose metrics.jsonl ends mid-record loses only
    that record, and every step the loop logs is read back."""
    from training.loop import read_jsonl

    torn = '{"step": 1, "train/loss": 3.0}\n{"step": 2, "train/lo'
    (tmp_path / "metrics.jsonl").write_text(torn)
    model = Transformer(CFG, seed=1)
    engine = PlainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, grad_clip=0.0)
    optim = OptimConfig(lr=0.1, warmup_steps=0, schedule="constant", grad_clip=0.0)
    train = TrainConfig(seq_len=8, micro_batch_size=2, global_batch_size=2, max_steps=2, checkpoint_every=2)
    setup = LoopSetup(run_dir=tmp_path, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
    train_loop(engine, Fixed(sft_like_batches()), None, train, optim, setup, NullTracker(), LoopState())
    steps = [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1, 1, 2]  # the record before the tear, then both steps of this run


class Recording(NullTracker):
    """Remembers the order of logged steps and flushes."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "train/loss" in metrics:
            self.events.append(f"step {step}")

    def flush(self) -> None:
        self.events.append("flush")


def test_metrics_before_a_checkpoint_are_sent_before_it_is_written(tmp_path: Path) -> None:
    """A worker killed after a checkpoint resumes from it and never re-logs earlier steps (two-node CI failure:
    MLflow held back steps 1-10 in its 2 s buffer, the kill lost them)."""
    batches = sft_like_batches() * 2
    model = Transformer(CFG, seed=1)
    engine = PlainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, grad_clip=0.0)
    optim = OptimConfig(lr=0.1, warmup_steps=0, schedule="constant", grad_clip=0.0)
    train = TrainConfig(seq_len=8, micro_batch_size=2, global_batch_size=2, max_steps=4, checkpoint_every=2)
    setup = LoopSetup(run_dir=tmp_path, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
    tracker = Recording()
    train_loop(engine, Fixed(batches), None, train, optim, setup, tracker, LoopState())
    assert tracker.events == ["step 1", "step 2", "flush", "step 3", "step 4", "flush"]


def test_a_remote_checkpoint_is_marked_complete_only_after_its_files(tmp_path: Path) -> None:
    """On object storage, COMPLETE is the last object written for a checkpoint (after every file it lists, the
    meta and the metrics) and the first one deleted when an old checkpoint is pruned: a node never sees a
    complete checkpoint with a file missing. Observed from the store's own sequence of writes, not from a kill."""
    import json
    from dataclasses import dataclass, field

    import pyarrow.fs as pafs

    from infra.object_store import Store
    from infra.storage import sha256_file

    @dataclass(frozen=True)
    class RecordingStore(Store):
        writes: list[str] = field(default_factory=list)
        completes: dict[str, dict] = field(default_factory=dict)

        def upload(self, local: Path, relative: str) -> None:
            self.writes.append(f"put {relative}")
            if relative.endswith("/COMPLETE"):
                self.completes[relative] = json.loads(local.read_text())
            # a local "bucket" needs its folders
            Path(self.key(relative)).parent.mkdir(parents=True, exist_ok=True)
            super().upload(local, relative)

        def delete(self, relative: str) -> None:
            self.writes.append(f"delete {relative}")
            super().delete(relative)

    class HashingEngine(PlainEngine):
        """Reports the file it wrote with its digest, as the DeepSpeed engine's writer does."""

        def save(self, directory: Path) -> None:
            super().save(directory)
            self.last = directory / "engine.pt"

        def saved(self) -> dict[Path, dict[str, Any]]:
            return {self.last: {"bytes": self.last.stat().st_size, "sha256": sha256_file(self.last)}}

    (tmp_path / "bucket").mkdir()
    store = RecordingStore(
        f"s3://{tmp_path}/bucket/run", pafs.LocalFileSystem(), str(tmp_path / "bucket"), "run"
    )
    model = Transformer(CFG, seed=1)
    engine = HashingEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, grad_clip=0.0)
    optim = OptimConfig(lr=0.1, warmup_steps=0, schedule="constant", grad_clip=0.0)
    train = TrainConfig(
        seq_len=8,
        micro_batch_size=2,
        global_batch_size=2,
        max_steps=6,
        checkpoint_every=2,
        keep_checkpoints=1,
    )
    run_dir = tmp_path / "local"
    run_dir.mkdir()
    setup = LoopSetup(run_dir, 0, 1, flops_per_token=1, peak_flops=1.0, meta={}, remote=store)
    train_loop(engine, Fixed(sft_like_batches() * 3), None, train, optim, setup, NullTracker(), LoopState())

    writes = store.writes
    for step in (2, 4, 6):
        prefix = f"checkpoints/step-{step:08d}/"
        complete = writes.index(f"put {prefix}COMPLETE")
        listed = store.completes[f"{prefix}COMPLETE"]["files"]
        assert {"engine.pt", "rank-0.pt", "meta.json"} <= set(listed)
        before = writes[:complete]
        assert all(f"put {prefix}{name}" in before for name in listed), (step, writes)
        assert "put metrics.jsonl" in before
        assert not any(w.startswith(f"put {prefix}") for w in writes[complete + 1 :]), (step, writes)
    for step in (2, 4):  # pruned (keep 1): COMPLETE goes first
        deletes = [w for w in writes if w.startswith(f"delete checkpoints/step-{step:08d}/")]
        assert len(deletes) >= 4 and deletes[0].endswith("/COMPLETE"), deletes
    assert store.listing("checkpoints").keys() >= {"step-00000006/COMPLETE", "step-00000006/engine.pt"}


class SpikeAt:
    """Cross-entropy, ten times too large on the given calls (a corrupted batch)."""

    def __init__(self, poisoned: set[int]) -> None:
        self.poisoned, self.calls, self.inner = poisoned, 0, TokenCrossEntropy()

    def units(self, batch: Batch) -> int:
        return self.inner.units(batch)

    def __call__(self, engine: PlainEngine, batch: Batch) -> Outcome:
        self.calls += 1
        out = self.inner(engine, batch)
        return Outcome(out.loss * 10, out.aux_loss) if self.calls in self.poisoned else out


class GradientSpikeAt(SpikeAt):
    """The loss as it is, its gradient ten times too large on the given calls (the loss detector cannot see it)."""

    def __call__(self, engine: PlainEngine, batch: Batch) -> Outcome:
        self.calls += 1
        out = self.inner(engine, batch)
        if self.calls not in self.poisoned:
            return out
        return Outcome(out.loss * 10 - (out.loss * 9).detach(), out.aux_loss)


class CheckpointsAtRollBack(NullTracker):
    """Records which checkpoints exist when a roll-back is logged."""

    def __init__(self, root: Path) -> None:
        self.root, self.seen = root, []

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if "train/rollbacks" in metrics:
            self.seen.append(sorted(step for step, _ in ckpt.complete_checkpoints(self.root)))


def spiky_run(
    tmp_path: Path,
    poisoned: set[int],
    steps: int,
    tracker: NullTracker | None = None,
    spikes: type[SpikeAt] = SpikeAt,
    **train: Any,
) -> tuple[PlainEngine, LoopState]:
    """SGD on one repeated batch (a smoothly falling loss) with the loss spiking on the `poisoned` calls."""
    generator = torch.Generator().manual_seed(0)
    batch = Batch(
        torch.randint(0, 64, (2, 8), generator=generator), torch.randint(0, 64, (2, 8), generator=generator)
    )
    model = Transformer(CFG, seed=1)
    engine = PlainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, grad_clip=0.0)
    optim = OptimConfig(lr=0.1, warmup_steps=0, schedule="constant", grad_clip=0.0)
    settings = {"spike_window": 10, "checkpoint_every": 1000, **train}
    cfg = TrainConfig(seq_len=8, micro_batch_size=2, max_steps=steps, **settings)
    tmp_path.mkdir(parents=True)
    setup = LoopSetup(run_dir=tmp_path, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
    batches = Fixed([batch] * 2 * steps)  # a roll-back trains some steps again, on later batches
    tracker = tracker or NullTracker()
    state = train_loop(engine, batches, None, cfg, optim, setup, tracker, LoopState(), spikes(poisoned))
    return engine, state


def test_a_loss_spike_is_skipped_and_logged(tmp_path: Path, caplog) -> None:
    """A corrupted batch at step 12 (10x the loss): no update, one log line naming the step, counted in MLflow's
    metrics; the same batch with the detector off moves the weights. Too many in a row stop the run."""
    from training.loop import TrainingHalted

    before, _ = spiky_run(tmp_path / "before", set(), 11)
    with caplog.at_level("WARNING"):
        after, state = spiky_run(tmp_path / "after", {12}, 12)
    assert all(
        torch.equal(a, b) for a, b in zip(before.module.parameters(), after.module.parameters(), strict=True)
    )
    assert (
        state.spikes == 1
        and state.skipped_steps == 1
        and "step 12 skipped: a micro-batch's loss" in caplog.text
    )
    records = [json.loads(line) for line in (tmp_path / "after" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/spikes" in r] == [12]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 12))
    off, _ = spiky_run(tmp_path / "off", {12}, 12, spike_window=0)
    assert not all(
        torch.equal(a, b) for a, b in zip(before.module.parameters(), off.module.parameters(), strict=True)
    )
    with pytest.raises(TrainingHalted, match=r"3 consecutive steps were skipped \(the last for a loss spike"):
        spiky_run(tmp_path / "halted", {12, 13, 14}, 14, max_bad_steps=3)


def test_repeated_spikes_roll_back_to_the_checkpoint_before_them(tmp_path: Path, caplog) -> None:
    """Spikes at steps 12, 16 and 17 (three within the window): the run reloads step 10's checkpoint (the newest
    before the first spike; step 15's belongs to the abandoned steps and is discarded) and trains steps 11-20
    again on the batches after step 17's. The batches are all alike, so it ends where an unspiked run ends; with
    roll-back off the three skipped steps leave it elsewhere."""
    caplog.set_level(logging.WARNING, logger="training.loop")
    clean, _ = spiky_run(tmp_path / "clean", set(), 20)
    settings = {"checkpoint_every": 5, "rollback_window": 10}
    seen = CheckpointsAtRollBack(tmp_path / "rolled" / "checkpoints")
    rolled, state = spiky_run(tmp_path / "rolled", {12, 16, 17}, 20, seen, **settings)
    assert state.rollbacks == 1 and state.spikes == 3 and state.step == 20
    assert seen.seen == [[10]]  # step 15's checkpoint (abandoned steps) is gone, a resume cannot pick it
    final = tmp_path / "rolled" / "checkpoints" / f"step-{20:08d}"
    # batches 11-17 skipped, not repeated
    assert ckpt.load_rank_state(final, 0)["loader"]["position"] == 17 + 10
    assert all(
        torch.equal(a, b) for a, b in zip(clean.module.parameters(), rolled.module.parameters(), strict=True)
    )
    assert "rolled back from step 17 to the checkpoint of step 10 after 3 loss spikes (steps 12, 16, 17)" in (
        caplog.text
    )
    records = [json.loads(line) for line in (tmp_path / "rolled" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["train/rollback_to"]) for r in records if "train/rollbacks" in r] == [(17, 10)]
    steps = [r["step"] for r in records if "train/loss" in r]  # 11 and 13-15 were trained twice
    assert steps == [*range(1, 12), 13, 14, 15, *range(11, 21)]
    for step in (15, 20):  # written after the roll-back, from the reloaded state
        meta = json.loads(
            (tmp_path / "rolled" / "checkpoints" / f"step-{step:08d}" / "meta.json").read_text()
        )
        assert meta["loop"]["rollbacks"] == 1
    off, _ = spiky_run(tmp_path / "off", {12, 16, 17}, 20, rollback_spikes=0, **settings)
    assert not all(
        torch.equal(a, b) for a, b in zip(clean.module.parameters(), off.module.parameters(), strict=True)
    )


def test_gradient_norm_spikes_are_counted_and_logged_but_not_undone(tmp_path: Path, caplog) -> None:
    """A gradient ten times too large at an unchanged loss (step 12): counted and logged with its step; its update
    is applied (the norm is known only after it), and it does not count toward the roll-back, even at
    `rollback_spikes=1`: healthy small runs have such norms (30 in 12 of the 156 runs of one test-suite run)."""
    caplog.set_level(logging.DEBUG, logger="training.loop")
    clean, clean_state = spiky_run(tmp_path / "clean", set(), 20)
    assert clean_state.grad_spikes == 0
    spiked, state = spiky_run(
        tmp_path / "spiked", {12}, 20, spikes=GradientSpikeAt, checkpoint_every=5, rollback_spikes=1
    )
    assert state.grad_spikes >= 1 and state.skipped_steps == 0 and state.rollbacks == 0
    assert "step 12: the gradient norm" in caplog.text and "is a spike" in caplog.text
    records = [json.loads(line) for line in (tmp_path / "spiked" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/grad_spikes" in r][0] == 12
    assert not any("train/rollbacks" in r for r in records)
    assert not all(
        torch.equal(a, b) for a, b in zip(clean.module.parameters(), spiked.module.parameters(), strict=True)
    )


def on_two_ranks(function: Callable[[int, int, str], None], out: Path) -> None:
    """`function(rank, port, out)` on two processes forked from a server that imported torch and this module once
    (a spawned process imports them itself: ~6 s each here); not forks of this process, whose state they must not
    inherit."""
    import torch.multiprocessing as mp

    from infra.services import free_port

    mp.set_forkserver_preload(["torch", "training.loop", __name__])
    mp.start_processes(function, args=(free_port(), str(out)), nprocs=2, start_method="forkserver")


def _step_on_two_ranks(rank: int, port: int, out: str) -> None:
    """Rank 1's micro-batch carries no loss (an SFT batch without response tokens): both ranks must take the same
    step, spike check included (it is a collective)."""
    import os

    import torch.distributed as dist

    from training.loop import optimizer_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    generator = torch.Generator().manual_seed(0)
    inputs, targets = (
        torch.randint(0, 64, (2, 8), generator=generator),
        torch.randint(0, 64, (2, 8), generator=generator),
    )
    if rank == 1:
        targets[:] = IGNORE_INDEX
    model = Transformer(CFG, seed=1)
    engine = PlainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, grad_clip=0.0)
    outcome = optimizer_step(
        engine, Fixed([Batch(inputs, targets)]), TokenCrossEntropy(), 0.1, 2, spike_above=100.0
    )
    Path(out, f"rank{rank}.json").write_text(json.dumps({"loss": outcome.loss, "spike": outcome.spike}))
    dist.destroy_process_group()


def test_ranks_without_a_loss_take_part_in_the_spike_check(tmp_path: Path) -> None:
    on_two_ranks(_step_on_two_ranks, tmp_path)
    outcomes = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert outcomes[0] == outcomes[1] and outcomes[0]["spike"] is None and outcomes[0]["loss"] is not None


class SlowRank(TokenCrossEntropy):
    """Cross-entropy, with `delay` seconds of extra work in each of the first `calls` forward passes (a slow node)."""

    def __init__(self, delay: float, calls: int) -> None:
        self.delay, self.calls = delay, calls

    def __call__(self, engine: PlainEngine, batch: Batch) -> Outcome:
        if self.calls > 0:
            self.calls -= 1
            time.sleep(self.delay)
        return super().__call__(engine, batch)


def _train_on_two_ranks(rank: int, port: int, out: str) -> None:
    """Eight steps on two gloo ranks, rank 1 0.2 s slower per forward pass in the first four; rank 0 logs to `out`."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    logging.basicConfig(filename=Path(out, f"rank{rank}.log"), level=logging.WARNING)
    generator = torch.Generator().manual_seed(rank)
    batch = Batch(
        torch.randint(0, 64, (2, 8), generator=generator), torch.randint(0, 64, (2, 8), generator=generator)
    )
    model = Transformer(CFG, seed=1)
    engine = PlainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, grad_clip=0.0)
    optim = OptimConfig(lr=0.1, warmup_steps=0, schedule="constant", grad_clip=0.0)
    cfg = TrainConfig(
        seq_len=8,
        micro_batch_size=2,
        max_steps=8,
        checkpoint_every=1000,
        straggler_window=4,
        straggler_factor=10,
    )
    setup = LoopSetup(run_dir=Path(out), rank=rank, world_size=2, flops_per_token=1, peak_flops=1.0, meta={})
    objective = SlowRank(0.2 if rank == 1 else 0.0, calls=4)
    train_loop(engine, Fixed([batch] * 8), None, cfg, optim, setup, NullTracker(), LoopState(), objective)
    dist.destroy_process_group()


def test_a_rank_slower_than_the_others_is_named(tmp_path: Path) -> None:
    """Rank 1 sleeps 0.2 s in each forward pass of steps 1-4 (its peer waits for it in the gradient all-reduce, so
    both ranks' steps take as long): the report at step 4 names it, the one at step 8 (both alike) nobody."""
    on_two_ranks(_train_on_two_ranks, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    reports = {
        r["step"]: (r["perf/slowest_rank"], r["perf/straggler_ratio"])
        for r in records
        if "perf/slowest_rank" in r
    }
    assert set(reports) == {4, 8} and reports[4][0] == 1 and reports[4][1] > 10 and reports[8][1] < 10, (
        reports
    )
    warnings = [line for line in (tmp_path / "rank0.log").read_text().splitlines() if "straggler" in line]
    assert len(warnings) == 1 and "rank 1 (" in warnings[0] and "to step 4" in warnings[0], warnings


def test_the_spike_limit_is_sigmas_above_the_mean_and_never_less_than_the_floor() -> None:
    """`spike_limit`: mean + spike_sigmas·std of the recent window, but at least (1 + spike_min_rise)·mean, so a
    flat curve (std ~0) does not call every small wobble a spike; None until half the window is known."""
    from training.config import TrainConfig
    from training.loop import spike_limit

    cfg = TrainConfig(spike_window=10, spike_sigmas=6.0, spike_min_rise=0.25)
    assert spike_limit([2.0] * 4, cfg) is None  # fewer than half the window
    flat = [2.0, 2.001, 1.999, 2.0, 2.0, 2.001]
    assert spike_limit(flat, cfg) == pytest.approx(2.5, rel=1e-3)  # the floor: 25% above the mean
    noisy = [
        2.0,
        3.0,
        2.0,
        3.0,
        2.0,
        3.0,
    ]  # (population) std 0.5: six of them 3.0 above the mean, past the floor's
    assert spike_limit(noisy, cfg) == pytest.approx(2.5 + 6 * 0.5)  # 0.625
    assert spike_limit(flat, TrainConfig(spike_window=0)) is None
