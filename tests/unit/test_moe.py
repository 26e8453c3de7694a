"""MoE semantics: one expert equals the dense feed-forward, losses match their analytic values, dropless dispatch."""

from __future__ import annotations

import math

import pytest
import torch

from training.model.config import MoEConfig
from training.model.moe import MoE, TopKRouter
from training.model.transformer import FeedForward


def test_one_expert_top1_equals_dense_ffn(generator: torch.Generator) -> None:
    d_model, d_ff = 32, 80
    dense = FeedForward(d_model, d_ff)
    moe = MoE(d_model, MoEConfig(n_experts=1, top_k=1, d_ff_expert=d_ff))
    with torch.no_grad():
        moe.gate.weight.normal_(generator=generator)
        moe.experts.gate_up_proj[0] = torch.cat([dense.gate_proj.weight, dense.up_proj.weight])
        moe.experts.down_proj[0] = dense.down_proj.weight
    x = torch.randn(3, 7, d_model, generator=generator)
    y, stats = moe(x)
    torch.testing.assert_close(y, dense(x), rtol=0, atol=1e-6)
    assert stats.tokens_per_expert.tolist() == [21]


def test_aux_loss_is_one_under_uniform_routing(generator: torch.Generator) -> None:
    for n_experts, top_k in [(4, 1), (4, 2), (8, 3)]:
        moe = MoE(16, MoEConfig(n_experts=n_experts, top_k=top_k, d_ff_expert=8))
        with torch.no_grad():
            moe.gate.weight.zero_()  # every expert gets probability 1/E
            moe.experts.gate_up_proj.normal_(generator=generator)
            moe.experts.down_proj.normal_(generator=generator)
        _, stats = moe(torch.randn(2, 5, 16, generator=generator))
        torch.testing.assert_close(stats.aux_loss, torch.tensor(1.0))
        torch.testing.assert_close(stats.z_loss, torch.tensor(math.log(n_experts) ** 2))


def test_aux_loss_matches_hand_computation() -> None:
    """Two experts, three tokens routed by a known router: E * sum_e f_e P_e computed by hand."""
    router = TopKRouter(d_model=2, n_experts=2, top_k=1)
    with torch.no_grad():
        router.weight.copy_(torch.eye(2))
    x = torch.tensor([[2.0, 0.0], [1.0, 0.0], [0.0, 3.0]])
    moe = MoE(2, MoEConfig(n_experts=2, top_k=1, d_ff_expert=4))
    moe.gate = router
    _, stats = moe(x[None])
    probs = torch.softmax(x, dim=-1)  # router logits are x itself
    fraction = torch.tensor([2 / 3, 1 / 3])  # tokens 0, 1 -> expert 0; token 2 -> expert 1
    expected = 2 * (fraction * probs.mean(0)).sum()
    torch.testing.assert_close(stats.aux_loss, expected)
    torch.testing.assert_close(stats.z_loss, torch.logsumexp(x, -1).pow(2).mean())
    assert stats.tokens_per_expert.tolist() == [2, 1]


def test_router_renormalises_top_k_weights(generator: torch.Generator) -> None:
    router = TopKRouter(d_model=8, n_experts=6, top_k=3)
    torch.nn.init.normal_(router.weight, generator=generator)
    weights, ids, probs, _ = router(torch.randn(10, 8, generator=generator))
    torch.testing.assert_close(weights.sum(-1), torch.ones(10))
    torch.testing.assert_close(weights, probs.gather(1, ids) / probs.gather(1, ids).sum(-1, keepdim=True))


