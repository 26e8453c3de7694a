"""Supervised fine-tuning examples: chat turns rendered in the tokenizer's chat format (`data_pipeline/chat.py`:
its template, or lmforge's layout), loss on assistant tokens.

Sources: JSONL with `{"messages": [{"role", "content"}, ...]}` or `{"prompt", "response"}`, or `builtin`:
questions about the standard library corpus ("What does `json.dumps` do?" answered by the first sentence of its
docstring), read from the source with `ast`, never by importing it.

The loss mask is 1 exactly on the tokens of assistant contents and their end-of-turn marker. Examples are not
packed together: each is one row padded to the sequence length (padding carries no loss), so no example can
attend to another. This wastes some compute on short examples and keeps attention masks trivial.
"""

from __future__ import annotations

import ast
import functools
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from tokenizers import Tokenizer
from torch import Tensor

from data_pipeline.chat import ChatFormat, Messages, chat_format
from data_pipeline.config import ROLES, SPECIAL_TOKENS, SFTDataConfig
from data_pipeline.loader import IGNORE_INDEX, Batch, EpochSampler, SampledLoader
from data_pipeline.sources import DataError, ReadStats, decode_text, split_of, stdlib_files, stdlib_root
from data_pipeline.tokenizer import TokenizerRef
from infra.steps import Artifact, Step, run_step
from infra.storage import MANIFEST, atomic_write_bytes, digest_of

SFT_FORMAT_VERSION = 1


def normalize_example(record: Any, where: str) -> Messages:
    """A JSON record as a list of {role, content} turns, checked: known roles, text content, an assistant turn."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
    elif isinstance(record, dict) and "prompt" in record and "response" in record:
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
    else:
        raise DataError(f"{where}: expected {{'messages': [...]}} or {{'prompt': ..., 'response': ...}}")
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects")
    for turn in messages:
        if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
            raise DataError(f"{where}: every turn needs a string 'content' (got {turn!r:.80})")
        if turn.get("role") not in ROLES:
            raise DataError(f"{where}: unknown role {turn.get('role')!r}; roles are {', '.join(ROLES)}")
        reserved = [t for t in SPECIAL_TOKENS if t in turn["content"]]
        if reserved:
            raise DataError(
                f"{where}: content contains the reserved marker {reserved[0]}; remove it from the text"
            )
    if not any(turn["role"] == "assistant" for turn in messages):
        raise DataError(f"{where}: no assistant turn, so nothing to learn from; add one or drop the example")
    return [{"role": t["role"], "content": t["content"]} for t in messages]


def read_sft_jsonl(path: Path) -> list[Messages]:
    if not path.is_file():
        raise DataError(f"data.sft.source: {path} does not exist; give a JSONL file or 'builtin'")
    examples, stats = [], ReadStats()
    for lineno, raw in enumerate(path.read_bytes().splitlines(), start=1):
        line = decode_text(raw, f"{path}:{lineno}", stats).strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{lineno}: not valid JSON ({error.msg})") from None
        examples.append(normalize_example(record, f"{path}:{lineno}"))
    if not examples:
        raise DataError(f"{path}: no examples")
    return examples


def first_sentence(docstring: str) -> str | None:
    """The first sentence of a docstring's first paragraph, if it is a usable answer (20 to 300 characters)."""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    sentence = match.group(1) if match else paragraph
    return sentence if 20 <= len(sentence) <= 300 else None


