"""The DeepSpeed engine in this process (CPU accelerator, gloo, world size 1): expert-parallel MoE semantics,
the non-finite-loss guard, activation checkpointing and the optimisers."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from data_pipeline.loader import PackedLoader
from data_pipeline.shards import DatasetManifest
from flows.recipe import load_recipe
from infra.tracking import NullTracker
from training.loop import LoopSetup, LoopState, TrainingHalted, train_loop
from training.model.config import MoEConfig
from training.model.moe import MoE
from training.model.transformer import ModelOutput, Transformer
from training.objective import Outcome, TokenCrossEntropy

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def process_group() -> None:
    from training.parallel import init_distributed

    init_distributed()


def test_the_process_group_skips_deepspeeds_inference_comm_op() -> None:
    """DeepSpeed compiles its CPU shared-memory all-reduce op (~50 s of C++ per environment) when it starts a process
    group, though only its inference all-reduce uses it; lmforge's process group has none."""
    from deepspeed.comm import comm

    assert comm.cdb is not None and comm.cdb.shm_comm_op is None


def engine_for(model: Transformer, *overrides: str):
    from training.parallel import build_engine

    recipe = load_recipe("smoke", list(overrides))
    return build_engine(model, recipe.optim, recipe.parallel, recipe.train), recipe


def test_a_zero3_engine_leaves_torch_linear_alone() -> None:
    """DeepSpeed's ZeRO-3 can swap torch.nn.functional.linear for the rest of the process; lmforge runs stages one
    after another in one process (`lmforge pipeline`), and torchao's quantized weights fail in the swapped one."""
    linear = torch.nn.functional.linear
    engine_for(Transformer(load_recipe("smoke").model), "parallel.zero_stage=3")
    assert torch.nn.functional.linear is linear


