"""K-FAC's factors and preconditioned gradients (issue 19's groundwork), against explicit computations on a
small MLP: A from the inputs, G from per-token output gradients, and the Kronecker solve done densely."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.kfac import KFAC


def mlp(generator: torch.Generator) -> nn.Sequential:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4, bias=False)).double()


def test_factors_are_the_input_and_output_gradient_moments(generator) -> None:
    model = mlp(generator)
    layers = {"0": model[0], "2": model[2]}
    kfac = KFAC(layers, decay=0.0)
    x = torch.randn(3, 7, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 4, (3, 7), generator=generator)
    hidden = model[1](model[0](x))
    hidden.retain_grad()
    logits = model[2](hidden)
    logits.retain_grad()
    loss = nn.functional.cross_entropy(logits.reshape(-1, 4), y.reshape(-1))  # a mean over 21 tokens
    loss.backward()
    kfac.update_factors()
    a0 = torch.cat([x.reshape(-1, 6), torch.ones(21, 1, dtype=torch.float64)], 1)
    torch.testing.assert_close(kfac.a["0"], a0.T @ a0 / 21)
    per_token = 21 * logits.grad.reshape(-1, 4)  # ∂ℓ_i/∂s_i of each token's own loss
    torch.testing.assert_close(kfac.g["2"], per_token.T @ per_token / 21)
    h = hidden.detach().reshape(-1, 5)
    torch.testing.assert_close(kfac.a["2"], h.T @ h / 21)  # no bias: no homogeneous coordinate
    kfac.remove()
    assert not model[0]._forward_hooks


def test_preconditioned_gradient_is_the_damped_kronecker_solve(generator) -> None:
    model = mlp(generator)
    layers = {"0": model[0], "2": model[2]}
    kfac = KFAC(layers, damping=1e-2, update_every=3)
    x = torch.randn(16, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 4, (16,), generator=generator)
    nn.functional.cross_entropy(model(x), y).backward()
    kfac.update_factors()
    grad = torch.cat([model[0].weight.grad, model[0].bias.grad.unsqueeze(1)], 1).clone()
    a, g = kfac.damped("0")
    kfac.precondition()
    # row-major vec: vec(G⁻¹·M·A⁻¹) = (G ⊗ A)⁻¹ vec(M) for symmetric A
    expected = torch.linalg.solve(torch.kron(g, a), grad.reshape(-1)).reshape(grad.shape)
    torch.testing.assert_close(model[0].weight.grad, expected[:, :6])
    torch.testing.assert_close(model[0].bias.grad, expected[:, 6])
    assert kfac.inverses["0"][0].shape == (7, 7)
    stale = kfac.inverses
    kfac.precondition()  # the second call reuses the inverses (refresh every 3 calls)
    assert kfac.inverses is stale


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="K-FAC needs damping > 0"):
        KFAC({}, damping=0.0)
