"""Our model against Hugging Face `transformers`: same logits from the same weights, same parameter counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.model.accounting import count_parameters
from training.model.config import ModelConfig, MoEConfig, MuPConfig
from training.model.hf_interop import (
    build_hf_model,
    hf_config_kwargs,
    load_hf_config,
    model_config_from_hf,
    to_hf_state_dict,
)
from training.model.sampling import generate
from training.model.transformer import Transformer

pytestmark = pytest.mark.parity

HF_CONFIGS = Path(__file__).resolve().parent.parent / "assets" / "hf_configs"
TINY = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)
TINY_CONFIGS = {
    "llama-gqa": TINY,
    "llama-tied-mha": TINY.model_copy(
        update={"tie_embeddings": True, "n_kv_heads": 4, "rope_theta": 500_000.0}
    ),
    "mixtral": TINY.model_copy(update={"moe": MoEConfig(n_experts=4, top_k=2, d_ff_expert=48)}),
    "mixtral-top1": TINY.model_copy(update={"moe": MoEConfig(n_experts=3, top_k=1, d_ff_expert=40)}),
    # μP's logit and attention multipliers and CompleteP's residual multiplier fold into the exported weights
    "llama-mup-tied": TINY.model_copy(
        update={
            "tie_embeddings": True,
            "mup": MuPConfig(base_width=16, output_mult=2.0, attn_mult=3.0, base_depth=3),
        }
    ),
    "mixtral-mup": TINY.model_copy(
        update={
            "moe": MoEConfig(n_experts=4, top_k=2, d_ff_expert=48),
            "mup": MuPConfig(base_width=32, base_depth=1),
        }
    ),
}


def paired(cfg: ModelConfig, seed: int = 5) -> tuple[Transformer, torch.nn.Module]:
    ours = Transformer(cfg, seed=seed).eval()
    theirs = build_hf_model(cfg).eval()
    theirs.load_state_dict(to_hf_state_dict(ours.state_dict(), ours.cfg), strict=True)
    return ours, theirs


@pytest.mark.parametrize("kind", TINY_CONFIGS)
def test_logits_match_transformers(kind: str) -> None:
    cfg = TINY_CONFIGS[kind]
    ours, theirs = paired(cfg)
    expected_cls = "MixtralForCausalLM" if cfg.moe else "LlamaForCausalLM"
    assert type(theirs).__name__ == expected_cls
    tokens = torch.randint(0, cfg.vocab_size, (3, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens).logits, theirs(tokens).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama-gqa", "mixtral"])
def test_greedy_generation_matches_transformers(kind: str) -> None:
    ours, theirs = paired(TINY_CONFIGS[kind], seed=11)
    prompt = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    expected = theirs.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=12,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(generate(ours, prompt, 12), expected)


@pytest.mark.parametrize("kind", TINY_CONFIGS)
def test_parameter_count_matches_transformers_tiny(kind: str) -> None:
    cfg = TINY_CONFIGS[kind]
    with torch.device("meta"):
        theirs = build_hf_model(cfg)
    assert count_parameters(cfg).total == sum(p.numel() for p in theirs.parameters())


@pytest.mark.parametrize(
    ("name", "published_total"), [("llama-3-8b", 8_030_261_248), ("mixtral-8x7b", 46_702_792_704)]
)
def test_parameter_count_matches_published_configs(name: str, published_total: int) -> None:
    cfg = load_hf_config(HF_CONFIGS / f"{name}.json")
    with torch.device("meta"):
        theirs = build_hf_model(cfg)
    ours = count_parameters(cfg)
    assert ours.total == sum(p.numel() for p in theirs.parameters()) == published_total


def test_mixtral_active_parameters_are_the_published_12_9b() -> None:
    active = count_parameters(load_hf_config(HF_CONFIGS / "mixtral-8x7b.json")).active
    assert round(active / 1e9, 1) == 12.9


def test_round_trip_through_hf_config() -> None:
    """Ours -> HF config -> ours is the identity, except what Mixtral cannot hold (dense d_ff, z-loss) and μP
    (folded into the exported weights, so the export is a standard model)."""
    for cfg in TINY_CONFIGS.values():
        cfg = cfg.model_copy(update={"mup": None})
        model_type, kwargs = hf_config_kwargs(cfg)
        again = model_config_from_hf({"model_type": model_type, **kwargs})
        if cfg.moe is None:
            assert again == cfg
        else:
            assert again.model_dump(exclude={"d_ff", "moe"}) == cfg.model_dump(exclude={"d_ff", "moe"})
            assert again.moe is not None
            assert again.moe.model_dump(exclude={"z_loss_coef"}) == cfg.moe.model_dump(
                exclude={"z_loss_coef"}
            )


def test_mixed_dense_and_moe_has_no_mixtral_equivalent() -> None:
    cfg = TINY.model_copy(update={"moe": MoEConfig(n_experts=2, top_k=1, d_ff_expert=32, first_k_dense=1)})
    with pytest.raises(ValueError, match="mixes dense and MoE layers"):
        hf_config_kwargs(cfg)


def test_unsupported_hf_model_type(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "gpt2"}')
    with pytest.raises(ValueError, match="model_type: 'gpt2' is not supported"):
        load_hf_config(tmp_path)


@pytest.mark.parametrize(("kind", "experts"), [("llama-mup-tied", False), ("mixtral-mup", True)])
def test_mup_lora_adapter_loads_on_the_folded_export(tmp_path: Path, kind: str, experts: bool) -> None:
    """A LoRA adapter trained on a μP and CompleteP model (on the stacked experts too) gives the same logits through
    PEFT on the Hugging Face export."""
    from peft import PeftModel

    from training.config import LoraSettings
    from training.model.hf_interop import weight_folds
    from training.model.lora import apply_lora, save_adapter

    cfg = TINY_CONFIGS[kind]
    ours, theirs = paired(cfg, seed=3)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj") if experts else LoraSettings().target_modules
    tuned = apply_lora(ours, LoraSettings(r=4, alpha=8, target_modules=targets, experts=experts))
    with torch.no_grad():
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    save_adapter(tuned, tmp_path / "adapter", None, weight_folds(cfg))
    loaded = PeftModel.from_pretrained(theirs, str(tmp_path / "adapter")).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(tuned.eval()(tokens).logits, loaded(tokens).logits, rtol=0, atol=1e-5)
