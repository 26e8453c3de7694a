"""The dense/MoE transformer: shapes, causality, init determinism, tied weights, KV-cache generation."""

from __future__ import annotations

import pytest
import torch

from data_pipeline.loader import IGNORE_INDEX
from training.model import cross_entropy as fused
from training.model.config import ModelConfig, MoEConfig
from training.model.moe import MoE
from training.model.sampling import filter_logits, generate
from training.model.transformer import (
    Transformer,
    apply_rope,
    cpu_has_bf16_matrix_units,
    explicit_attention_pays,
    explicit_causal_attention,
    rope_tables,
)

DENSE = ModelConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)
MOE = DENSE.model_copy(update={"moe": MoEConfig(n_experts=4, top_k=2, d_ff_expert=48)})
MIXED = DENSE.model_copy(update={"moe": MoEConfig(n_experts=4, top_k=1, d_ff_expert=48, first_k_dense=1)})
LINEAR = DENSE.model_copy(update={"attention": "linear"})
FAVOR = DENSE.model_copy(update={"attention": "favor", "attention_features": 24})
CONFIGS = {"dense": DENSE, "moe": MOE, "mixed": MIXED, "linear": LINEAR, "favor": FAVOR}


def tokens(batch: int, length: int, vocab: int = 101, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", CONFIGS)
def test_shapes_and_loss(kind: str) -> None:
    cfg = CONFIGS[kind]
    model = Transformer(cfg)
    x = tokens(3, 17)
    out = model(x, targets=x)
    assert out.logits.shape == (3, 17, cfg.vocab_size)
    assert out.loss is not None and out.ce_loss is not None and torch.isfinite(out.loss)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    assert len(out.router_stats) == n_moe
    # a freshly initialised model predicts roughly uniformly
    assert abs(out.ce_loss.item() - torch.log(torch.tensor(101.0)).item()) < 0.1
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_mixed_layers_are_dense_then_sparse() -> None:
    model = Transformer(MIXED)
    assert not isinstance(model.model.layers[0].mlp, MoE)
    assert isinstance(model.model.layers[1].mlp, MoE)


@pytest.mark.parametrize("kind", CONFIGS)
def test_causality(kind: str) -> None:
    """Changing token t+1 leaves the logits at positions <= t unchanged."""
    model = Transformer(CONFIGS[kind]).eval()
    x = tokens(2, 16)
    y = x.clone()
    t = 9
    y[:, t + 1] = (y[:, t + 1] + 1) % 101
    a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=0)
    assert (a[:, t + 1] - b[:, t + 1]).abs().max() > 1e-4


