"""The numerical cores of compression: round-to-nearest and GPTQ group-wise quantization (GPTQ equal to a
textbook OBS elimination written out column by column, better than RTN on correlated inputs), and truncated-SVD
factors whose error equals the Eckart–Young bound."""

from __future__ import annotations

import pytest
import torch

from training.compress.lowrank import factorize, rank_for_energy
from training.compress.quantize import gptq, grid, hessian, quantize_columns, rtn


def correlated_inputs(n: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """Activations with strongly correlated features, as real layers see (a random mixing of a few sources)."""
    sources = torch.randn(n, d // 4, generator=generator)
    return sources @ torch.randn(d // 4, d, generator=generator) + 0.1 * torch.randn(
        n, d, generator=generator
    )


def obs_reference(
    weight: torch.Tensor, h: torch.Tensor, bits: int, group_size: int, damp: float
) -> torch.Tensor:
    """Optimal Brain Surgeon, quantizing columns in order: the inverse Hessian is inverted once and then shrunk by
    eliminating each quantized column (no Cholesky, no blocks); the error of column q moves the remaining columns
    by (w_q − Q(w_q)) · H⁻¹[q, q:] / H⁻¹[q, q]."""
    w, h = weight.double().clone(), h.double().clone()
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.inv(h)
    out = torch.empty_like(w)
    for q in range(w.shape[1]):
        if q % group_size == 0:
            scale, zero = grid(w[:, q : q + group_size], bits)
        _, out[:, q] = quantize_columns(w[:, q], scale, zero, bits)
        w[:, q:] -= torch.outer(w[:, q] - out[:, q], hinv[q, q:] / hinv[q, q])
        hinv = hinv - torch.outer(hinv[:, q], hinv[q, :]) / hinv[q, q]
    return out


def test_rtn_puts_every_weight_on_its_groups_grid(generator: torch.Generator) -> None:
    w = torch.randn(6, 32, generator=generator)
    q = rtn(w, bits=4, group_size=8)
    assert q.codes.max() <= 15 and q.scales.shape == (6, 4)
    scales = q.scales.repeat_interleave(8, dim=1)
    zeros = q.zeros.repeat_interleave(8, dim=1)
    torch.testing.assert_close(q.weight, scales * (q.codes.float() - zeros))
    assert ((q.weight - w).abs() <= scales / 2 + 1e-6).all()  # round to nearest: at most half a step off


def test_gptq_equals_the_textbook_obs_elimination(generator: torch.Generator) -> None:
    w = torch.randn(5, 48, generator=generator)
    h = hessian(correlated_inputs(256, 48, generator))
    for bits, group_size, block in ((3, 8, 16), (4, 16, 32), (2, 48, 128)):
        ours = gptq(w, h, bits, group_size, damp=0.01, block=block).weight.double()
        torch.testing.assert_close(ours, obs_reference(w, h, bits, group_size, 0.01), rtol=1e-6, atol=1e-6)


def test_gptq_beats_round_to_nearest_on_the_layers_output(generator: torch.Generator) -> None:
    x = correlated_inputs(512, 64, generator)
    w = torch.randn(32, 64, generator=generator)
    h = hessian(x)
    for bits in (3, 4):
        exact = x @ w.T
        err_rtn = (x @ rtn(w, bits, 16).weight.T - exact).square().mean()
        err_gptq = (x @ gptq(w, h, bits, 16).weight.T - exact).square().mean()
        assert err_gptq < 0.5 * err_rtn, (bits, float(err_gptq), float(err_rtn))


def test_unsupported_settings_name_the_layer() -> None:
    w = torch.zeros(4, 172)
    with pytest.raises(ValueError, match="mlp.up_proj: group size 64 does not divide its 172 input columns"):
        rtn(w, 4, 64, name="mlp.up_proj")
    with pytest.raises(ValueError, match="q_proj: 5-bit quantization is not supported"):
        gptq(w, torch.eye(172), 5, 4, name="q_proj")


def test_truncated_svd_error_is_the_eckart_young_bound(generator: torch.Generator) -> None:
    w = torch.randn(40, 24, generator=generator) @ torch.diag(torch.linspace(3, 0.1, 24))
    s = torch.linalg.svdvals(w.double())
    for rank in (1, 5, 23):
        f = factorize(w, rank=rank)
        residual = w.double() - f.a.double() @ f.b.double()
        assert f.a.shape == (40, rank) and f.b.shape == (rank, 24)
        assert float(torch.linalg.matrix_norm(residual)) == pytest.approx(f.frobenius_error_bound(), rel=1e-5)
        assert float(torch.linalg.matrix_norm(residual, ord=2)) == pytest.approx(float(s[rank]), rel=1e-5)
    assert factorize(w, rank=24).frobenius_error_bound() == 0.0


def test_rank_is_chosen_by_retained_energy_and_bounded(generator: torch.Generator) -> None:
    s = torch.tensor([4.0, 2.0, 1.0, 1.0])  # energies 16, 4, 1, 1 of 22
    assert [rank_for_energy(s, e) for e in (0.5, 16 / 22, 0.9, 21 / 22, 1.0)] == [1, 1, 2, 3, 4]
    w = torch.randn(6, 4, generator=generator)
    kept = factorize(w, energy=0.9)
    total = torch.linalg.svdvals(w.double()).square().sum()
    assert 1 - kept.discarded.double().square().sum() / total >= 0.9
    with pytest.raises(ValueError, match=r"fc: rank 5 is outside \[1, 4\]"):
        factorize(w, rank=5, name="fc")


def test_model_level_hessians_and_quantization(generator: torch.Generator) -> None:
    """Hooks collect each block linear's inputs (q_proj sees the normed hidden states); quantization replaces
    exactly those layers' weights (LM head and embeddings stay), and GPTQ asks for calibration first."""
    from training.compress.model_level import layer_hessians, linear_layers, quantize_model
    from training.model.config import ModelConfig
    from training.model.transformer import Transformer

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=16)
    model = Transformer(cfg, seed=0)
    tokens = [torch.randint(0, 64, (3, 16), generator=generator) for _ in range(2)]
    layers = linear_layers(model)
    assert len(layers) == 14 and "lm_head" not in layers
    hs = layer_hessians(model, tokens)
    with torch.no_grad():
        normed = torch.cat(
            [model.model.layers[0].input_layernorm(model.model.embed_tokens(t)) for t in tokens]
        )
    x = normed.reshape(-1, 32).double()
    torch.testing.assert_close(hs["model.layers.0.self_attn.q_proj"], 2 * x.T @ x / x.shape[0])
    head = model.lm_head.weight.clone()
    with pytest.raises(ValueError, match="GPTQ needs calibration"):
        quantize_model(model, "gptq", 4, 16)
    results = quantize_model(model, "gptq", 4, 16, hs)
    assert set(results) == set(layers) and torch.equal(model.lm_head.weight, head)
    # held as torchao intx tensors that dequantize to exactly GPTQ's weights
    assert all(torch.equal(layers[n].weight.dequantize(), q.weight) for n, q in results.items())
