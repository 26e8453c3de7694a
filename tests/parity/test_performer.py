"""FAVOR+ against performer-pytorch (the reference implementation of Choromanski et al.; a test-only extra) under
one fixed projection: the same positive random features, and the same causal attention output."""

from __future__ import annotations

import torch

from training.model.linear_attention import causal_linear_attention, favor_features, orthogonal_features


def inputs(generator: torch.Generator, d: int = 16, t: int = 40) -> tuple[torch.Tensor, ...]:
    q, k = (0.5 * torch.randn(2, 3, t, d, generator=generator, dtype=torch.float64) for _ in range(2))
    return q, k, torch.randn(2, 3, t, d, generator=generator, dtype=torch.float64)


def test_random_features_are_performers() -> None:
    """Queries: identical (both subtract the row's largest projection). Keys: performer subtracts one global
    maximum (a constant factor that cancels in attention; ours subtracts none, which keeps causality exact)."""
    from performer_pytorch.performer_pytorch import softmax_kernel

    g = torch.Generator().manual_seed(0)
    q, k, _ = inputs(g)
    w = orthogonal_features(64, 16, g).double()
    theirs_q = softmax_kernel(q, projection_matrix=w, is_query=True, eps=0.0)
    torch.testing.assert_close(favor_features(q, w, True), theirs_q, rtol=1e-12, atol=0)
    theirs_k = softmax_kernel(k, projection_matrix=w, is_query=False, eps=0.0)
    ours_k = favor_features(k, w, False)
    ratio = theirs_k / ours_k
    torch.testing.assert_close(
        ratio, ratio.amax(dim=(-1, -2), keepdim=True).expand_as(ratio), rtol=1e-12, atol=0
    )


def test_causal_attention_output_is_performers() -> None:
    """performer's causal FAVOR+ with our projection: its kernel (without its 1e-4 added to every feature) and
    causal product (without its 1e-6 added to the normaliser) give our output to 1e-9; its `FastAttention(causal=True)` module, with that 1e-4, to 0.02
    (measured 0.007)."""
    from performer_pytorch import FastAttention
    from performer_pytorch.performer_pytorch import causal_linear_attention_noncuda, softmax_kernel

    g = torch.Generator().manual_seed(1)
    q, k, v = inputs(g)
    w = orthogonal_features(128, 16, g).double()
    ours = causal_linear_attention(favor_features(q, w, True), favor_features(k, w, False), v)
    features = [
        softmax_kernel(x, projection_matrix=w, is_query=is_q, eps=0.0) for x, is_q in ((q, True), (k, False))
    ]
    torch.testing.assert_close(
        ours, causal_linear_attention_noncuda(*features, v, eps=0.0), rtol=0, atol=1e-9
    )
    attention = FastAttention(dim_heads=16, nb_features=128, causal=True).double()
    attention.projection_matrix.copy_(w)
    torch.testing.assert_close(ours, attention(q, k, v), rtol=0, atol=0.02)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert float((ours - exact).abs().mean()) < 0.1  # both approximate softmax attention


def test_our_projection_is_performers_draw() -> None:
    """The projection itself, not only what is computed from it: with the same random stream, performer's
    `gaussian_orthogonal_random_matrix` (QR blocks of d orthogonal rows, each rescaled to a Gaussian vector's norm)
    draws exactly our matrix, a partial last block included; and its own module's projection, fed to our kernel,
    gives its features."""
    from performer_pytorch import FastAttention
    from performer_pytorch.performer_pytorch import gaussian_orthogonal_random_matrix, softmax_kernel

    for rows in (64, 40):
        torch.manual_seed(3)
        theirs = gaussian_orthogonal_random_matrix(rows, 16, scaling=0)
        torch.manual_seed(3)
        torch.testing.assert_close(orthogonal_features(rows, 16), theirs, rtol=1e-6, atol=1e-6)
    q, _, _ = inputs(torch.Generator().manual_seed(4))
    w = FastAttention(dim_heads=16, nb_features=48, causal=True).projection_matrix.double()
    expected = softmax_kernel(q, projection_matrix=w, is_query=True, eps=0.0)
    torch.testing.assert_close(favor_features(q, w, True), expected, rtol=1e-12, atol=0)