def test_ignore_index_drops_positions_from_the_loss() -> None:
    model = Transformer(DENSE)
    x = tokens(2, 8)
    targets = x.clone()
    targets[:, :4] = IGNORE_INDEX
    full = torch.nn.functional.cross_entropy(model(x).logits[:, 4:].flatten(0, 1), x[:, 4:].flatten())
    torch.testing.assert_close(model(x, targets=targets).ce_loss, full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chunked_cross_entropy_is_torchs_on_fp32_logits(dtype: torch.dtype, monkeypatch) -> None:
    """Per-token and mean losses of half-precision logits, and their gradients in the logits' dtype, as
    `F.cross_entropy` of the logits cast to fp32, over chunks of rows with a ragged last one, and compiled (one
    chunk). Each row's loss weighted differently, as a policy gradient weights its tokens' log-probabilities."""
    monkeypatch.setattr(fused, "CHUNK_BYTES", 4 * 101 * 7)  # 7 rows a chunk: 40 rows in 6 chunks
    logits = (3 * torch.randn(40, 101, generator=torch.Generator().manual_seed(0))).to(dtype).requires_grad_()
    targets = tokens(1, 40).flatten()
    targets[[0, 13, 14, 39]] = IGNORE_INDEX
    weights = torch.rand(40, generator=torch.Generator().manual_seed(1))
    per_token = torch.nn.functional.cross_entropy(
        logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="none"
    )
    mean = torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX)
    expected_grads = torch.autograd.grad((weights * per_token).sum() + 3 * mean, logits)

    def both(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused.token_cross_entropy(logits, targets), fused.cross_entropy(logits, targets)

    for losses in (both, torch.compile(both, dynamic=False)):  # one compile
        ours, ours_mean = losses(logits, targets)
        torch.testing.assert_close(ours, per_token, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours_mean, mean, rtol=1e-6, atol=0)
        (grad,) = torch.autograd.grad((weights * ours).sum() + 3 * ours_mean, logits)
        assert grad.dtype == dtype and not grad[[0, 13, 14, 39]].any()
        # equal up to one rounding to the logits' dtype
        torch.testing.assert_close(
            grad.float(), expected_grads[0].float(), rtol=torch.finfo(dtype).eps, atol=1e-7
        )
    assert fused.IGNORE_INDEX == IGNORE_INDEX  # the loader's padding value


def test_a_loss_only_forward_returns_detached_logits_and_the_same_gradients() -> None:
    """`logits_grad=False`, the token objective's forward: the logits come back detached and the loss and every
    gradient are as with differentiable logits, eager and with the head and loss compiled in bf16 (where the
    region's backward then takes no zero-filled gradient the size of the logits)."""
    from data_pipeline.loader import Batch
    from training.objective import TokenCrossEntropy

    x = tokens(2, 16)
    for compiled in (False, True):
        model = Transformer(DENSE).to(torch.bfloat16)
        if compiled:
            model.logits_and_loss = torch.compile(model.logits_and_loss, dynamic=False)
        results = {}
        for logits_grad in (True, False):
            out = model(x[:, :-1], targets=x[:, 1:], logits_grad=logits_grad)
            assert out.logits.requires_grad == logits_grad
            results[logits_grad] = (out.loss, torch.autograd.grad(out.loss, list(model.parameters())))
        torch.testing.assert_close(results[False][0], results[True][0], rtol=0, atol=0)
        for loss_only, both in zip(results[False][1], results[True][1], strict=True):
            torch.testing.assert_close(loss_only, both, rtol=0, atol=0)

    class Recording:  # an engine that remembers what the objective asked of its forward
        def forward(self, batch: Batch, with_loss: bool = True, logits_grad: bool = True):
            self.logits_grad = logits_grad
            return model(batch.inputs, targets=batch.targets, logits_grad=logits_grad)

    engine = Recording()
    TokenCrossEntropy()(engine, Batch(x[:, :-1], x[:, 1:]))  # type: ignore[arg-type]
    assert engine.logits_grad is False


def test_cross_entropy_chunks_fit_a_cpus_cache_and_are_few_elsewhere() -> None:
    """At a 50k vocabulary a CPU's chunk is 10 rows (2 MiB of fp32); on another device (here the meta one) 1,342
    rows (256 MiB): a few large chunks, not hundreds of kernel launches."""
    on_cpu = torch.empty(1, 1, dtype=torch.bfloat16).expand(8192, 50_000)  # the shape, no memory
    assert fused._chunk_rows(on_cpu) == 10
    assert fused._chunk_rows(torch.empty(8192, 50_000, dtype=torch.bfloat16, device="meta")) == 1342


def test_init_is_deterministic_per_seed() -> None:
    a, b, c = Transformer(MOE, seed=7), Transformer(MOE, seed=7), Transformer(MOE, seed=8)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(p, q), name
        if not name.endswith("norm.weight"):
            assert not torch.equal(p, r), name


def test_init_scales_residual_outputs() -> None:
    model = Transformer(DENSE.model_copy(update={"d_model": 256, "d_ff": 512, "n_heads": 4, "n_kv_heads": 4}))
    q_std = model.model.layers[0].self_attn.q_proj.weight.std().item()
    o_std = model.model.layers[0].self_attn.o_proj.weight.std().item()
    assert q_std == pytest.approx(0.02, rel=0.05)
    assert o_std == pytest.approx(0.02 / 2.0, rel=0.05)  # 1/sqrt(2 * n_layers) with 2 layers


def test_tied_embeddings_share_one_tensor() -> None:
    model = Transformer(DENSE.model_copy(update={"tie_embeddings": True}))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    untied = sum(p.numel() for p in Transformer(DENSE).parameters())
    assert untied - sum(p.numel() for p in model.parameters()) == 101 * 64


def test_rope_is_a_rotation_that_depends_on_relative_position() -> None:
    cos, sin = rope_tables(16, torch.arange(10), 10_000.0)
    q, k = torch.randn(1, 1, 10, 16), torch.randn(1, 1, 10, 16)
    q[:, :, :] = q[:, :, :1]
    k[:, :, :] = k[:, :, :1]
    rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    scores = (rq[0, 0, 3:] * rk[0, 0, :-3]).sum(-1)  # all pairs at distance 3
    torch.testing.assert_close(scores, scores[:1].expand_as(scores))


@pytest.mark.parametrize("kind", ["dense", "moe", "linear", "favor"])
def test_kv_cache_logits_equal_full_recompute(kind: str) -> None:
    """Prefill, a chunk, then one token at a time: the logits of a full forward pass (for linear attention the
    cache is the running sums, which keep their size whatever the length)."""
    model = Transformer(CONFIGS[kind]).eval()
    x = tokens(2, 20)
    full = model(x).logits
    cache = model.new_cache(batch=2)
    pieces = [model(x[:, :7], cache=cache).logits]  # prefill
    pieces.append(model(x[:, 7:12], cache=cache).logits)  # a chunk appended to the cache
    pieces += [model(x[:, t : t + 1], cache=cache).logits for t in range(12, 20)]  # one token at a time
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["dense", "moe", "linear", "favor"])
def test_cached_generation_equals_uncached(kind: str) -> None:
    model = Transformer(CONFIGS[kind], seed=3).eval()
    prompt = tokens(2, 5)
    greedy = generate(model, prompt, 20)
    assert torch.equal(greedy, generate(model, prompt, 20, use_cache=False))
    assert greedy.shape == (2, 25) and torch.equal(greedy[:, :5], prompt)
    sample = {
        use_cache: generate(
            model,
            prompt,
            20,
            temperature=1.0,
            top_k=50,
            top_p=0.9,
            generator=torch.Generator().manual_seed(0),
            use_cache=use_cache,
        )
        for use_cache in (True, False)
    }
    assert torch.equal(sample[True], sample[False])
    assert not torch.equal(sample[True], greedy)


