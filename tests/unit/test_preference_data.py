"""Preference pairs: derived offline from SFT conversations or read from JSONL/Parquet; the mask on the final
answer only; bad pairs dropped and counted; the loader's chosen-then-rejected layout; the DPO loss family."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data_pipeline.chat import chat_format
from data_pipeline.config import PreferenceConfig
from data_pipeline.loader import IGNORE_INDEX
from data_pipeline.preference import (
    Pair,
    PairBatch,
    PreferenceLoader,
    derive_pairs,
    encode_side,
    garbled,
    is_noise,
    read_heldout_pairs,
    read_pairs,
    run_preference_data,
)
from data_pipeline.shards import DatasetManifest
from data_pipeline.sources import DataError
from data_pipeline.tokenizer import TokenizerRef, describe
from training.config import PreferenceLoss
from training.stages.dpo import pair_losses, sequence_logps

CONVERSATIONS = [
    [
        {"role": "user", "content": f"What does `mod.f{i}` do?"},
        {"role": "assistant", "content": f"It returns {i} plus one, quickly."},
    ]
    for i in range(40)
]


@pytest.fixture(scope="module")
def tok(tokenized: tuple[DatasetManifest, Path]) -> TokenizerRef:
    return describe(Path(tokenized[0].tokenizer.path))


def test_derived_pairs_keep_the_answer_and_corrupt_the_rejected_side() -> None:
    other = derive_pairs(CONVERSATIONS, "other_answer", seed=3)
    assert [p.chosen for p in other] == [c[-1]["content"] for c in CONVERSATIONS]
    assert all(
        p.rejected != p.chosen and p.rejected in {c[-1]["content"] for c in CONVERSATIONS} for p in other
    )
    assert other == derive_pairs(CONVERSATIONS, "other_answer", seed=3)  # offline and deterministic
    shuffled = derive_pairs(CONVERSATIONS, "shuffled", seed=3)
    assert all(sorted(p.rejected.split()) == sorted(p.chosen.split()) for p in shuffled)
    assert sum(p.rejected != p.chosen for p in shuffled) >= 35
    assert shuffled[0].prompt == CONVERSATIONS[0][:-1]
    for pair in derive_pairs(CONVERSATIONS, "swapped", seed=3):  # exactly two words trade places
        chosen, rejected = pair.chosen.split(), pair.rejected.split()
        assert sorted(chosen) == sorted(rejected) and sum(
            a != b for a, b in zip(chosen, rejected, strict=True)
        ) in (0, 2)


def test_garbled_pairs_replace_a_third_of_the_answer_with_byte_noise_and_modes_mix() -> None:
    for pair in derive_pairs(CONVERSATIONS, "garbled", seed=3):
        chosen, rejected = pair.chosen, pair.rejected
        head = len(os.path.commonprefix([chosen, rejected]))
        tail = len(os.path.commonprefix([chosen[head:][::-1], rejected[head:][::-1]]))
        noise = rejected[head : len(rejected) - tail]  # the stretch that differs
        assert len(rejected) == len(chosen) and 0 < len(noise) <= round(len(chosen) / 3)
        assert all(map(is_noise, noise)) and not all(c.isprintable() for c in noise)
    mixed = derive_pairs(CONVERSATIONS, ["swapped", "garbled"], seed=3)
    assert all(sorted(p.rejected.split()) == sorted(p.chosen.split()) for p in mixed[::2])
    assert all(any(map(is_noise, p.rejected)) for p in mixed[1::2])


def test_garbled_noise_draws_every_utf8_width_equally() -> None:
    """Noise characters of one, two, three and four UTF-8 bytes, each about a quarter of the draws (4,000 of
    them: a width never drawn, or drawn at half its rate, is far outside the binomial spread of ±3%)."""
    noise = garbled("x" * 12_000, np.random.default_rng(0))
    widths = [len(c.encode("utf-8", "surrogatepass")) for c in noise if c != "x"]
    shares = [widths.count(w) / len(widths) for w in (1, 2, 3, 4)]
    assert len(widths) == 4000 and all(abs(share - 0.25) < 0.03 for share in shares), shares


def test_the_mask_covers_the_final_answer_only(tok: TokenizerRef) -> None:
    tokenizer = tok.load()
    prompt = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},  # an earlier answer: context, no loss
        {"role": "user", "content": "Name a colour."},
    ]
    ids, mask = encode_side(tokenizer, chat_format(tok), prompt, "Blue.")
    assert tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == "Blue.<|end|>"
    assert tokenizer.decode(ids.tolist(), skip_special_tokens=False).endswith("<|assistant|>\nBlue.<|end|>")


def test_user_pairs_from_jsonl_and_parquet(tmp_path: Path) -> None:
    records = [
        {"prompt": "Say hi", "chosen": "Hi!", "rejected": "No."},
        {
            "prompt": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
            "chosen": "Hello.",
            "rejected": "Go away.",
        },
    ]
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist([records[0]]), tmp_path / "pairs.parquet")
    pairs = read_pairs(jsonl)
    assert pairs[0] == Pair([{"role": "user", "content": "Say hi"}], "Hi!", "No.")
    assert pairs[1].prompt[0]["role"] == "system"
    assert read_pairs(tmp_path / "pairs.parquet") == pairs[:1]


@pytest.mark.parametrize(
    "line, message",
    [
        (
            '{"prompt": "x", "chosen": "y"}',
            r"pairs.jsonl:2: no 'rejected' field \(it has 'prompt', 'chosen'\)",
        ),
        ('["x", "y"]', r"pairs.jsonl:2: expected a record"),
        ('{"prompt": "x", "chosen": 3, "rejected": "z"}', "must be strings"),
        ('{"prompt": "x <|end|>", "chosen": "y", "rejected": "z"}', "reserved marker"),
        ("not json", "pairs.jsonl:2: not valid JSON"),
    ],
)
def test_bad_pair_records_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n' + line + "\n")
    with pytest.raises(DataError, match=message):
        read_pairs(path)
    with pytest.raises(DataError, match="does not exist"):
        read_pairs(tmp_path / "missing.jsonl")


def test_identical_empty_and_long_pairs_are_counted(tok: TokenizerRef, tmp_path: Path) -> None:
    prompt = [{"role": "user", "content": "Q?"}]
    pairs = [
        *(Pair(prompt, f"Answer number {i}.", f"Wrong {i}.") for i in range(30)),
        Pair(prompt, "Same.", "Same. "),  # equal once trimmed
        Pair(prompt, "   ", "Something."),  # empty answer
        Pair(prompt, "word " * 200, "short."),  # longer than the context: its answer is cut
        Pair([{"role": "user", "content": "long " * 200}], "a.", "b."),  # the prompt alone fills it
    ]
    data = run_preference_data(PreferenceConfig(heldout_fraction=0.2), pairs, tok, 32, tmp_path)
    counts = data.counts
    assert (
        counts["dropped_identical"],
        counts["dropped_empty"],
        counts["truncated"],
        counts["dropped_too_long"],
    ) == (1, 1, 1, 1)
    assert counts["train"] + counts["heldout"] == 31
    assert len(read_heldout_pairs(Path(data.path) / "heldout.jsonl")) == counts["heldout"]
    again = run_preference_data(PreferenceConfig(heldout_fraction=0.2), pairs, tok, 32, tmp_path)
    assert again.path == data.path  # a rerun is a no-op

    reference = np.arange(2 * counts["train"], dtype=np.float32).reshape(-1, 2)
    loader = PreferenceLoader(data, "train", batch_size=4, shuffle=False, reference=reference)
    batch = loader.next_batch()
    assert batch.inputs.shape == (8, 32) and batch.n_pairs == 4
    assert torch.equal(batch.reference, torch.from_numpy(reference[:4]))
    for row in range(8):  # every side carries loss on its answer only, after the prompt
        assert (batch.targets[row] != IGNORE_INDEX).sum() > 0
    assert torch.equal(
        batch.inputs[0, :5], batch.inputs[4, :5]
    )  # chosen and rejected of pair 0 share the prompt
    with pytest.raises(DataError, match="reference log-probabilities"):
        PreferenceLoader(data, "train", batch_size=4, reference=reference[:3])


def test_loss_types_follow_their_definitions() -> None:
    """TRL's definitions: sigmoid −log σ(βΔ), hinge relu(1 − βΔ), IPO (Δ̄ − 1/2β)² and sigmoid_norm −log σ(βΔ̄),
    with Δ the chosen-minus-rejected log-ratio and Δ̄ its per-token mean; ln 2 when the policy is the reference."""
    logps = torch.tensor([-10.0, -4.0, -12.0, -9.0])  # chosen (2 pairs), then rejected
    lengths = torch.tensor([5, 2, 4, 3])
    reference = torch.tensor([[-11.0, -11.0], [-5.0, -8.0]])
    delta = torch.tensor([(-10 + 11) - (-12 + 11), (-4 + 5) - (-9 + 8)])
    mean_delta = torch.tensor([1 / 5 - (-1) / 4, 1 / 2 - (-1) / 3])
    beta = 0.5
    expected = {
        "sigmoid": -torch.nn.functional.logsigmoid(beta * delta),
        "hinge": torch.relu(1 - beta * delta),
        "ipo": (mean_delta - 1 / (2 * beta)) ** 2,
        "sigmoid_norm": -torch.nn.functional.logsigmoid(beta * mean_delta),
    }
    for kind, values in expected.items():
        losses, rewards = pair_losses(PreferenceLoss(type=kind, beta=beta), logps, reference, lengths)
        assert torch.allclose(losses, values), kind
    assert torch.allclose(rewards, beta * torch.tensor([[1.0, -1.0], [1.0, -1.0]]))
    same, _ = pair_losses(PreferenceLoss(), logps, torch.stack(logps.chunk(2), 1), lengths)
    assert torch.allclose(same, torch.full((2,), math.log(2)))


def test_sequence_logps_sum_over_the_answer(generator: torch.Generator) -> None:
    logits = torch.randn(2, 5, 7, generator=generator)
    targets = torch.tensor([[IGNORE_INDEX, 1, 2, IGNORE_INDEX, IGNORE_INDEX], [3, 4, 5, 6, 0]])
    logps, lengths = sequence_logps(logits, targets)
    log_softmax = logits.log_softmax(-1)
    assert torch.allclose(logps[0], log_softmax[0, 1, 1] + log_softmax[0, 2, 2])
    assert torch.allclose(logps[1], sum(log_softmax[1, t, int(targets[1, t])] for t in range(5)))
    assert lengths.tolist() == [2, 5]


def test_a_non_finite_preference_loss_is_skipped_by_the_loops_guard(generator: torch.Generator) -> None:
    """A pair batch whose reference log-probabilities are not finite gives a non-finite DPO loss: the loop's
    guard skips the step (learning rate 0, weights untouched), as for any objective."""
    from training.engine import PlainEngine
    from training.loop import optimizer_step
    from training.model.config import ModelConfig
    from training.model.transformer import Transformer
    from training.stages.dpo import PreferenceObjective

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=16)
    model = Transformer(cfg, seed=0)
    engine = PlainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, 0.0)
    inputs = torch.randint(0, 64, (4, 12), generator=generator)
    targets = inputs.roll(-1, 1)
    targets[:, :5] = IGNORE_INDEX

    class Once:
        def __init__(self, reference: torch.Tensor) -> None:
            self.batch = PairBatch(inputs, targets, reference)

        def next_batch(self) -> PairBatch:
            return self.batch

    objective = PreferenceObjective(PreferenceLoss())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = optimizer_step(engine, Once(torch.tensor([[float("nan"), 0.0], [0.0, 0.0]])), objective, 0.1, 1)
    assert bad.loss is None and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    good = optimizer_step(engine, Once(torch.zeros(2, 2)), objective, 0.1, 1)
    assert good.loss is not None and math.isfinite(good.loss) and "rewards/margins" in good.metrics
