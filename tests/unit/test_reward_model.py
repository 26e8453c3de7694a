"""The reward model: its Hugging Face export scores as lmforge does (transformers' own class, loaded with
AutoModelForSequenceClassification), and its Bradley–Terry loss equals TRL's RewardTrainer's on the same model and
batch, with and without a margin and reward centring."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from training.model.config import ModelConfig, MoEConfig
from training.model.reward import RewardModel, bradley_terry, export_reward_model, last_token, probe_rows
from training.model.transformer import Transformer

CFG = ModelConfig(vocab_size=512, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=32)
PAD = 3


def test_last_token_is_the_last_non_pad_one() -> None:
    rows = torch.tensor([[5, 6, 7, PAD, PAD], [5, 6, 7, 8, 9], [5, PAD, PAD, PAD, PAD]])
    assert last_token(rows, PAD).tolist() == [2, 4, 0]


@pytest.mark.parametrize("moe", [False, True])
def test_the_export_scores_what_lmforge_scores(tokenized, tmp_path: Path, moe: bool) -> None:
    from transformers import AutoModelForSequenceClassification

    manifest, _ = tokenized
    cfg = CFG.model_copy(update={"moe": MoEConfig(n_experts=4, top_k=2, d_ff_expert=32)}) if moe else CFG
    ours = RewardModel(Transformer(cfg, seed=1), pad_id=PAD, seed=2).eval()
    verification = export_reward_model(ours, Path(manifest.tokenizer.path), tmp_path / "hf")
    assert verification["valid"] and verification["architecture"].endswith("ForSequenceClassification")
    theirs = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert theirs.config.num_labels == 1 and theirs.config.pad_token_id == PAD
    rows = probe_rows(cfg.vocab_size, PAD, 24, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(ours(rows).logits, theirs(input_ids=rows).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("margin", "centring"), [(False, 0.0), (True, 0.0), (False, 0.01), (True, 0.05)])
def test_the_loss_equals_trls_reward_trainer(
    tokenized, tmp_path: Path, margin: bool, centring: float
) -> None:
    from transformers import AutoModelForSequenceClassification
    from trl import RewardTrainer

    manifest, _ = tokenized
    ours = RewardModel(Transformer(CFG, seed=1), pad_id=PAD, seed=2).eval()
    export_reward_model(ours, Path(manifest.tokenizer.path), tmp_path / "hf")
    theirs = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    rows = torch.cat([probe_rows(CFG.vocab_size, PAD, 20, seed=s) for s in range(4)])  # 4 chosen, 4 rejected
    margins = torch.tensor([0.5, -0.2, 1.0, 0.0]) if margin else None
    inputs = {"input_ids": rows, "attention_mask": (rows != PAD).long()}
    if margins is not None:
        inputs["margin"] = margins
    trainer = SimpleNamespace(  # what RewardTrainer.compute_loss reads of its trainer
        model=theirs,
        args=SimpleNamespace(center_rewards_coefficient=centring or None),
        accelerator=SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x),
        _metrics={"train": _Lists(), "eval": _Lists()},
        _total_train_tokens=0,
        _tp_size=1,
    )
    with torch.no_grad():
        expected = RewardTrainer.compute_loss(trainer, theirs, dict(inputs))
        rewards = ours(rows).logits.squeeze(-1)
        got = bradley_terry(*rewards.chunk(2), margins, centring)
    assert float(got) == pytest.approx(float(expected), rel=1e-5)


class _Lists(dict):
    def __missing__(self, key: str) -> list:
        self[key] = []
        return self[key]