def test_generation_stops_at_eos_and_pads_finished_rows() -> None:
    model = Transformer(DENSE, seed=3).eval()
    prompt = tokens(2, 4)
    free = generate(model, prompt, 10)
    eos = int(free[0, 6])  # the third token row 0 generates
    stopped = generate(model, prompt, 10, eos_id=eos)
    assert stopped[0, 6] == eos and (stopped[0, 6:] == eos).all()


def test_generation_refuses_to_run_past_the_context() -> None:
    model = Transformer(DENSE)
    with pytest.raises(ValueError, match="exceeds model.max_seq_len=64"):
        generate(model, tokens(1, 60), 10)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_left_padded_prompts_decode_as_each_alone(kind: str) -> None:
    """Prompts of 3, 7 and 5 tokens left-padded into one batch (`padding`): every row's logits at its real positions,
    through the prefill and ten cached steps, are those of the row run alone, and greedy decoding gives its ids."""
    model = Transformer(CONFIGS[kind], seed=3).eval()
    lengths = [3, 7, 5]
    prompts = [tokens(1, n, seed=n)[0] for n in lengths]
    padding = torch.tensor([7 - n for n in lengths])
    batch = torch.stack([torch.cat([p[:1].expand(7 - len(p)), p]) for p in prompts])  # padded with any token
    alone = [generate(model, p[None], 10) for p in prompts]
    together = generate(model, batch, 10, padding=padding)
    for row, (ids, pad) in enumerate(zip(alone, padding.tolist(), strict=True)):
        assert torch.equal(together[row, pad:], ids[0])
    cache = model.new_cache(3, 20, padding)
    logits = [model(batch, cache=cache).logits]
    for t in range(10):
        logits.append(model(together[:, 7 + t : 8 + t], cache=cache).logits)
    logits = torch.cat(logits, dim=1)
    for row, pad in enumerate(padding.tolist()):
        reference = model(together[row : row + 1, pad:]).logits[0]
        torch.testing.assert_close(logits[row, pad:], reference, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="need softmax attention"):
        Transformer(LINEAR).new_cache(3, 20, padding)


