"""Learning-rate schedules (pure functions), optimiser parameter groups and the bf16 master weights."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from training.config import OptimConfig
from training.model.config import ModelConfig, MoEConfig
from training.model.transformer import Transformer
from training.optim.master_weights import MasterWeights
from training.optim.optimizers import lr_at, param_groups

STEPS = 100


def schedule(**kw: object) -> list[float]:
    cfg = OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, **kw)
    return [lr_at(step, cfg, STEPS) for step in range(STEPS)]


def test_warmup_is_linear_to_the_peak() -> None:
    lrs = schedule()
    assert lrs[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])


def test_cosine_decays_monotonically_to_the_floor() -> None:
    lrs = schedule(schedule="cosine")
    assert lrs[10] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lr_at(STEPS, OptimConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10), STEPS) == pytest.approx(0.1)
    assert lrs[55] == pytest.approx(
        0.55, rel=1e-12
    )  # step 55 is exactly half-way (45 of 90): mean of peak and floor
    assert lrs[25] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 6)), rel=1e-12)  # a sixth of the way


def test_wsd_is_stable_then_decays_linearly() -> None:
    lrs = schedule(schedule="wsd", decay_fraction=0.2)
    assert lrs[10:80] == pytest.approx([1.0] * 70)
    assert lrs[-1] == pytest.approx(0.1)
    decay = lrs[80:]
    steps = [a - b for a, b in zip(decay, decay[1:], strict=False)]
    assert steps == pytest.approx([steps[0]] * len(steps))  # linear


def test_constant_after_warmup() -> None:
    assert schedule(schedule="constant")[10:] == pytest.approx([1.0] * 90)


def test_no_weight_decay_on_norms_and_embeddings() -> None:
    cfg = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        d_ff=64,
        moe=MoEConfig(n_experts=2, top_k=1, d_ff_expert=16, first_k_dense=1),
    )
    model = Transformer(cfg)
    groups = param_groups(model, OptimConfig(weight_decay=0.1))
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in groups[0]["params"]}
    plain = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decayed | plain == set(names.values()) and not decayed & plain
    assert "model.embed_tokens.weight" in plain and "model.norm.weight" in plain
    assert "model.layers.0.self_attn.q_proj.weight" in decayed and "lm_head.weight" in decayed
    assert "model.layers.1.mlp.experts.gate_up_proj" in decayed


def test_master_weights_skip_a_non_finite_gradient_and_step_at_the_groups_learning_rate() -> None:
    """A non-finite gradient norm leaves weights and masters as they were (DeepSpeed counts the step as skipped);
    a finite one steps the fp32 masters at the learning rate set on the model's groups and writes them back
    rounded to bf16."""
    layer = torch.nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    before = layer.weight.detach().clone()
    optimizer = MasterWeights(
        [{"params": [layer.weight]}], lambda groups: torch.optim.SGD(groups, lr=1.0), max_grad_norm=0.0
    )
    layer.weight.grad = torch.full_like(layer.weight, float("inf"))
    optimizer.step()
    assert optimizer.overflow and math.isinf(optimizer._global_grad_norm)
    assert torch.equal(layer.weight, before) and torch.equal(optimizer.masters[0][0], before.float())
    optimizer.param_groups[0]["lr"] = 0.5
    layer.weight.grad = torch.ones_like(layer.weight)
    optimizer.step()
    assert not optimizer.overflow and optimizer._global_grad_norm == pytest.approx(math.sqrt(12))
    assert torch.equal(optimizer.masters[0][0], before.float() - 0.5)
    assert torch.equal(layer.weight, (before.float() - 0.5).to(torch.bfloat16))


def test_master_weights_refresh_from_weights_loaded_without_optimiser_state() -> None:
    """DeepSpeed loads a module-only checkpoint into the bf16 weights and then asks the optimiser to refresh its
    fp32 masters from them (else the next step would write the old weights back)."""
    layer = torch.nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    optimizer = MasterWeights([{"params": [layer.weight]}], lambda groups: torch.optim.SGD(groups, lr=0.0))
    with torch.no_grad():
        layer.weight.fill_(0.5)
    optimizer.refresh_fp32_params()
    layer.weight.grad = torch.ones_like(layer.weight)
    optimizer.step()  # lr 0: writes the masters back
    assert torch.equal(layer.weight, torch.full_like(layer.weight, 0.5))


def bf16_pair() -> tuple[list[torch.nn.Module], list[MasterWeights]]:
    """Two copies of a small bf16 model in two groups (decayed, not; their shapes alike, so the compiled step
    compiles once), one `MasterWeights` eager (torch's fused AdamW inside) and one compiled."""
    models = [
        torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(2))).to(torch.bfloat16) for _ in "ab"
    ]
    models[1].load_state_dict(models[0].state_dict())

    def build(groups: list[dict]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(groups, betas=(0.9, 0.95), eps=1e-8, fused=True)

    optimizers = [
        MasterWeights(
            [
                {"params": [m[0].weight, m[0].bias], "lr": 1e-3, "weight_decay": 0.1},
                {"params": [m[1].weight, m[1].bias], "lr": 1e-3, "weight_decay": 0.0},
            ],
            build,
            max_grad_norm=1.0,
            compiled=compiled,
        )
        for m, compiled in zip(models, (False, True), strict=True)
    ]
    return models, optimizers


def step_both(
    models: list[torch.nn.Module], optimizers: list[MasterWeights], scale: float, lr: float
) -> None:
    grads = [
        torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        for p in models[0].parameters()
    ]
    for model, optimizer in zip(models, optimizers, strict=True):
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = (g * scale).to(torch.bfloat16)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()


@pytest.mark.slow  # Inductor's first compile in a process, ~12 s from a cold cache (shared with the slow suite's)
def test_compiled_master_weights_step_as_torchs_fused_adamw() -> None:
    """The compiled step (one fused pass per tensor from the bf16 gradient to the bf16 weight) against the eager
    one (fp32 gradient copies, torch's fused AdamW): the same norms, fp32 masters and Adam moments to float
    rounding, over steps that clip and steps that do not, at changing learning rates, per group weight decay;
    and the state dict moves between the two."""
    models, optimizers = bf16_pair()
    eager, compiled = optimizers
    for step, (scale, lr) in enumerate([(0.01, 1e-3), (5.0, 3e-3), (0.02, 2e-3), (3.0, 1e-2)]):
        step_both(models, optimizers, scale, lr)
        assert compiled.compiled and compiled._global_grad_norm == pytest.approx(
            eager._global_grad_norm, rel=1e-5
        )
        assert (eager._global_grad_norm > 1.0) == (step % 2 == 1)  # every other step clips
    for ours, theirs in zip(sum(compiled.masters, []), sum(eager.masters, []), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(
                compiled.optimizer.state[ours][key], eager.optimizer.state[theirs][key]
            )
    for ours, theirs in zip(models[1].parameters(), models[0].parameters(), strict=True):
        assert ours.dtype == torch.bfloat16
        torch.testing.assert_close(ours, theirs, rtol=2**-7, atol=1e-6)  # a bf16 rounding apart at most
    compiled.load_state_dict(copy.deepcopy(eager.state_dict()))  # an eager checkpoint resumed compiled
    step_both(models, optimizers, 0.5, 1e-3)
    for ours, theirs in zip(sum(compiled.masters, []), sum(eager.masters, []), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


def test_compiled_master_weights_step_eagerly_when_the_compiler_fails() -> None:
    """Inductor's C++ compiler is `false` (a real program that fails): one warning, and that first step and the
    later ones are the eager step's."""
    from torch._inductor import config as inductor

    torch._dynamo.reset()
    models, optimizers = bf16_pair()
    broken = inductor.patch({"cpp.cxx": ("false",), "force_disable_caches": True})
    with broken, pytest.warns(UserWarning, match="compiling the step failed"):
        step_both(models, optimizers, 0.01, 1e-3)
    step_both(models, optimizers, 3.0, 2e-3)
    assert not optimizers[1].compiled
    for ours, theirs in zip(models[1].parameters(), models[0].parameters(), strict=True):
        assert torch.equal(ours, theirs)
    torch._dynamo.reset()
