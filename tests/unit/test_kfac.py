"""K-FAC (`training/optim/kfac.py`): its factors and preconditioned gradients against explicit computations and
against curvlinops' `KFACLinearOperator` / `KFACInverseLinearOperator` (test-only extra) on a tiny transformer,
and its state through a checkpoint round trip."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from training.model.config import ModelConfig
from training.model.transformer import Transformer
from training.optim.kfac import KFAC


def mlp(generator: torch.Generator) -> nn.Sequential:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=generator)))
    return nn.Sequential(nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, 4, bias=False)).double()


def kfac_of(model: nn.Sequential, **kw) -> KFAC:
    layers = [model[0], model[2]]
    return KFAC([{"params": [m.weight for m in layers]}], layers, **kw)


def test_factors_are_the_input_and_output_gradient_moments(generator) -> None:
    """Two accumulated micro-batches of loss/2 each (as the engine backpropagates them): A and G are the means of
    the micro-batches' per-token moments, the 1/2 undone by grad_scale."""
    model = mlp(generator)
    kfac = kfac_of(model, decay=0.0, grad_scale=2.0)
    expected_a, expected_g = 0, 0
    for _ in range(2):
        x = torch.randn(3, 7, 6, generator=generator, dtype=torch.float64)
        y = torch.randint(0, 4, (3, 7), generator=generator)
        hidden = model[1](model[0](x))
        logits = model[2](hidden)
        logits.retain_grad()
        loss = nn.functional.cross_entropy(logits.reshape(-1, 4), y.reshape(-1))  # a mean over 21 tokens
        (loss / 2).backward()
        h = hidden.detach().reshape(-1, 5)
        per_token = 21 * 2 * logits.grad.reshape(-1, 4)  # ∂ℓ_i/∂s_i of each token's own loss
        expected_a = expected_a + h.T @ h / 21 / 2
        expected_g = expected_g + per_token.T @ per_token / 21 / 2
    kfac.update_factors()
    state = kfac.state[model[2].weight]
    torch.testing.assert_close(state["a"], expected_a)
    torch.testing.assert_close(state["g"], expected_g)
    kfac.remove()
    assert not model[0]._forward_hooks


def test_preconditioned_gradient_is_the_damped_kronecker_solve(generator) -> None:
    """Martens & Grosse's π-damping written out here (π² = (tr A / dim A) / (tr G / dim G), √λ split between the
    factors), not taken from the optimiser, then the explicit Kronecker solve."""
    model = mlp(generator)
    damping = 1e-2
    kfac = kfac_of(model, damping=damping, update_every=3)
    x = torch.randn(16, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 4, (16,), generator=generator)
    nn.functional.cross_entropy(model(x), y).backward()
    kfac.update_factors()
    grad = model[0].weight.grad.clone()
    a, g = kfac.state[model[0].weight]["a"], kfac.state[model[0].weight]["g"]  # checked by the test above
    pi = ((torch.trace(a) / 6) / (torch.trace(g) / 5)).sqrt()
    a = a + pi * damping**0.5 * torch.eye(6, dtype=a.dtype)
    g = g + damping**0.5 / pi * torch.eye(5, dtype=g.dtype)
    kfac.precondition()
    # row-major vec: vec(G⁻¹·M·A⁻¹) = (G ⊗ A)⁻¹ vec(M) for symmetric A
    expected = torch.linalg.solve(torch.kron(g, a), grad.reshape(-1)).reshape(grad.shape)
    torch.testing.assert_close(model[0].weight.grad, expected)
    stale = kfac.state[model[0].weight]["a_inv"]
    kfac.precondition()  # the second call reuses the inverses (refresh every 3 calls)
    assert kfac.state[model[0].weight]["a_inv"] is stale


class Logits(nn.Module):
    """The transformer as curvlinops wants it: tokens → logits (B·T, V)."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens).logits.flatten(0, 1)


def test_factors_and_preconditioning_agree_with_curvlinops() -> None:
    """Empirical-Fisher KFAC-expand (each token a loss term) of every linear layer in a tiny transformer's
    blocks: curvlinops' factors equal ours, and its damped inverse (Martens' π heuristic) applied to the
    gradient equals our preconditioned gradient."""
    from curvlinops import KFACInverseLinearOperator, KFACLinearOperator

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=24, max_seq_len=16)
    model = Transformer(cfg).double()
    names = [n for n, p in model.named_parameters() if ".layers." in n and p.ndim == 2]
    params = [dict(model.named_parameters())[n] for n in names]
    layers = [model.get_submodule(n.removesuffix(".weight")) for n in names]
    tokens = torch.randint(0, 40, (3, 12))
    targets = torch.randint(0, 40, (3 * 12,))
    loss_func = nn.CrossEntropyLoss()

    damping = 1e-2
    kfac = KFAC([{"params": params, "lr": 1.0}], layers, damping=damping, decay=0.0)
    loss_func(Logits(model)(tokens), targets).backward()
    grads = [p.grad.clone() for p in params]
    kfac.update_factors()
    kfac.precondition()
    ours = [p.grad.clone() for p in params]
    kfac.remove()

    theirs = KFACLinearOperator(
        Logits(model),
        loss_func,
        params,
        [(tokens, targets)],
        fisher_type="empirical",
        check_deterministic=False,
    )
    theirs.compute_kronecker_factors()
    for name, p in zip(names, params, strict=True):
        module = "model." + name.removesuffix(".weight")  # inside the Logits wrapper
        torch.testing.assert_close(kfac.state[p]["a"], theirs._input_covariances[module])
        torch.testing.assert_close(kfac.state[p]["g"], theirs._gradient_covariances[module])
    inverse = KFACInverseLinearOperator(theirs, damping=damping, use_heuristic_damping=True)
    solved = inverse @ [g.clone() for g in grads]
    for mine, reference in zip(ours, solved, strict=True):
        torch.testing.assert_close(mine, reference, rtol=1e-6, atol=1e-9)


def test_state_survives_a_checkpoint_round_trip_exactly(generator) -> None:
    model = mlp(generator)
    twin = mlp(generator)
    twin.load_state_dict(model.state_dict())
    kfac, other = kfac_of(model, update_every=2), kfac_of(twin, update_every=2)
    x = torch.randn(8, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 4, (8,), generator=generator)

    def step(net: nn.Sequential, opt: KFAC) -> None:
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step(model, kfac)
    step(twin, other)
    buffer = io.BytesIO()
    torch.save(kfac.state_dict(), buffer)
    buffer.seek(0)
    twin.load_state_dict(model.state_dict())
    other.load_state_dict(torch.load(buffer))
    for _ in range(3):
        step(model, kfac)
        step(twin, other)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


def test_bad_settings_are_refused(generator) -> None:
    model = mlp(generator)
    with pytest.raises(ValueError, match="K-FAC needs damping > 0"):
        kfac_of(model, damping=0.0)
    with pytest.raises(ValueError, match="weights of its layers"):
        KFAC([{"params": [model[2].weight]}], [model[0]])