def run_steps(
    engine,
    recipe,
    manifest: DatasetManifest,
    run_dir: Path,
    steps: int,
    state: LoopState | None = None,
    checkpoint_every: int = 10_000,
) -> LoopState:
    loader = PackedLoader(manifest, seq_len=recipe.train.seq_len, batch_size=recipe.train.micro_batch_size)
    for _ in range(state.step * engine.accumulation_steps if state else 0):
        loader.next_batch()
    setup = LoopSetup(run_dir=run_dir, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
    train = recipe.train.model_copy(
        update={"max_steps": steps, "checkpoint_every": checkpoint_every, "max_bad_steps": 3}
    )
    return train_loop(engine, loader, None, train, recipe.optim, setup, NullTracker(), state or LoopState())


def test_deepspeed_expert_layer_matches_ours() -> None:
    from training.parallel.expert_parallel import ExpertParallelMoE

    cfg = MoEConfig(n_experts=4, top_k=2, d_ff_expert=32)
    ours = MoE(48, cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.normal_(0, 0.2, generator=generator)
    theirs = ExpertParallelMoE(48, cfg, ep_size=1)
    theirs.load_from(ours)
    x = torch.randn(2, 24, 48, generator=generator)
    (y_ours, stats_ours), (y_theirs, stats_theirs) = ours(x), theirs(x)
    torch.testing.assert_close(y_theirs, y_ours, rtol=1e-5, atol=1e-6)
    assert stats_theirs.tokens_per_expert.tolist() == stats_ours.tokens_per_expert.tolist()
    # The balancing losses differ by design: DeepSpeed's top-2 gate counts first choices only (GShard).
    assert torch.isfinite(stats_theirs.aux_loss)


class NonFiniteAt(Transformer):
    """The smoke model, except that forward passes listed in `poisoned` return a NaN loss."""

    poisoned: set[int] = set()
    calls = 0

    def forward(self, tokens, targets=None, cache=None, logits_grad=True) -> ModelOutput:  # noqa: ANN001
        out = super().forward(tokens, targets, cache, logits_grad)
        NonFiniteAt.calls += 1
        if targets is not None and NonFiniteAt.calls in NonFiniteAt.poisoned:
            out.ce_loss = out.ce_loss * float("nan")  # what the loop's objective is built from
        return out


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def test_non_finite_loss_skips_the_step(tokenized: tuple[DatasetManifest, Path], tmp_path: Path) -> None:
    manifest, _ = tokenized
    recipe = load_recipe("smoke")
    NonFiniteAt.calls, NonFiniteAt.poisoned = 0, {4}  # step 2's second micro-batch (2 micro-batches per step)
    engine, recipe = engine_for(NonFiniteAt(recipe.model), "optim.warmup_steps=1")
    state = run_steps(engine, recipe, manifest, tmp_path, steps=1)
    before = snapshot(engine)
    state = run_steps(engine, recipe, manifest, tmp_path, steps=2, state=state)
    after_bad = snapshot(engine)
    assert all(torch.equal(before[k], after_bad[k]) for k in before), (
        "a step with a NaN loss moved the weights"
    )
    assert state.skipped_steps == 1
    state = run_steps(engine, recipe, manifest, tmp_path, steps=3, state=state)
    assert any(not torch.equal(after_bad[k], v) for k, v in snapshot(engine).items())
    assert state.consecutive_bad == 0
    logged = (tmp_path / "metrics.jsonl").read_text()
    assert '"train/skipped_steps": 1' in logged


def test_consecutive_non_finite_losses_halt_the_run(
    tokenized: tuple[DatasetManifest, Path], tmp_path: Path
) -> None:
    manifest, _ = tokenized
    recipe = load_recipe("smoke")
    NonFiniteAt.calls, NonFiniteAt.poisoned = 0, set(range(1, 100))
    engine, recipe = engine_for(NonFiniteAt(recipe.model))
    with pytest.raises(
        TrainingHalted, match=r"3 consecutive steps were skipped \(the last for a non-finite loss"
    ):
        run_steps(engine, recipe, manifest, tmp_path, steps=10)


class SpikeAfter(TokenCrossEntropy):
    """Cross-entropy ten times too large on the given calls (micro-batches): a corrupted batch."""

    def __init__(self, poisoned: set[int]) -> None:
        self.poisoned, self.calls = poisoned, 0

    def __call__(self, engine, batch) -> Outcome:  # noqa: ANN001
        self.calls += 1
        out = super().__call__(engine, batch)
        return replace(out, loss=out.loss * 10) if self.calls in self.poisoned else out


class WeightsAt(NullTracker):
    """The engine's weights when step `step` is logged and when a roll-back is."""

    def __init__(self, engine, step: int) -> None:  # noqa: ANN001
        self.engine, self.step, self.seen = engine, step, {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if step == self.step and "train/loss" in metrics:
            self.seen["checkpointed"] = snapshot(self.engine)
        if "train/rollbacks" in metrics:
            self.seen["rolled back"] = snapshot(self.engine)


def test_spikes_roll_the_engine_back_to_its_checkpoint(
    tokenized: tuple[DatasetManifest, Path], tmp_path: Path
) -> None:
    """The DeepSpeed engine reloads its step-5 checkpoint mid-run when three steps spike (7-9, two
    micro-batches per step), and trains on to the end."""
    manifest, _ = tokenized
    engine, recipe = engine_for(Transformer(load_recipe("smoke").model))
    loader = PackedLoader(manifest, seq_len=recipe.train.seq_len, batch_size=recipe.train.micro_batch_size)
    setup = LoopSetup(run_dir=tmp_path, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
    train = recipe.train.model_copy(update={"max_steps": 10, "checkpoint_every": 5, "spike_window": 4})
    tracker = WeightsAt(engine, 5)
    state = train_loop(
        engine, loader, None, train, recipe.optim, setup, tracker, LoopState(), SpikeAfter(set(range(13, 19)))
    )
    assert state.rollbacks == 1 and state.step == 10
    assert all(
        torch.equal(tracker.seen["checkpointed"][k], v) for k, v in tracker.seen["rolled back"].items()
    )


def losses_of(tmp_path: Path) -> list[float]:
    import json

    return [json.loads(line)["train/loss"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_activation_checkpointing_changes_nothing_but_memory(
    tokenized: tuple[DatasetManifest, Path], tmp_path: Path
) -> None:
    manifest, _ = tokenized
    recipe = load_recipe("smoke")
    for name, flag in (("plain", "false"), ("ckpt", "true")):
        engine, r = engine_for(Transformer(recipe.model), f"parallel.activation_checkpointing={flag}")
        (tmp_path / name).mkdir()
        run_steps(engine, r, manifest, tmp_path / name, steps=3)
    assert losses_of(tmp_path / "ckpt") == pytest.approx(losses_of(tmp_path / "plain"), rel=1e-6)


def test_compiled_blocks_train_as_eager_does(tokenized: tuple[DatasetManifest, Path], tmp_path: Path) -> None:
    """torch.compile (Inductor's CPU backend here) of the blocks and the head: the same losses and weights as
    eager after 3 steps, to fp32 rounding; activation checkpointing over compiled blocks too."""
    manifest, _ = tokenized
    recipe = load_recipe("smoke")
    weights = {}
    for name, sets in (
        ("eager", ["parallel.compile=false"]),
        ("compiled", ["parallel.compile=true"]),
        ("compiled-ckpt", ["parallel.compile=true", "parallel.activation_checkpointing=true"]),
    ):
        engine, r = engine_for(Transformer(recipe.model), *sets)
        assert ("forward" in vars(engine.module.model.layers[0])) == (name != "eager")  # the compiled wrapper
        assert ("logits_and_loss" in vars(engine.module)) == (name != "eager")  # and the compiled output head
        (tmp_path / name).mkdir()
        run_steps(engine, r, manifest, tmp_path / name, steps=3)
        weights[name] = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
    for name in ("compiled", "compiled-ckpt"):
        assert losses_of(tmp_path / name) == pytest.approx(losses_of(tmp_path / "eager"), rel=1e-5)
        assert torch.allclose(weights[name], weights["eager"], rtol=1e-4, atol=1e-6)


def test_compiled_moe_blocks_reuse_one_graph_as_routing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An MoE model compiled (bf16: under torch.compile a CPU's `grouped_mm` takes no other dtype): routing changes
    the experts' row counts every step; once they first changed, its blocks run one symbolic graph instead of
    recompiling per count (~3 s each), and train as eager does to bf16's rounding, the optimiser's compiled step
    with them. (The experts stay grouped: the batched layout, where routing is balanced, is a second graph, once.)"""
    from torch._dynamo.utils import counters

    from data_pipeline.loader import Batch
    from training.model import moe

    monkeypatch.setattr(moe, "BATCH_PADDING", 0.0)

    recipe = load_recipe("smoke")
    # 16 experts: the padded row counts take many values (4 took only a few, all seen in the first steps)
    cfg = recipe.model.model_copy(update={"moe": MoEConfig(n_experts=16, top_k=2, d_ff_expert=64)})
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.vocab_size, (4, 65), generator=generator) for _ in range(10)]
    losses = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        sets = (
            "parallel.precision=bf16",
            f"parallel.compile={compiled}".lower(),
            "train.global_batch_size=4",
        )
        engine, _ = engine_for(Transformer(cfg), *sets)
        assert ("forward" in vars(engine.module.model.layers[0])) == compiled
        assert engine.ds.optimizer.compiled == compiled
        losses[compiled] = []
        for i, tokens in enumerate(batches):
            if i == 1:
                graphs = counters["stats"]["unique_graphs"]
            loss = engine.forward(Batch(tokens[:, :-1], tokens[:, 1:])).loss
            engine.backward(loss)
            engine.step(1e-3)
            losses[compiled].append(float(loss.detach()))
        if compiled:
            assert counters["stats"]["unique_graphs"] == graphs  # steps 2-10: no new graph
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)


def test_a_failing_compile_falls_back_to_eager_with_one_warning() -> None:
    """Inductor's C++ compiler is `false` (a real program that fails): one warning, and the eager blocks train.
    (Inductor's own `patch`: monkeypatching its config module hid `force_disable_caches` from later compiles.)"""
    from torch._inductor import config as inductor

    torch._dynamo.reset()
    recipe = load_recipe("smoke")
    model = Transformer(recipe.model)
    broken = inductor.patch({"cpp.cxx": ("false",), "force_disable_caches": True})
    with broken, pytest.warns(UserWarning, match="torch.compile failed on a trial step") as caught:
        engine, _ = engine_for(model, "parallel.compile=true")
    assert len([w for w in caught if "parallel.compile" in str(w.message)]) == 1
    assert "forward" not in vars(engine.module.model.layers[0])  # the class's eager forward
    batch = FixedBatch(recipe.model.vocab_size).next_batch()
    engine.backward(engine.forward(batch).loss)
    assert engine.step(1e-3) > 0
    torch._dynamo.reset()


def test_compile_is_auto_on_cuda_and_for_wide_dense_models_on_a_cpu() -> None:
    """auto: every model on CUDA; on a CPU softmax-attention models from d_model 256 (384: compile paid back after
    ~100 steps), not the demo's 64 (~10,000 steps), MoE in bf16 only (in fp32 a compiled MoE step was no faster),
    not linear attention (not measured). The bf16
    optimiser step (`MasterWeights`) compiles under auto from d_model 256 on a CPU, MoE and linear attention
    included (its shapes never change), not on CUDA (not measured there)."""
    from training.compile import compiles_optimizer, wants_compile

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    small = load_recipe("smoke").model
    wide = small.model_copy(update={"d_model": 384, "n_heads": 6, "n_kv_heads": 6, "d_ff": 1024})
    moe = wide.model_copy(update={"moe": MoEConfig(n_experts=4, top_k=2, d_ff_expert=512)})
    linear = wide.model_copy(update={"attention": "linear"})
    models = (small, wide, moe, linear)
    assert [wants_compile("auto", cpu, cfg) for cfg in models] == [False, True, False, False]
    bf16 = torch.bfloat16
    assert [wants_compile("auto", cpu, cfg, bf16) for cfg in models] == [False, True, True, False]
    assert wants_compile("auto", cuda, small) and wants_compile("auto", cuda, moe)
    assert (wants_compile(True, cpu, small), wants_compile(False, cuda, wide)) == (True, False)
    assert [compiles_optimizer("auto", cpu, cfg) for cfg in models] == [False, True, True, True]
    assert (compiles_optimizer(True, cpu, small), compiles_optimizer(False, cpu, wide)) == (True, False)
    assert not compiles_optimizer("auto", cuda, wide)


class FixedBatch:
    """The same 8 random sequences of 64 tokens at every draw."""

    def __init__(self, vocab_size: int) -> None:
        self.ids = torch.randint(0, vocab_size, (8, 65), generator=torch.Generator().manual_seed(1))

    def next_batch(self):  # noqa: ANN201
        from data_pipeline.loader import Batch

        return Batch(self.ids[:, :-1], self.ids[:, 1:])


@pytest.mark.parametrize(("zero_stage", "precision"), [(0, "fp32"), (0, "bf16"), (2, "fp32")])
def test_gradient_clipping_scales_the_gradient_to_the_limit(zero_stage: int, precision: str) -> None:
    """AdamW's first moment after one step is (1 - β1) × the gradient it was given: its global norm is the
    clipped norm (0.05 here, far below the raw one), and without clipping it is the reported raw norm.
    DeepSpeed clips in different places for ZeRO-0 (the engine) and ZeRO ≥ 1 (the partitioned optimiser)."""
    from training.loop import optimizer_step
    from training.objective import TokenCrossEntropy

    recipe = load_recipe("smoke")
    given = {}
    for clip in (0.0, 0.05):
        torch.manual_seed(0)
        engine, r = engine_for(
            Transformer(recipe.model),
            f"optim.grad_clip={clip}",
            f"parallel.zero_stage={zero_stage}",
            f"parallel.precision={precision}",
        )
        outcome = optimizer_step(engine, FixedBatch(recipe.model.vocab_size), TokenCrossEntropy(), 1e-3, 1)
        inner = getattr(engine.ds.optimizer, "optimizer", None) or engine.ds.optimizer
        moment = sum(state["exp_avg"].double().square().sum() for state in inner.state.values()) ** 0.5
        given[clip] = (outcome.grad_norm, float(moment) / (1 - r.optim.betas[0]))
    (raw, unclipped), (raw_again, clipped) = given[0.0], given[0.05]
    assert raw == pytest.approx(raw_again, rel=1e-6) and raw > 0.5  # reported before clipping
    assert unclipped == pytest.approx(raw, rel=1e-4)
    assert clipped == pytest.approx(0.05, rel=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_rank_skips_the_gradient_all_reduce_and_steps_alike(precision: str) -> None:
    """On one rank the all-reduce is the identity: ZeRO-0 skips its flatten and copy back (4-6% of a bf16 step),
    and three steps end on the same weights as an engine that does the all-reduce."""
    from training.loop import optimizer_step
    from training.objective import TokenCrossEntropy

    recipe = load_recipe("smoke")
    weights = []
    for skip in (True, False):
        torch.manual_seed(0)
        engine, _ = engine_for(Transformer(recipe.model), f"parallel.precision={precision}")
        assert engine.ds.enable_backward_allreduce is False
        engine.ds.enable_backward_allreduce = not skip
        for _ in range(3):
            optimizer_step(engine, FixedBatch(recipe.model.vocab_size), TokenCrossEntropy(), 1e-3, 1)
        weights.append([p.detach().float().clone() for p in engine.module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_bf16_master_weights_continue_deepspeeds_wrapper_step_for_step(
    clip: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 AdamW without ZeRO steps its fp32 masters in `MasterWeights` instead of DeepSpeed's tensor-by-tensor
    wrapper. Loaded from a checkpoint that wrapper wrote, both take the same three steps: bit for bit without
    clipping; with it (0.05, far below the raw norm) within the clip coefficient's last bits (DeepSpeed sums the
    norm in float64); and they report the same gradient norm."""
    import training.parallel.engine as engine_module
    from training.loop import optimizer_step
    from training.objective import TokenCrossEntropy
    from training.optim.master_weights import MasterWeights

    recipe = load_recipe("smoke")
    batch = FixedBatch(recipe.model.vocab_size)
    settings = ("parallel.precision=bf16", f"optim.grad_clip={clip}")

    def steps(engine, n: int) -> list[float]:
        return [
            optimizer_step(engine, batch, TokenCrossEntropy(), lr, 1).grad_norm
            for lr in (5e-4, 2e-3, 1e-3)[:n]
        ]

    with monkeypatch.context() as patch:
        patch.setattr(engine_module, "uses_master_weights", lambda *_: False)
        torch.manual_seed(0)
        theirs, _ = engine_for(Transformer(recipe.model), *settings)
    assert type(theirs.ds.optimizer).__name__ == "FP16_UnfusedOptimizer"
    steps(theirs, 2)
    theirs.save(tmp_path / "ckpt")
    theirs.saved()
    torch.manual_seed(1)  # other initial weights: the checkpoint must replace them and the masters
    ours, _ = engine_for(Transformer(recipe.model), *settings)
    assert isinstance(ours.ds.optimizer, MasterWeights)
    ours.load(tmp_path / "ckpt")
    norms = steps(theirs, 3), steps(ours, 3)
    assert norms[1] == pytest.approx(norms[0], rel=1e-6 if clip == 0.0 else 1e-4)
    assert min(norms[0]) > 0.5  # the 0.05 limit clips every step
    for a, b in zip(theirs.module.parameters(), ours.module.parameters(), strict=True):
        assert b.dtype == torch.bfloat16
        if clip == 0.0:
            assert torch.equal(a, b)
        else:  # a bf16 rounding step at most (near zero: a twentieth of an update)
            torch.testing.assert_close(b, a, rtol=2**-7, atol=1e-4)


@pytest.fixture
def eager() -> Iterator[None]:
    """`torch.compile` off for the test (it runs the functions it would compile as written)."""
    with torch._dynamo.config.patch(disable=True):
        yield


@pytest.mark.parametrize("zero_stage", [0, 1, 2])
def test_muon_step_is_orthogonalised_at_its_learning_rate(
    tokenized: tuple[DatasetManifest, Path], tmp_path: Path, zero_stage: int, eager: None
) -> None:
    """Newton–Schulz's signature on a hidden matrix's first update: singular values near-equal (the raw gradient's
    spread 6x wider, AdamW's 5x) and the largest ≈ lr (Muon's fixed scale; clipping the update broke it under ZeRO).
    Then the run learns. DeepSpeed's Muon update is `torch.compile`d; it runs eagerly here (the same math: the
    first compile cost 25-75 s of this suite on a 2-vCPU machine, and whether Inductor compiles it faithfully is
    torch's own test suite's question)."""
    from training.loop import optimizer_step
    from training.objective import TokenCrossEntropy

    manifest, _ = tokenized
    recipe = load_recipe("smoke")
    lr, name = 0.02, "model.layers.0.mlp.down_proj.weight"
    sets = [
        "optim.name=muon",
        f"optim.lr={lr}",
        "optim.grad_clip=0",
        "optim.weight_decay=0",
        f"parallel.zero_stage={zero_stage}",
    ]
    torch.manual_seed(0)
    engine, r = engine_for(Transformer(recipe.model), *sets)
    inner = getattr(engine.ds.optimizer, "optimizer", None) or engine.ds.optimizer
    assert type(inner).__name__ == "MuonWithAuxAdam"
    assert type(inner.aux_optimizer) is torch.optim.AdamW  # not FusedAdam, a C++ op compiled on first use
    weight = dict(engine.module.named_parameters())[name]
    before = weight.detach().clone()
    optimizer_step(engine, FixedBatch(recipe.model.vocab_size), TokenCrossEntropy(), lr, 1)
    singular = torch.linalg.svdvals((weight.detach() - before).float())
    rows, cols = weight.shape
    assert singular.min() / singular.max() > 0.45  # measured 0.60; the gradient's own ratio is 0.16
    assert 0.8 * lr < singular.max() / max(1, rows / cols) ** 0.5 < 1.3 * lr  # measured 1.13 lr
    run_steps(engine, r, manifest, tmp_path, steps=12)
    curve = losses_of(tmp_path)
    assert sum(curve[-3:]) < sum(curve[:3]) - 0.5


def test_fp16_dynamic_loss_scaling(tokenized: tuple[DatasetManifest, Path], tmp_path: Path) -> None:
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        pytest.skip(
            f"DeepSpeed's {get_accelerator().device_name()} accelerator has no fp16 here (runs on CUDA)"
        )
    manifest, _ = tokenized
    recipe = load_recipe("smoke")
    engine, r = engine_for(Transformer(recipe.model), "parallel.precision=fp16", "parallel.zero_stage=1")
    run_steps(engine, r, manifest, tmp_path, steps=8)
    curve = losses_of(tmp_path)
    assert sum(curve[-2:]) < sum(curve[:2])


@pytest.mark.parametrize("name", ["soap", "shampoo", "kron", "kfac"])
def test_matrix_optimisers_see_matrices_learn_and_resume_exactly(
    tokenized: tuple[DatasetManifest, Path], tmp_path: Path, name: str
) -> None:
    """Under ZeRO-0 DeepSpeed hands the matrix optimiser the blocks' weights as 2-D matrices (under ZeRO ≥ 1 it
    would see flat 1-D partitions: the recipe refuses that); embeddings, norms and the head go to AdamW. 12
    steps lower the loss; a fresh engine loaded from the step-6 checkpoint (with the RNG state: Kron draws
    random probes) continues bit for bit."""
    import copy

    from training.checkpoint import rng_state, set_rng_state

    manifest, _ = tokenized
    sets = (f"optim.name={name}", "optim.matrix_lr=0.01", "optim.precondition_every=4")
    torch.manual_seed(0)
    engine, recipe = engine_for(Transformer(load_recipe("smoke").model), *sets)
    matrix, adamw = engine.ds.optimizer.optimizers
    shapes = [tuple(p.shape) for g in matrix.param_groups for p in g["params"]]
    blocks = {n: p for n, p in engine.module.named_parameters() if ".layers." in n and p.ndim == 2}
    assert shapes == [tuple(p.shape) for p in blocks.values()] and all(len(s) == 2 for s in shapes)
    assert type(adamw).__name__ == "AdamW"
    assert {id(p) for g in adamw.param_groups for p in g["params"]} == {
        id(p) for n, p in engine.module.named_parameters() if n not in blocks
    }
    (tmp_path / "straight").mkdir()
    state = run_steps(engine, recipe, manifest, tmp_path / "straight", steps=6)
    engine.save(tmp_path / "ckpt")
    saved_state, saved_rng = copy.deepcopy(state), rng_state()
    run_steps(engine, recipe, manifest, tmp_path / "straight", steps=12, state=state)
    curve = losses_of(tmp_path / "straight")
    assert sum(curve[-3:]) < sum(curve[:3]) - 0.3, curve

    resumed, _ = engine_for(Transformer(load_recipe("smoke").model, seed=1), *sets)
    resumed.load(tmp_path / "ckpt")
    set_rng_state(saved_rng)
    (tmp_path / "resumed").mkdir()
    run_steps(resumed, recipe, manifest, tmp_path / "resumed", steps=12, state=saved_state)
    assert losses_of(tmp_path / "resumed") == curve[6:]
    after, again = snapshot(engine), snapshot(resumed)
    assert all(torch.equal(after[k], again[k]) for k in after)


def test_async_checkpoints_hold_the_same_state_and_true_digests(
    tokenized: tuple[DatasetManifest, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `train.async_checkpoint` a save copies the state and writes it on a thread while training goes on; the
    checkpoints that get committed (the previous at each save, the last at the end) hold exactly what the
    synchronous run's do, and their markers' digests (computed while writing) match the files. The disk is slow
    here (each file waits 0.3 s), so training has moved on by the time a file is written."""
    import time

    from training import checkpoint as ckpt
    from training.parallel import checkpoint_writer

    write_file = checkpoint_writer.write_file

    def slow_write_file(state, path):  # noqa: ANN001, ANN202
        time.sleep(0.3)
        return write_file(state, path)

    monkeypatch.setattr(checkpoint_writer, "write_file", slow_write_file)
    manifest, _ = tokenized
    found = {}
    for mode in ("false", "true"):
        torch.manual_seed(0)
        engine, recipe = engine_for(Transformer(load_recipe("smoke").model), f"train.async_checkpoint={mode}")
        (tmp_path / mode).mkdir()
        run_steps(engine, recipe, manifest, tmp_path / mode, steps=6, checkpoint_every=2)
        found[mode] = ckpt.complete_checkpoints(tmp_path / mode / "checkpoints")
        assert [step for step, _ in found[mode]] == [4, 6]  # keep 2
        assert all(ckpt.damage(path) is None for _, path in found[mode])
        assert not list((tmp_path / mode / "checkpoints").glob(".*"))  # no staging or trash left
    assert losses_of(tmp_path / "true") == losses_of(tmp_path / "false")
    for (_, sync), (_, background) in zip(found["false"], found["true"], strict=True):
        a, b = (
            torch.load(p / "state" / "mp_rank_00_model_states.pt", weights_only=False)
            for p in (sync, background)
        )
        assert a["module"].keys() == b["module"].keys()
        assert all(torch.equal(a["module"][k], b["module"][k]) for k in a["module"])
        moments = [(a["optimizer"]["state"][i], b["optimizer"]["state"][i]) for i in a["optimizer"]["state"]]
        assert all(torch.equal(x["exp_avg_sq"], y["exp_avg_sq"]) for x, y in moments)
        assert ckpt.read_meta(sync)["loop"] == ckpt.read_meta(background)["loop"]


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_mup_learning_rates_are_the_ones_the_engine_applies(zero_stage: int) -> None:
    """μP through the DeepSpeed engine, not through hand-built groups: AdamW's first update is lr·sign(gradient)
    per element, so one step moves a hidden matrix by exactly lr/m and the embedding by lr (m = d_model /
    base_width). Dropping the hidden group's multiplier where the engine builds its groups moves both by lr."""
    from training.loop import optimizer_step
    from training.model.config import MuPConfig
    from training.objective import TokenCrossEntropy

    recipe = load_recipe("smoke")
    model_cfg = recipe.model.model_copy(update={"mup": MuPConfig(base_width=recipe.model.d_model // 4)})
    lr, m = 1e-3, model_cfg.width_mult
    assert m == 4
    torch.manual_seed(0)
    sets = ("optim.weight_decay=0", "optim.grad_clip=0", f"parallel.zero_stage={zero_stage}")
    engine, _ = engine_for(Transformer(model_cfg), *sets)
    params = dict(engine.module.named_parameters())
    before = {name: p.detach().clone() for name, p in params.items()}
    optimizer_step(engine, FixedBatch(model_cfg.vocab_size), TokenCrossEntropy(), lr, 1)

    def moved(name: str) -> float:
        return float((params[name].detach() - before[name]).abs().max())

    # (Adam's ε shaves steps where the gradient is tiny: q_proj's largest moved 1.4% less; a lost multiplier is 4x)
    for hidden in ("model.layers.0.mlp.down_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert moved(hidden) == pytest.approx(lr / m, rel=0.05), hidden
    assert moved("model.embed_tokens.weight") == pytest.approx(lr, rel=0.05)


def test_expert_parallel_checkpoint_puts_every_expert_back_in_its_place(tmp_path: Path) -> None:
    """DeepSpeed's expert-parallel layer saves one file per expert; reading the checkpoint back must give every
    expert (and every other weight) exactly where our stacked layout had it. Checked expert by expert: experts
    in reverse order moved the engine check's mean loss by only 2e-4 relative, inside the bf16 tolerance."""
    from tests.pretrain_helpers import MOE
    from training.parallel import build_engine, fp32_state_dict
    from training.parallel.expert_parallel import swap_in_expert_parallel

    recipe = load_recipe("smoke", [MOE])
    model = Transformer(recipe.model, seed=0)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}
    swap_in_expert_parallel(model, 1)  # the layer EP=2 uses, all four experts on this one rank
    engine = build_engine(model, recipe.optim, recipe.parallel, recipe.train)
    engine.save(tmp_path)
    engine.saved()
    state = fp32_state_dict(tmp_path, recipe.model.tie_embeddings)
    assert state.keys() == original.keys()
    stacked = [k for k in original if ".mlp.experts." in k]
    assert len(stacked) == 2 * recipe.model.n_layers
    for key in stacked:
        assert original[key].shape[0] == 4
        for expert in range(4):
            assert torch.equal(state[key][expert], original[key][expert]), (key, expert)
    assert all(torch.equal(state[k], original[k]) for k in original if k not in stacked)
