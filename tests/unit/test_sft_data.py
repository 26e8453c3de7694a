"""SFT examples: loss only on assistant tokens, the tokenizer's chat template, and bad examples named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from data_pipeline.chat import chat_format, own_layout
from data_pipeline.config import SFTDataConfig
from data_pipeline.sft import (
    IGNORE_INDEX,
    SFTLoader,
    builtin_sft_examples,
    encode_example,
    normalize_example,
    run_sft_data,
)
from data_pipeline.shards import DatasetManifest
from data_pipeline.sources import DataError
from data_pipeline.tokenizer import TokenizerRef, describe

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": " Six, of course."},
]


@pytest.fixture(scope="module")
def tok(tokenized: tuple[DatasetManifest, Path]) -> TokenizerRef:
    return describe(Path(tokenized[0].tokenizer.path))


def test_mask_covers_exactly_the_assistant_turns(tok: TokenizerRef) -> None:
    tokenizer = tok.load()
    ids, mask = encode_example(tokenizer, chat_format(tok), CONVERSATION)
    assert (
        tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
        == "Four.<|end|> Six, of course.<|end|>"
    )
    assert "What is" in tokenizer.decode(ids[mask == 0].tolist())


def test_rendering_equals_the_saved_chat_template(tok: TokenizerRef) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tok.path)
    assert own_layout(CONVERSATION)[0] == hf.apply_chat_template(CONVERSATION, tokenize=False)
    ids, _ = encode_example(tok.load(), chat_format(tok), CONVERSATION)
    assert ids.tolist() == hf.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"]


def test_prompt_response_records_become_two_turns() -> None:
    assert normalize_example({"prompt": "p", "response": "r"}, "x") == [
        {"role": "user", "content": "p"},
        {"role": "assistant", "content": "r"},
    ]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role 'robot'"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
        ({"messages": []}, "non-empty list"),
        ({"text": "x"}, "expected"),
        ({"messages": [{"role": "assistant", "content": "a <|end|> b"}]}, "reserved marker"),
    ],
)
def test_bad_examples_are_named(record: dict, message: str) -> None:
    with pytest.raises(DataError, match=message):
        normalize_example(record, "f.jsonl:7")


def test_builtin_set_asks_about_the_stdlib() -> None:
    examples = builtin_sft_examples(50)
    assert len(examples) == 50
    question, answer = examples[0][0]["content"], examples[0][1]["content"]
    assert question.startswith("What does `") and answer.endswith((".", "!", "?"))


def write_jsonl(path: Path, n: int, long_every: int = 0) -> Path:
    lines = []
    for i in range(n):
        response = "word " * (300 if long_every and i % long_every == 0 else 3)
        lines.append(json.dumps({"prompt": f"question {i}?", "response": response.strip()}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("overflow", ["drop", "truncate"])
def test_long_examples_are_dropped_or_truncated_and_counted(
    tok: TokenizerRef, tmp_path: Path, overflow: str
) -> None:
    source = write_jsonl(tmp_path / "sft.jsonl", 60, long_every=5)
    cfg = SFTDataConfig(source=str(source), heldout_fraction=0.2, overflow=overflow)
    manifest = run_sft_data(cfg, tok, seq_len=64, root=tmp_path / "out")
    counted = manifest.counts["dropped_too_long" if overflow == "drop" else "truncated"]
    assert counted == 12
    assert manifest.counts["train"] + manifest.counts["heldout"] == 60 - (12 if overflow == "drop" else 0)
    assert (Path(manifest.path) / "heldout.jsonl").read_text().count("\n") == manifest.counts["heldout"]


def test_loader_targets_only_assistant_tokens(tok: TokenizerRef, tmp_path: Path) -> None:
    cfg = SFTDataConfig(source=str(write_jsonl(tmp_path / "sft.jsonl", 40)), heldout_fraction=0.2)
    manifest = run_sft_data(cfg, tok, seq_len=64, root=tmp_path / "out")
    data = SFTLoader(manifest, batch_size=4, tokenizer_digest=tok.digest)
    batch = data.next_batch()
    assert batch.inputs.shape == batch.targets.shape == (4, 64)
    tokenizer = tok.load()
    for row in range(4):
        kept = batch.targets[row][batch.targets[row] != IGNORE_INDEX].tolist()
        assert tokenizer.decode(kept, skip_special_tokens=False) == "word word word<|end|>"
    assert (batch.inputs[:, -1] == tok.pad_id).all()
    again = SFTLoader(manifest, batch_size=4)
    assert torch.equal(again.next_batch().inputs, batch.inputs)


def test_sft_data_from_another_tokenizer_is_refused(tok: TokenizerRef, tmp_path: Path) -> None:
    cfg = SFTDataConfig(source=str(write_jsonl(tmp_path / "sft.jsonl", 20)), heldout_fraction=0.3)
    manifest = run_sft_data(cfg, tok, seq_len=64, root=tmp_path / "out")
    with pytest.raises(DataError, match=tok.digest[:16]):
        SFTLoader(manifest, batch_size=2, tokenizer_digest="0" * 64)


def test_jsonl_errors_name_the_line(tok: TokenizerRef, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"messages": [{"role": "user", "content": "x"}]}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: no assistant turn"):
        run_sft_data(SFTDataConfig(source=str(path)), tok, seq_len=64, root=tmp_path)
