"""Accounting from a config: exact parameter counts, FLOP formula, ZeRO memory arithmetic, activation estimate."""

from __future__ import annotations

import pytest
import torch

from training.model import moe, transformer
from training.model.accounting import (
    count_parameters,
    flops_per_token,
    kv_cache_bytes,
    training_memory,
)
from training.model.config import ModelConfig, MoEConfig
from training.model.transformer import Transformer

BASE = ModelConfig(
    vocab_size=512, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=344, max_seq_len=256
)
VARIANTS = {
    "dense": BASE,
    "tied": BASE.model_copy(update={"tie_embeddings": True}),
    "moe": BASE.model_copy(update={"moe": MoEConfig(n_experts=4, top_k=2, d_ff_expert=128)}),
    "mixed": BASE.model_copy(
        update={"moe": MoEConfig(n_experts=4, top_k=1, d_ff_expert=64, first_k_dense=1, every_n_layers=2)}
    ),
}


@pytest.mark.parametrize("kind", VARIANTS)
def test_parameter_count_equals_the_module(kind: str) -> None:
    cfg = VARIANTS[kind]
    with torch.device("meta"):
        model = Transformer(cfg, seed=None)
    counts = count_parameters(cfg)
    assert counts.total == sum(p.numel() for p in model.parameters())
    by_part = {"experts": 0, "router": 0}
    for name, p in model.named_parameters():
        if ".experts." in name:
            by_part["experts"] += p.numel()
        elif name.endswith("mlp.gate.weight"):
            by_part["router"] += p.numel()
    assert (counts.experts, counts.router) == (by_part["experts"], by_part["router"])


def test_active_parameters_count_top_k_experts_only() -> None:
    cfg = VARIANTS["moe"]
    counts = count_parameters(cfg)
    per_expert = 3 * 128 * 128
    assert counts.total - counts.active == cfg.n_layers * (4 - 2) * per_expert


def test_flops_formula() -> None:
    cfg, seq_len = VARIANTS["tied"], 256
    counts, flops = count_parameters(cfg), flops_per_token(cfg, seq_len)
    # tied: the head still does a V x C matmul, the embedding lookup does none
    matmul_params = counts.attention + counts.mlp + cfg.vocab_size * cfg.d_model
    assert flops.matmul == 6 * matmul_params
    assert flops.attention == 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    assert flops.forward * 3 == flops.training


def test_zero_stages_shard_optimizer_then_gradients_then_weights() -> None:
    cfg = VARIANTS["dense"]
    n = count_parameters(cfg).total
    kwargs = {"precision": "bf16", "micro_batch": 1, "seq_len": 8}
    zero = [training_memory(cfg, zero_stage=s, world_size=4, **kwargs) for s in range(4)]
    assert (zero[0].weights, zero[0].gradients, zero[0].optimizer) == (2 * n, 6 * n, 12 * n)  # + fp32 grads
    assert zero[1].optimizer == 12 * n // 4 and zero[1].gradients == 2 * n
    assert zero[2].gradients == 2 * n // 4 and zero[2].weights == 2 * n
    assert zero[3].weights == 2 * n // 4
    fp32 = training_memory(cfg, zero_stage=0, world_size=1, precision="fp32", micro_batch=1, seq_len=8)
    assert (fp32.weights, fp32.gradients, fp32.optimizer) == (4 * n, 4 * n, 8 * n)


def test_expert_parallelism_splits_experts() -> None:
    cfg = VARIANTS["moe"]
    counts = count_parameters(cfg)
    ep1 = training_memory(cfg, precision="bf16", zero_stage=0, world_size=2, micro_batch=1, seq_len=8)
    ep2 = training_memory(
        cfg, precision="bf16", zero_stage=0, world_size=2, micro_batch=1, seq_len=8, ep_size=2
    )
    assert ep1.weights - ep2.weights == 2 * counts.experts // 2


