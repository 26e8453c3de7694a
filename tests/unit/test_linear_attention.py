"""Linear and FAVOR+ attention cores (issue 19's groundwork): the chunked form equals the quadratic definition and
the one-token recurrence, nothing leaks from the future, and FAVOR+ approaches exact softmax attention as its
feature count grows."""

from __future__ import annotations

import pytest
import torch

from training.model.linear_attention import (
    LinearState,
    causal_linear_attention,
    elu_features,
    favor_features,
    orthogonal_features,
)


def quadratic(qf: torch.Tensor, kf: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The definition: A_ts = φ(q_t)ᵀφ(k_s) for s ≤ t, rows normalised, times V."""
    scores = (qf @ kf.transpose(-1, -2)).tril()
    return (scores / scores.sum(-1, keepdim=True)) @ v


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_form_equals_the_definition_and_the_recurrence(generator, chunk: int) -> None:
    q, k = (torch.randn(2, 3, 37, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 3, 37, 6, generator=generator, dtype=torch.float64)
    qf, kf = elu_features(q), elu_features(k)
    expected = quadratic(qf, kf, v)
    torch.testing.assert_close(causal_linear_attention(qf, kf, v, chunk=chunk), expected)
    state = LinearState.empty(2, 3, 8, 6, q)
    prefix = causal_linear_attention(qf[:, :, :10], kf[:, :, :10], v[:, :, :10], chunk=chunk, state=state)
    steps = [
        causal_linear_attention(*(x[:, :, t : t + 1] for x in (qf, kf, v)), state=state)
        for t in range(10, 37)
    ]  # a prompt, then one token at a time (generation)
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=2), expected)
    assert state.length == 37


def test_no_future_leakage(generator) -> None:
    """Changing keys and values from position 20 on leaves positions 0-19 bit for bit as they were."""
    w = orthogonal_features(32, 8, generator)
    q, k = (torch.randn(1, 2, 40, 8, generator=generator) for _ in range(2))
    v = torch.randn(1, 2, 40, 4, generator=generator)
    out = causal_linear_attention(favor_features(q, w, True), favor_features(k, w, False), v, chunk=16)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 20:] += 3 * torch.randn(1, 2, 20, 8, generator=generator)
    v2[:, :, 20:] = -v2[:, :, 20:]
    out2 = causal_linear_attention(favor_features(q, w, True), favor_features(k2, w, False), v2, chunk=16)
    assert torch.equal(out[:, :, :20], out2[:, :, :20]) and not torch.equal(out[:, :, 20:], out2[:, :, 20:])


def test_orthogonal_features_are_orthogonal_within_a_block(generator) -> None:
    w = orthogonal_features(20, 8, generator)
    assert w.shape == (20, 8)
    block = w[:8] / w[:8].norm(dim=1, keepdim=True)
    torch.testing.assert_close(block @ block.T, torch.eye(8), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="at least one random feature"):
        orthogonal_features(0, 8)


def test_favor_approaches_softmax_attention_as_features_grow() -> None:
    """Mean absolute error against exact causal softmax attention, averaged over 8 draws of the projection,
    falls as the feature count grows: measured 0.070, 0.040, 0.024, 0.014 at m = 16, 64, 256, 1024 (about
    m^-0.4; the estimates are unbiased but their ratio, the normalised attention, is not)."""
    g = torch.Generator().manual_seed(0)
    d, t = 16, 48
    q, k = (0.5 * torch.randn(1, 4, t, d, generator=g) for _ in range(2))
    v = torch.randn(1, 4, t, d, generator=g)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    errors = {}
    for m in (16, 64, 256, 1024):
        total = 0.0
        for seed in range(8):
            w = orthogonal_features(m, d, torch.Generator().manual_seed(seed))
            approx = causal_linear_attention(favor_features(q, w, True), favor_features(k, w, False), v)
            total += float((approx - exact).abs().mean())
        errors[m] = total / 8
    assert errors[16] > errors[64] > errors[256] > errors[1024]
    assert errors[1024] < 0.5 * errors[64]


def test_favor_error_on_a_models_own_attention_falls_with_the_feature_count() -> None:
    """The evaluation's per-layer measurement (evaluation/favor_error.py) on a random softmax model: the layers'
    q, k after RoPE are the model's (the captured exact attention reproduces the layer), and more features give
    a smaller error; a linear-attention model is refused."""
    from evaluation.favor_error import favor_error
    from training.model.config import ModelConfig
    from training.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=48, max_seq_len=64)
    model = Transformer(cfg, seed=0).eval()
    with torch.no_grad():  # sharper attention than at init, as in a trained model
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
    batches = [torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(s)) for s in range(2)]
    from evaluation.favor_error import attention_inputs

    outputs = []
    handle = model.model.layers[1].self_attn.register_forward_hook(lambda m, a, out: outputs.append(out))
    (q, k, v), _ = attention_inputs(model, batches)[1]
    handle.remove()
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    attn = model.model.layers[1].self_attn
    torch.testing.assert_close(attn.o_proj(exact.transpose(1, 2).flatten(2)), outputs[0])
    errors = favor_error(model, batches, [8, 64, 512], draws=4)
    assert set(errors) == {"layer0", "layer1"}
    for layer in errors.values():
        assert layer[8] > layer[64] > layer[512] > 0
    with pytest.raises(ValueError, match="against softmax attention"):
        favor_error(Transformer(cfg.model_copy(update={"attention": "linear"})), batches, [8])
