"""One reading position for the reward model: the last token of the conversation as its chat format renders it
(after the answer's end-of-turn token and what the format writes after it). The same conversation gets the same
score in training (the whole-side pair batches), in held-out scoring, in RL (a completion that ended its turn) and
for a client that scores `apply_chat_template` ids with the Hugging Face export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline.chat import chat_format
from data_pipeline.config import PreferenceConfig
from data_pipeline.preference import Pair, PreferenceLoader, read_heldout_pairs, run_preference_data
from data_pipeline.prompts import Prompt
from data_pipeline.tokenizer import TokenizerRef, describe
from tests.hf_checkpoints import write_tokenizer
from training.model.config import ModelConfig
from training.model.reward import RewardModel, export_reward_model, load_reward_model
from training.model.transformer import Transformer
from training.rewards import ReadingPosition, Sample, reward_model_reward
from training.stages.reward_model import heldout_scores


@pytest.fixture(scope="module", params=["lmforge", "chatml", "llama3"])
def tok(request: pytest.FixtureRequest, tokenized, tmp_path_factory: pytest.TempPathFactory) -> TokenizerRef:
    directory = tmp_path_factory.mktemp("tokenizer") / request.param
    if request.param == "lmforge":
        shutil.copytree(tokenized[0].tokenizer.path, directory)
        return describe(directory)
    return describe(write_tokenizer(request.param, directory))


def test_every_path_reads_the_same_position(tok: TokenizerRef, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = ModelConfig(
        vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64, max_seq_len=96
    )
    model = RewardModel(Transformer(cfg, seed=0), tok.pad_id, seed=1).eval()
    export = tmp_path / "rm"
    assert export_reward_model(model, Path(tok.path), export)["valid"]
    assert "end-of-turn" in json.loads((export / "config.json").read_text())["reward_position"]
    pairs = [
        Pair([{"role": "user", "content": f"What is {i}+{i}?"}], f"{2 * i}, surely.", f"{i}.")
        for i in range(20)
    ]
    data = run_preference_data(PreferenceConfig(heldout_fraction=0.5), pairs, tok, 80, tmp_path)
    pair = read_heldout_pairs(Path(data.path) / "heldout.jsonl")[0]

    # training and held-out scoring: the whole sides of the split's first pair
    loader = PreferenceLoader(data, "heldout", batch_size=1, shuffle=False, whole=True)
    with torch.no_grad():
        trained = model(loader.batch_of(np.array([0])).inputs).logits.squeeze(-1)  # (chosen, rejected)
    held = heldout_scores(model, Transformer(cfg, seed=0).eval(), data, limit=1)
    assert held["margin"] == pytest.approx(float(trained[0] - trained[1]), abs=1e-6)

    # a client: transformers' export on apply_chat_template's ids, no generation prompt
    client = AutoTokenizer.from_pretrained(str(export))
    served = AutoModelForSequenceClassification.from_pretrained(str(export), dtype=torch.float32).eval()
    conversations = [
        [*pair.prompt, {"role": "assistant", "content": a}] for a in (pair.chosen, pair.rejected)
    ]
    ids = [client.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"] for c in conversations]
    with torch.no_grad():
        theirs = torch.stack([served(input_ids=torch.tensor([row])).logits.squeeze() for row in ids])
    torch.testing.assert_close(theirs, trained, rtol=0, atol=1e-5)

    # RL: the policy's prompt and a completion that ended its turn
    fmt, tokenizer = chat_format(tok), tok.load()
    prompt_ids = tokenizer.encode(fmt.prompt(pair.prompt), add_special_tokens=False).ids
    completion = [
        *tokenizer.encode(pair.chosen, add_special_tokens=False).ids,
        tokenizer.token_to_id(fmt.end_of_turn),
    ]
    reading = ReadingPosition.of(export)
    assert reading.row(prompt_ids, completion) == ids[0]
    sample = Sample(Prompt(pair.prompt), prompt_ids, completion, pair.chosen, fmt.prompt(pair.prompt))
    (rl,) = reward_model_reward(load_reward_model(export), reading, max_len=96)([sample])
    assert rl == pytest.approx(float(trained[0]), abs=1e-5)