def test_activation_checkpointing_saves_memory() -> None:
    cfg = VARIANTS["dense"]
    full = training_memory(cfg, precision="bf16", zero_stage=0, world_size=1, micro_batch=4, seq_len=128)
    ckpt = training_memory(
        cfg,
        precision="bf16",
        zero_stage=0,
        world_size=1,
        micro_batch=4,
        seq_len=128,
        activation_checkpointing=True,
    )
    assert ckpt.activations < full.activations / 2


def measured_activation_bytes(
    cfg: ModelConfig, batch: int, seq_len: int, dtype: torch.dtype = torch.float32
) -> int:
    """Bytes of the distinct tensors autograd saves for backward (parameters excluded)."""
    model = Transformer(cfg).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.is_floating_point():
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, targets=x)
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_activation_estimate_matches_autograd(kind: str, precision: str, monkeypatch) -> None:
    """In bf16 part of what autograd keeps stays fp32 (each RMSNorm's input, the router's logits). The kernels a GPU
    runs: SDPA attention and unpadded expert rows (a CPU's short bf16 attention and padded rows are not counted)."""
    monkeypatch.setattr(transformer, "explicit_attention_pays", lambda q: False)
    monkeypatch.setattr(moe, "gemm_row_multiple", lambda x: 1)
    cfg = VARIANTS[kind]
    estimate = training_memory(
        cfg, precision=precision, zero_stage=0, world_size=1, micro_batch=2, seq_len=64
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    measured = measured_activation_bytes(cfg, 2, 64, dtype)
    # The estimate leaves out per-token statistics (RMS, softmax log-sum-exp): a few percent at this width.
    assert estimate.activations == pytest.approx(measured, rel=0.05)


def test_kv_cache_uses_kv_heads() -> None:
    cfg = VARIANTS["dense"]
    assert kv_cache_bytes(cfg, batch=2, seq_len=100, precision="bf16") == 2 * 4 * 2 * 32 * 100 * 2 * 2
    mha = cfg.model_copy(update={"n_kv_heads": 4})
    assert kv_cache_bytes(mha, 2, 100) == 2 * kv_cache_bytes(cfg, 2, 100)


def test_linear_attention_costs_do_not_grow_with_the_length() -> None:
    """Softmax attention's FLOPs per token grow linearly in T; linear attention's (chunks of 64) stop growing
    at T = 64; its generation state is the running sums, whatever the length."""
    linear = BASE.model_copy(update={"attention": "linear"})
    favor = BASE.model_copy(update={"attention": "favor", "attention_features": 64})
    soft = [flops_per_token(BASE, t).attention for t in (256, 1024, 4096)]
    assert soft[1] == 4 * soft[0] and soft[2] == 4 * soft[1]
    for cfg in (linear, favor):
        assert flops_per_token(cfg, 256).attention == flops_per_token(cfg, 4096).attention
        assert kv_cache_bytes(cfg, 1, 256) == kv_cache_bytes(cfg, 1, 4096)
    h, d = BASE.n_heads, BASE.head_dim
    assert flops_per_token(linear, 4096).attention == 3 * 4 * h * (2 * 64 * d + 2 * 64 * d + 4 * d * d)
    assert flops_per_token(favor, 4096).attention < soft[2] / 4
    assert kv_cache_bytes(linear, 2, 100) == 4 * 4 * h * (d * d + d) * 2


def test_matrix_optimisers_add_their_factors() -> None:
    adam = training_memory(BASE, precision="fp32", zero_stage=0, world_size=1, micro_batch=1, seq_len=64)
    kfac = training_memory(
        BASE, precision="fp32", zero_stage=0, world_size=1, micro_batch=1, seq_len=64, optimizer="kfac"
    )
    sides = 4 * (2 * (128**2 + 128**2) + 2 * (64**2 + 128**2) + 2 * (344**2 + 128**2) + (128**2 + 344**2))
    assert kfac.optimizer == adam.optimizer // 2 + 4 * 2 * sides