def test_dispatch_is_dropless_and_matches_a_per_token_loop(generator: torch.Generator) -> None:
    moe = MoE(16, MoEConfig(n_experts=4, top_k=2, d_ff_expert=8))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(generator=generator)
        moe.gate.weight.mul_(5)  # skewed routing: some experts take most tokens
    x = torch.randn(1, 40, 16, generator=generator, requires_grad=True)
    y, stats = moe(x)
    assert int(stats.tokens_per_expert.sum()) == 40 * 2
    y.square().sum().backward()  # and its gradients
    grads = [t.grad.clone() for t in (x, *moe.parameters())]
    x.grad = None
    moe.zero_grad()
    weights, ids, _, _ = moe.gate(x[0])
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    expected = torch.zeros(40, 16)
    for n in range(40):
        for k in range(2):
            g, u = (gate_up[ids[n, k]] @ x[0, n]).chunk(2)
            expected[n] += weights[n, k] * (down[ids[n, k]] @ (torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(y[0], expected, rtol=1e-5, atol=1e-5)
    expected.square().sum().backward()
    for got, want in zip(grads, (x.grad, *(p.grad for p in moe.parameters())), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_router_losses_carry_gradients(generator: torch.Generator) -> None:
    moe = MoE(8, MoEConfig(n_experts=4, top_k=2, d_ff_expert=8))
    torch.nn.init.normal_(moe.gate.weight, generator=generator)
    _, stats = moe(torch.randn(2, 3, 8, generator=generator))
    (stats.aux_loss + stats.z_loss).backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("first_k_dense", "every", "expected"), [(0, 1, [0, 1, 2, 3]), (1, 2, [1, 3]), (2, 1, [2, 3])]
)
def test_layer_placement(first_k_dense: int, every: int, expected: list[int]) -> None:
    cfg = MoEConfig(n_experts=2, top_k=1, d_ff_expert=4, first_k_dense=first_k_dense, every_n_layers=every)
    assert [i for i in range(4) if cfg.is_moe_layer(i)] == expected


def test_padded_expert_rows_change_nothing_but_the_layout(
    generator: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each expert's rows padded to a multiple of 32 (what a CPU does in bf16, so oneDNN reuses its GEMM kernels),
    or all to the largest expert's (one batched GEMM): every group starts where it should and holds its own
    assignments, and the output and every gradient equal the packed layout's, on skewed routing (one expert empty,
    one with most tokens)."""
    from training.model import moe as moe_module
    from training.model.moe import padded_rows

    counts = torch.tensor([3, 0, 40, 1])
    sorted_ids = torch.repeat_interleave(torch.arange(4), counts)
    rows, ends = padded_rows(counts, sorted_ids, 32)
    assert ends.tolist() == [32, 32, 96, 128] and ends.dtype == torch.int32
    assert rows.tolist() == [0, 1, 2, *range(32, 72), 96]
    rows, ends = padded_rows(counts, sorted_ids, 32, batched=True)
    assert ends.tolist() == [64, 128, 192, 256] and ends.dtype == torch.int32
    assert rows.tolist() == [0, 1, 2, *range(128, 168), 192]
    moe = MoE(16, MoEConfig(n_experts=4, top_k=2, d_ff_expert=8))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(generator=generator)
        moe.gate.weight.mul_(5)
    x = torch.randn(40, 16, generator=generator)
    results = []
    for multiple, batch_padding in [(1, 0.0), (32, 0.0), (32, math.inf)]:
        monkeypatch.setattr(moe_module, "BATCH_PADDING", batch_padding)
        moe.zero_grad()
        inputs = x.clone().requires_grad_()
        weights, ids, _, _ = moe.gate(inputs)
        y = moe.experts(inputs, weights, ids, row_multiple=multiple)
        y.square().sum().backward()
        results.append([y, inputs.grad, *(p.grad.clone() for p in moe.parameters())])
    for packed, *padded in zip(*results, strict=True):
        for layout in padded:
            torch.testing.assert_close(layout, packed, rtol=1e-6, atol=1e-6)


def test_experts_batch_their_gemms_where_padding_to_the_largest_adds_little() -> None:
    """One batched GEMM for all experts where padding every expert to the largest one's rows adds at most a quarter
    more rows than padding each to 32; the loop of per-expert GEMMs on skewed routing."""
    from training.model.moe import pays_to_batch

    assert pays_to_batch(torch.tensor([263, 249, 253, 286, 257, 270, 233, 237]), 32)  # 8 x 288 rows vs 2,176
    assert not pays_to_batch(torch.tensor([44, 345, 0, 450, 14, 552, 205, 438]), 32)  # 8 x 576 vs 2,176
    assert pays_to_batch(torch.tensor([30, 1, 2, 3]), 32)  # every expert 32 rows either way


def test_experts_compute_in_the_autocast_dtype_and_pad_on_a_cpu_in_bf16() -> None:
    """Autocast does not cover `grouped_mm`: the experts cast to its dtype themselves (in fp32 they ran at a third
    of the dense layers' pace in bf16), and pad their rows only where oneDNN compiles per shape (CPU, bf16/fp16)."""
    from training.model.moe import gemm_row_multiple, grouped_linear

    x, weight, ends = torch.randn(6, 16), torch.randn(2, 8, 16), torch.tensor([4, 6], dtype=torch.int32)
    assert grouped_linear(x, weight, ends).dtype == torch.float32
    assert gemm_row_multiple(x) == 1 and gemm_row_multiple(x.bfloat16()) == 32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert grouped_linear(x, weight, ends).dtype == torch.bfloat16
        assert gemm_row_multiple(x) == 32


@pytest.mark.parametrize(("dtype", "batched"), [(torch.float32, False), (torch.bfloat16, True)])
def test_experts_compile(generator: torch.Generator, dtype: torch.dtype, batched: bool) -> None:
    """torch.compile's fake kernel for `grouped_mm` takes bf16 only; compiled fp32 expert GEMMs go through lmforge's
    own op (`moe.grouped_mm`) with the eager op's outputs and gradients. The batched layout (a CPU's bf16) compiles
    too, its gradients the eager ones."""
    from training.model.moe import grouped_linear

    x = torch.randn(12, 16, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(3, 8, 16, generator=generator).to(dtype).requires_grad_()  # (E, out, in)
    # grouped: an expert without rows too; batched: equal groups, as `padded_rows(..., batched=True)` lays them out
    ends = torch.tensor([4, 8, 12] if batched else [4, 4, 12], dtype=torch.int32)
    results = []
    for forward in (grouped_linear, torch.compile(grouped_linear, fullgraph=True, dynamic=False)):
        y = forward(x, weight, ends, batched)
        results.append([y, *torch.autograd.grad(y.float().square().sum(), (x, weight))])
    for eager, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
