"""LoRA as a transform: only adapters train, bad targets and ranks are refused with the valid choices."""

from __future__ import annotations

import pytest
import torch

from training.config import LoraSettings
from training.model.config import ModelConfig, MoEConfig
from training.model.lora import apply_lora, check_targets, merged_state_dict, trainable_counts
from training.model.transformer import Transformer

CFG = ModelConfig(vocab_size=97, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)


def test_only_adapter_parameters_train() -> None:
    model = apply_lora(Transformer(CFG), LoraSettings(r=4, target_modules=("q_proj", "v_proj")))
    trainable, total = trainable_counts(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    assert trainable == 2 * (4 * 64 + 64 * 4) + 2 * (4 * 64 + 32 * 4)  # q: 64->64, v: 64->32, two layers
    assert total == sum(p.numel() for p in Transformer(CFG).parameters()) + trainable


def test_fresh_adapters_leave_the_model_unchanged_and_merge_exactly() -> None:
    base = Transformer(CFG, seed=1)
    tokens = torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))
    expected = base(tokens).logits
    lora = apply_lora(Transformer(CFG, seed=1), LoraSettings(r=4))
    torch.testing.assert_close(lora(tokens).logits, expected, rtol=0, atol=0)  # B starts at zero
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    unmerged = lora(tokens).logits
    merged = Transformer(CFG, seed=None)
    merged.load_state_dict(merged_state_dict(lora))
    torch.testing.assert_close(merged(tokens).logits, unmerged, rtol=1e-5, atol=1e-5)


def test_target_that_matches_nothing_lists_valid_names() -> None:
    with pytest.raises(
        ValueError, match=r"\['qproj'\] match no linear layer; valid names: \['down_proj', 'gate_proj'"
    ):
        check_targets(Transformer(CFG), LoraSettings(target_modules=("qproj",)))


def test_rank_larger_than_a_target_dimension() -> None:
    with pytest.raises(ValueError, match=r"r=40 exceeds the smallest dimension \(32\) of 'k_proj'"):
        check_targets(Transformer(CFG), LoraSettings(r=40, target_modules=("q_proj", "k_proj")))


def test_expert_adapters_need_experts() -> None:
    with pytest.raises(ValueError, match="needs a model with MoE layers"):
        check_targets(Transformer(CFG), LoraSettings(experts=True))
    moe = CFG.model_copy(update={"moe": MoEConfig(n_experts=2, top_k=1, d_ff_expert=32)})
    model = apply_lora(Transformer(moe), LoraSettings(r=2, target_modules=("q_proj",), experts=True))
    assert any("experts" in n and "lora" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("tied", [True, False])
def test_chat_token_rows_train_and_a_tied_head_stays_tied(tied: bool) -> None:
    """The chat tokens' rows are trainable beside the adapters; what they learn reaches the output head too (the
    same rows when tied), and the merged model is exactly the trained one."""
    cfg = CFG.model_copy(update={"tie_embeddings": tied})
    model = apply_lora(Transformer(cfg, seed=1), LoraSettings(r=4), chat_tokens=[5, 7])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("trainable_tokens_delta" in n for n in names)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "trainable_tokens_delta" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    tokens = torch.tensor([[1, 5, 9, 7, 3]])
    with torch.no_grad():
        trained = model(tokens).logits
        merged = model.merge_and_unload()
        torch.testing.assert_close(merged(tokens).logits, trained, rtol=0, atol=1e-5)
    base = Transformer(cfg, seed=1)
    changed = (merged.lm_head.weight - base.lm_head.weight).abs().sum(1) > 0
    assert changed.nonzero().flatten().tolist() == [5, 7]  # the head learnt the rows, and only those


def test_unseen_chat_rows_start_apart_at_the_seen_rows_mean() -> None:
    """Rows pretraining pushed into one direction (collapsed here on purpose) start distinct, near the seen rows'
    mean; a chat token pretraining saw keeps its row."""
    import numpy as np

    from training.model.lora import start_unseen_rows

    base = Transformer(CFG.model_copy(update={"tie_embeddings": True}), seed=1)
    with torch.no_grad():
        base.model.embed_tokens.weight[[5, 7]] = base.model.embed_tokens.weight[60] * 3  # one direction
    seen = np.ones(CFG.vocab_size, dtype=bool)
    seen[[5, 7]] = False
    model = apply_lora(base, LoraSettings(r=4), chat_tokens=[5, 7, 9])
    assert start_unseen_rows(model, [5, 7, 9], seen) == [5, 7]
    rows = model.merge_and_unload().model.embed_tokens.weight
    original = Transformer(CFG.model_copy(update={"tie_embeddings": True}), seed=1).model.embed_tokens.weight
    assert torch.cosine_similarity(rows[5], rows[7], dim=0) < 0.5
    assert torch.equal(rows[9], original[9])
    mean = original[torch.from_numpy(seen)].mean(0)
    assert (rows[5] - mean).norm() < 2 * (original[torch.from_numpy(seen)] - mean).norm(dim=1).mean()