def builtin_sft_examples(max_examples: int | None) -> list[Messages]:
    """Questions about public functions and classes of the standard library, answered from their docstrings."""
    return [
        [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        for question, answer in _stdlib_answers(max_examples)
    ]


@functools.cache
def _stdlib_answers(max_examples: int | None) -> tuple[tuple[str, str], ...]:
    """(question, answer) pairs of `builtin_sft_examples`: the stdlib's sources parsed once a process (~3 s; the
    demo's SFT data, preference pairs, RL prompts and distillation each read them)."""
    pairs: list[tuple[str, str]] = []
    root = stdlib_root()
    for path in stdlib_files():
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if any(p.startswith("_") for p in parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        module = ".".join(parts)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.ClassDef) or node.name.startswith("_"):
                continue
            answer = first_sentence(ast.get_docstring(node) or "")
            if answer:
                pairs.append((f"What does `{module}.{node.name}` do?", answer))
                if max_examples is not None and len(pairs) >= max_examples:
                    return tuple(pairs)
    return tuple(pairs)


def encode_example(
    tokenizer: Tokenizer, fmt: ChatFormat, messages: Messages
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and a 0/1 loss mask: 1 on assistant contents and their end-of-turn token. The text is the
    format's whole rendering (no special tokens added around it: a template writes its own)."""
    text, spans = fmt.render(messages)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    starts = np.array([start for start, _ in encoding.offsets], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=np.uint8)
    for lo, hi in spans:
        mask[(starts >= lo) & (starts < hi)] = 1
    return np.array(encoding.ids, dtype=np.int32), mask


class SFTManifest(Artifact):
    """Encoded SFT examples (train and held-out Arrow files plus the held-out conversations as JSONL)."""

    version: int
    tokenizer_digest: str
    pad_id: int
    seq_len: int
    counts: dict[str, int]  # examples per split, plus dropped / truncated
    config: dict[str, Any]

    @classmethod
    def load(cls, directory: str | Path) -> SFTManifest:
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise DataError(f"{directory}: no {MANIFEST}; run `lmforge tokenize` to build the SFT examples")
        return cls.from_file(path)


def write_rows(path: Path, rows: list[list[np.ndarray]], names: list[str]) -> None:
    """Rows of (ids, mask, ids, mask, ...) arrays as one Arrow IPC record batch of list columns `names`,
    written atomically (int32 ids, uint8 masks)."""
    types = [pa.int32(), pa.uint8()] * (len(names) // 2)
    columns = [pa.array([row[i] for row in rows], type=pa.list_(t)) for i, t in enumerate(types)]
    batch = pa.record_batch(columns, names=names)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


def read_rows(path: Path) -> pa.RecordBatch:
    """The record batch `write_rows` wrote, memory-mapped."""
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).get_batch(0)


def padded_rows(rows: list[tuple[np.ndarray, np.ndarray]], width: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Next-token inputs and targets (len(rows), width) of (ids, 0/1 loss mask) rows: inputs padded with `pad_id`,
    targets IGNORE_INDEX where the mask is 0 or on padding."""
    inputs = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    targets = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.int64)
    for row, (ids, mask) in enumerate(rows):
        tokens, keep = torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(bool))
        n = len(tokens) - 1
        inputs[row, :n] = tokens[:-1]
        targets[row, :n] = torch.where(keep[1:], tokens[1:], IGNORE_INDEX)
    return inputs, targets


def sft_examples(cfg: SFTDataConfig) -> list[Messages]:
    """The configured conversations: built-in stdlib questions or a JSONL file, at most `max_examples`."""
    if cfg.source == "builtin":
        return builtin_sft_examples(cfg.max_examples)
    return read_sft_jsonl(Path(cfg.source))[: cfg.max_examples]


def run_sft_data(cfg: SFTDataConfig, tok: TokenizerRef, seq_len: int, root: str | Path) -> SFTManifest:
    """Stage: encode SFT examples into `<root>/sft_data/sft-<hash>/{train,heldout}.arrow` (+ heldout.jsonl)."""
    examples = sft_examples(cfg)
    config = {
        "config": cfg.model_dump(mode="json", exclude={"source"}),
        "examples": digest_of(examples),
        "tokenizer": tok.digest,
        "seq_len": seq_len,
        **chat_format(tok).key,
    }
    step = Step("sft_data", "sft", SFT_FORMAT_VERSION, config, SFTManifest)
    return run_step(root, step, lambda out, _key: _encode_sft(cfg, tok, seq_len, examples, out))


def _encode_sft(
    cfg: SFTDataConfig, tok: TokenizerRef, seq_len: int, examples: list[Messages], out: Path
) -> SFTManifest:
    tokenizer, fmt = tok.load(), chat_format(tok)
    splits: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "heldout": []}
    heldout_messages: list[Messages] = []
    counts = {"dropped_too_long": 0, "truncated": 0}
    for messages in examples:
        ids, mask = encode_example(tokenizer, fmt, messages)
        if len(ids) > seq_len + 1:
            if cfg.overflow == "drop" or not mask[: seq_len + 1][1:].any():
                counts["dropped_too_long"] += 1
                continue
            ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
            counts["truncated"] += 1
        split = (
            "heldout"
            if split_of(json.dumps(messages, sort_keys=True), cfg.heldout_fraction) == "val"
            else "train"
        )
        splits[split].append((ids, mask))
        if split == "heldout":
            heldout_messages.append(messages)
    if not splits["train"] or not splits["heldout"]:
        raise DataError(
            f"SFT source {cfg.source!r}: too few examples for a train and a held-out split ({counts})"
        )
    for split, encoded in splits.items():
        write_rows(out / f"{split}.arrow", [list(e) for e in encoded], ["input_ids", "loss_mask"])
    lines = "".join(json.dumps({"messages": m}) + "\n" for m in heldout_messages)
    atomic_write_bytes(out / "heldout.jsonl", lines.encode())
    return SFTManifest(
        version=SFT_FORMAT_VERSION,
        path=str(out.resolve()),
        tokenizer_digest=tok.digest,
        pad_id=tok.pad_id,
        seq_len=seq_len,
        counts={**counts, **{split: len(encoded) for split, encoded in splits.items()}},
        config=cfg.model_dump(mode="json"),
    )


class SFTLoader(SampledLoader):
    """Padded SFT batches with the same deterministic, rank-sharded, resumable order as the pretraining loader."""

    def __init__(
        self,
        manifest: SFTManifest,
        split: str = "train",
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        accumulation: int = 1,
        tokenizer_digest: str | None = None,
    ) -> None:
        if tokenizer_digest is not None and tokenizer_digest != manifest.tokenizer_digest:
            raise DataError(
                f"SFT data {manifest.path} was made with tokenizer {manifest.tokenizer_digest[:16]}..., the base model "
                f"uses {tokenizer_digest[:16]}...; rebuild the SFT data with the base model's tokenizer"
            )
        batch = read_rows(Path(manifest.path) / f"{split}.arrow")
        self.ids, self.mask = batch.column("input_ids"), batch.column("loss_mask")
        self.seq_len, self.pad_id = manifest.seq_len, manifest.pad_id
        self.sampler = EpochSampler(len(self.ids), batch_size, rank, world_size, seed, shuffle, accumulation)

    def batch_of(self, indices: np.ndarray) -> Batch:
        """Inputs padded with the pad id; targets IGNORE_INDEX where the loss mask is 0 or on padding."""
        rows = [(self.ids[int(i)].values.to_numpy(), self.mask[int(i)].values.to_numpy()) for i in indices]
        return Batch(*padded_rows(rows, self.seq_len, self.pad_id))