def test_filter_logits_top_k_and_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.7)).tolist() == [[False, False, True, True]]
    assert torch.isinf(filter_logits(logits, top_p=0.85)).tolist() == [[False, False, False, True]]
    shuffled = logits[:, [2, 0, 3, 1]]
    assert torch.isinf(filter_logits(shuffled, top_p=0.7)).tolist() == [[True, False, True, False]]


def test_linear_attention_state_has_a_fixed_size_and_favor_a_fixed_projection() -> None:
    model = Transformer(FAVOR).eval()
    cache = model.new_cache(batch=1)
    sizes = []
    for t in range(0, 30, 10):
        model(tokens(1, 10, seed=t), cache=cache)
        sizes.append(sum(c.state.numel() + c.normaliser.numel() for c in cache))
    assert sizes[0] == sizes[-1] == 2 * 4 * 24 * (16 + 1) and cache[0].length == 30
    projection = model.model.layers[0].self_attn.projection
    assert projection.shape == (24, 16) and "model.layers.0.self_attn.projection" in model.state_dict()
    again = Transformer(FAVOR)
    assert torch.equal(again.model.layers[1].self_attn.projection, model.model.layers[1].self_attn.projection)
    assert not torch.equal(projection, model.model.layers[1].self_attn.projection)  # drawn per layer
    softmax = Transformer(DENSE)  # the weights are a softmax model's of the same seed (an A/B starts equal)
    assert all(torch.equal(p, q) for p, q in zip(softmax.parameters(), model.parameters(), strict=True))


def test_attention_options_it_cannot_honour_are_refused() -> None:
    with pytest.raises(ValueError, match="FAVOR\\+ needs at least one random feature"):
        ModelConfig.model_validate({**DENSE.model_dump(), "attention": "favor", "attention_features": 0})
    with pytest.raises(ValueError, match="remove it or set attention=favor"):
        ModelConfig.model_validate({**DENSE.model_dump(), "attention": "linear", "attention_features": 64})
    assert (
        ModelConfig.model_validate({**DENSE.model_dump(), "attention": "favor"}).feature_dim == 45
    )  # 16·ln 16


def _attention_and_grads(attend, q, k, v, out_grad):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    y = attend(q, k, v)
    y.backward(out_grad.to(y.dtype))
    return [t.float() for t in (y, q.grad, k.grad, v.grad)]


def test_explicit_attention_is_sdpas_math_and_as_accurate_in_bf16() -> None:
    """The short-sequence CPU path (`explicit_causal_attention`, taken by bf16 models) against
    `scaled_dot_product_attention` with grouped kv heads: equal in fp32; in bf16 its outputs and gradients are within
    the flash kernel's own distance from the fp32 result (at most 2x)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(2, heads, 48, 32, generator=g) for heads in (4, 2, 2, 4))
    scale = 32**-0.5

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def explicit(q, k, v):
        return explicit_causal_attention(q, k, v, scale)

    exact = _attention_and_grads(sdpa, q, k, v, dy)
    for ours, reference in zip(_attention_and_grads(explicit, q, k, v, dy), exact, strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    half = [t.bfloat16() for t in (q, k, v)]
    assert explicit_attention_pays(half[0]) == cpu_has_bf16_matrix_units() and not explicit_attention_pays(q)
    for ours, flash, reference in zip(
        _attention_and_grads(explicit, *half, dy), _attention_and_grads(sdpa, *half, dy), exact, strict=True
    ):
        assert (ours - reference).abs().max() <= 2 * (flash - reference).abs().max()
