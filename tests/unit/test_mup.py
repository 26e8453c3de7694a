"""μP coordinate check (Yang et al. 2022, Fig. 5): after a few Adam steps at one learning rate, how far each
layer's activations moved (their RMS change) stays flat across widths under μP and grows with width under the
standard parametrisation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from training.config import OptimConfig
from training.model.config import ModelConfig, MuPConfig
from training.model.transformer import Transformer
from training.optim.optimizers import param_groups, set_lr

WIDTHS = (32, 64, 128, 256)


def activations(model: Transformer, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(lambda _m, _i, o, key=f"block{j}": out.__setitem__(key, o[0].detach()))
        for j, layer in enumerate(model.model.layers)
    ]
    out["logits"] = model(tokens).logits.detach()
    for hook in hooks:
        hook.remove()
    return out


def movement(cfg: ModelConfig, steps: int = 4, lr: float = 1e-2) -> dict[str, float]:
    """RMS change of each block's output and of the logits after `steps` AdamW steps on a fixed batch."""
    model = Transformer(cfg, seed=0)
    optimizer = torch.optim.AdamW(param_groups(model, OptimConfig(weight_decay=0.0), cfg.hidden_lr_mult()))
    tokens = torch.randint(0, cfg.vocab_size, (8, 33), generator=torch.Generator().manual_seed(1))
    before = activations(model, tokens[:, :-1])
    for _ in range(steps):
        set_lr(optimizer, lr)
        model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = activations(model, tokens[:, :-1])
    return {k: float((after[k] - before[k]).pow(2).mean().sqrt()) for k in after}


def at_width(width: int, mup: bool) -> ModelConfig:
    return ModelConfig(
        vocab_size=128,
        d_model=width,
        n_layers=2,
        n_heads=width // 16,
        n_kv_heads=width // 16,
        d_ff=width * 8 // 3 // 16 * 16,
        max_seq_len=64,
        mup=MuPConfig(base_width=WIDTHS[0]) if mup else None,
    )


def slopes(mup: bool) -> dict[str, float]:
    """Per layer, the slope of log RMS change against log width."""
    runs = [movement(at_width(w, mup)) for w in WIDTHS]
    return {k: float(np.polyfit(np.log(WIDTHS), np.log([r[k] for r in runs]), 1)[0]) for k in runs[0]}


@pytest.mark.parametrize(("mup", "flat"), [(True, True), (False, False)])
def test_coordinate_check(mup: bool, flat: bool) -> None:
    measured = slopes(mup)
    if flat:  # μP: every layer moves the same amount at every width (8x wider changes it by < 1.7x)
        assert all(abs(s) < 0.25 for s in measured.values()), measured
    else:  # standard: the blocks' updates blow up with width
        assert all(measured[k] > 1.0 for k in ("block0", "block1")), measured


def test_mup_is_standard_at_base_width() -> None:
    """At m = 1 μP changes nothing but the attention scale (attn_mult / head_dim)."""
    base = ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=96, max_seq_len=32
    )
    head_dim = base.head_dim
    mup = base.model_copy(update={"mup": MuPConfig(base_width=32, attn_mult=head_dim**0.5)})
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    a, b = Transformer(base, seed=2), Transformer(mup, seed=2)
    torch.testing.assert_close(a(tokens).logits, b(tokens).logits, rtol=0, atol=1e-6)


def test_mup_learning_rates_by_group() -> None:
    """Hidden matrices train at lr / m; the readout, embedding and norms at lr."""
    cfg = ModelConfig(
        vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=192, mup=MuPConfig(base_width=16)
    )
    model = Transformer(cfg, seed=None)
    optimizer = torch.optim.AdamW(param_groups(model, OptimConfig(), cfg.hidden_lr_mult()))
    set_lr(optimizer, 1e-2)
    lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
    assert lrs == pytest.approx({"hidden": 2.5e-3, "decay": 1e-2, "no_decay": 1e-2})
    hidden = {id(p) for p in optimizer.param_groups[0]["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in hidden}
    assert names == {n for n, p in model.named_parameters() if n.startswith("model.layers.") and p.ndim == 2}


DEPTHS = (1, 2, 4, 8, 16)


def at_depth(depth: int, base_depth: int | None) -> ModelConfig:
    return ModelConfig(
        vocab_size=128,
        d_model=32,
        n_layers=depth,
        n_heads=2,
        n_kv_heads=2,
        d_ff=80,
        max_seq_len=64,
        mup=MuPConfig(base_width=32, base_depth=base_depth),
    )


@pytest.mark.parametrize(("base_depth", "flat"), [(2, True), (None, False)])
def test_depth_coordinate_check(base_depth: int | None, flat: bool) -> None:
    """CompleteP (`mup.base_depth`): the residual stream moves as far at 16 layers as at 1 after the same steps at
    one learning rate (the slope of log movement against log depth near 0); with the GPT-2 init alone it moves
    more the deeper the model (measured slope 0.65: 7x from 1 to 16 layers)."""
    moved = [
        movement(at_depth(d, base_depth))[f"block{d - 1}"] for d in DEPTHS
    ]  # the stream after the last block
    slope = float(np.polyfit(np.log(DEPTHS), np.log(moved), 1)[0])
    assert (abs(slope) < 0.15) if flat else (slope > 0.4), (slope, moved)


def test_complete_p_is_the_model_itself_at_its_base_depth() -> None:
    """At n_layers = base_depth CompleteP changes nothing: same weights, same logits."""
    base = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=3,
        n_heads=2,
        n_kv_heads=2,
        d_ff=96,
        max_seq_len=32,
        mup=MuPConfig(base_width=32),
    )
    deep = base.model_copy(update={"mup": MuPConfig(base_width=32, base_depth=3)})
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    a, b = Transformer(base, seed=2), Transformer(deep, seed=2)
    assert deep.residual_mult == 1.0
    torch.testing.assert_close(a(tokens).logits, b(tokens).logits, rtol=0, atol=0)


def test_without_complete_p_the_config_dumps_as_before():
    """Run keys hash the model's dump: without `base_depth` it is μP's as before the field existed (cached sweep
    trials are found), with it the depth is part of the key."""
    assert "base_depth" not in MuPConfig(base_width=32).model_dump(mode="json")
    assert MuPConfig(base_width=32, base_depth=2).model_dump(mode="json")["base_depth"] == 2
    assert MuPConfig.model_validate(MuPConfig(base_width=32).model_dump()).base_depth is None
