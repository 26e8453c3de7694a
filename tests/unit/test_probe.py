"""The downstream probe: conditional bits per byte of each continuation given its (left-truncated) context."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from data_pipeline.humaneval import TaskPair, humaneval_pairs, problems
from training.model.config import ModelConfig
from training.model.transformer import Transformer
from training.probe import TaskProbe

CFG = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=64)


def test_probe_is_the_summed_continuation_loss_over_its_bytes():
    generator = torch.Generator().manual_seed(0)
    pairs = [
        TaskPair(
            f"t{i}",
            torch.randint(0, 50, (n,), generator=generator).tolist(),
            torch.randint(0, 50, (m,), generator=generator).tolist(),
            3 * m,
        )
        for i, (n, m) in enumerate([(5, 4), (40, 9), (2, 20)])
    ]
    model = Transformer(CFG, seed=1).eval()
    probe = TaskProbe(pairs, window=24, batch_size=2)
    nats = 0.0
    for pair in pairs:  # one sequence at a time, context cut from the left to fit 24 inputs
        context = pair.context[-(25 - len(pair.continuation)) :]
        tokens = torch.tensor([context + pair.continuation])
        logits = model(tokens[:, :-1]).logits[0, len(context) - 1 :]
        nats += float(F.cross_entropy(logits, tokens[0, len(context) :], reduction="sum"))
    got = probe(model)
    assert got["probe/bpb"] == pytest.approx(nats / (math.log(2) * sum(p.n_bytes for p in pairs)), rel=1e-5)
    assert got["probe/tasks"] == 3


def test_humaneval_ships_164_problems_and_a_too_short_window_is_refused():
    from tokenizers import Tokenizer, models, pre_tokenizers

    assert len(problems()) == 164
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    pairs = humaneval_pairs(tokenizer)
    assert len(pairs) == 164 and all(p.n_bytes > 0 for p in pairs)
    with pytest.raises(ValueError, match="raise train.seq_len"):
        TaskProbe(pairs, window=1)
