"""Preference pairs for DPO: (prompt, chosen, rejected), rendered in the tokenizer's chat format, loss on the
response.

Sources: `derived`, made offline from the SFT conversations (chosen = the reference answer; rejected = another
question's answer, `other_answer`, or the reference corrupted: `shuffled`, `swapped`, `garbled`; all drawn from
the seed, one mode or several in turn), or
a JSONL / Parquet file of `{"prompt", "chosen", "rejected"}` records, the prompt a string (one user turn) or a
list of chat turns that ends before the answer.

Each side is one row in the tokenizer's chat format (`data_pipeline/chat.py`: its template, or lmforge's layout):
the prompt's turns, the assistant's header, the response and its end-of-turn marker, with the loss mask on the
response and marker only (earlier assistant turns carry none). Pairs whose sides are equal or empty are dropped
and counted; a side longer than the sequence length has its response cut (counted), and a pair whose prompt
alone fills the context is dropped (counted). Stored like the SFT examples: Arrow per split, the held-out pairs as
JSONL, a manifest with the tokenizer digest.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from tokenizers import Tokenizer
from torch import Tensor

from data_pipeline.chat import ChatFormat, Messages, chat_format
from data_pipeline.config import ROLES, SPECIAL_TOKENS, PreferenceConfig
from data_pipeline.loader import IGNORE_INDEX, EpochSampler, SampledLoader
from data_pipeline.sft import padded_rows, read_rows, write_rows
from data_pipeline.sources import DataError, split_of
from data_pipeline.tokenizer import TokenizerRef
from infra.steps import Artifact, Step, run_step
from infra.storage import MANIFEST, atomic_write_bytes, digest_of

log = logging.getLogger(__name__)
PREFERENCE_FORMAT_VERSION = 2  # 2: after_turn_ids, for the reward model's reading position
SIDES = ("chosen", "rejected")


class Pair(NamedTuple):
    prompt: Messages  # the turns before the answer
    chosen: str
    rejected: str

    def as_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "chosen": self.chosen, "rejected": self.rejected}


class PairBatch(NamedTuple):
    """B pairs as 2B rows (chosen rows first, then rejected, as TRL concatenates them) plus the reference
    model's log-probabilities of each side, (B, 2), when known."""

    inputs: Tensor  # (2B, T)
    targets: Tensor  # (2B, T), IGNORE_INDEX off the responses
    reference: Tensor | None = None

    def n_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    @property
    def n_pairs(self) -> int:
        return self.inputs.shape[0] // 2


# ---- sources ----------------------------------------------------------------------------------------------


def derive_pairs(conversations: list[Messages], how: str | list[str], seed: int) -> list[Pair]:
    """Pairs from SFT conversations: chosen = the final answer; rejected = the answer of the conversation a fixed
    random offset away (`other_answer`), the answer's words in a seeded random order (`shuffled`), the answer
    with two of its words swapped (`swapped`) or with a third of its characters replaced by byte noise
    (`garbled`). A list of modes: pair i takes mode i modulo its length."""
    rng = np.random.default_rng(seed)
    modes = [how] if isinstance(how, str) else how
    answers = [c[-1]["content"] for c in conversations]
    offset = int(rng.integers(1, len(answers))) if len(answers) > 1 else 0
    pairs = []
    for i, conversation in enumerate(conversations):
        mode, words = modes[i % len(modes)], answers[i].split()
        if mode == "other_answer":
            rejected = answers[(i + offset) % len(answers)]
        elif mode == "shuffled":
            rejected = " ".join(words[j] for j in rng.permutation(len(words)))
        elif mode == "garbled":
            rejected = garbled(answers[i], rng)
        else:  # swapped: two words trade places, a subtler corruption
            a, b = rng.choice(len(words), size=2, replace=False) if len(words) > 1 else (0, 0)
            words[a], words[b] = words[b], words[a]
            rejected = " ".join(words)
        pairs.append(Pair(conversation[:-1], answers[i], rejected))
    return pairs


# what a policy that drifted off text samples from a byte-level vocabulary, as characters: control bytes, and code
# points of two, three and four UTF-8 bytes (their lead and continuation bytes are the byte tokens such a policy
# strings together; the demo's RL samples decode to U+FFFD, control characters and stray letters)
NOISE_RANGES = {
    1: [(0x00, 0x09), (0x0B, 0x0D), (0x0E, 0x20), (0x7F, 0x80)],
    2: [(0x80, 0x800)],
    3: [(0x800, 0xD800), (0xE000, 0x10000)],
    4: [(0x10000, 0x110000)],
}


def is_noise(character: str) -> bool:
    code = ord(character)
    return any(lo <= code < hi for ranges in NOISE_RANGES.values() for lo, hi in ranges)


def garbled(text: str, rng: np.random.Generator, share: float = 1 / 3) -> str:
    """`text` with a random stretch of a third of its characters (at least one) replaced by byte noise: each
    character of one to four UTF-8 bytes, equally likely."""
    if not text:
        return text
    length = max(1, round(share * len(text)))
    start = int(rng.integers(0, len(text) - length + 1))
    noise = []
    for width in rng.integers(1, 5, size=length):
        ranges = NOISE_RANGES[int(width)]
        lo, hi = ranges[int(rng.integers(len(ranges)))]
        noise.append(chr(int(rng.integers(lo, hi))))
    return text[:start] + "".join(noise) + text[start + length :]


def _pair(record: Any, where: str) -> Pair:
    """A `{"prompt", "chosen", "rejected"}` record, checked."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a record {{'prompt': ..., 'chosen': ..., 'rejected': ...}}")
    if missing := [k for k in ("prompt", *SIDES) if k not in record]:
        raise DataError(
            f"{where}: no {', '.join(repr(k) for k in missing)} field (it has {', '.join(map(repr, record)) or 'none'}); "
            "each record needs 'prompt', 'chosen' and 'rejected'"
        )
    prompt = record["prompt"]
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(turns, list) or not turns:
        raise DataError(
            f"{where}: 'prompt' must be a string or a non-empty list of {{'role', 'content'}} turns"
        )
    texts = [*(t.get("content") if isinstance(t, dict) else None for t in turns), *(record[s] for s in SIDES)]
    if not all(isinstance(t, str) for t in texts):
        raise DataError(f"{where}: the prompt's contents, 'chosen' and 'rejected' must be strings")
    if any(t.get("role") not in ROLES for t in turns):
        raise DataError(f"{where}: unknown role in the prompt; roles are {', '.join(ROLES)}")
    if reserved := [m for m in SPECIAL_TOKENS for text in texts if m in text]:
        raise DataError(f"{where}: the text contains the reserved marker {reserved[0]}; remove it")
    return Pair(
        [{"role": t["role"], "content": t["content"]} for t in turns], record["chosen"], record["rejected"]
    )


def read_pairs(path: Path) -> list[Pair]:
    """User-supplied pairs from JSONL (one record per line) or Parquet (columns prompt, chosen, rejected)."""
    if not path.is_file():
        raise DataError(
            f"data.preference.source: {path} does not exist; give a JSONL or Parquet file or 'derived'"
        )
    if path.suffix == ".parquet":
        try:
            rows = pq.read_table(path).to_pylist()
        except (pa.ArrowInvalid, OSError) as error:
            raise DataError(f"{path}: not a readable Parquet file ({error})") from None
        records = [(row, f"{path} row {i}") for i, row in enumerate(rows)]
    else:
        records = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                try:
                    records.append((json.loads(line), f"{path}:{lineno}"))
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({error.msg})") from None
    if not records:
        raise DataError(f"{path}: no preference pairs")
    return [_pair(record, where) for record, where in records]


# ---- encoding ---------------------------------------------------------------------------------------------


def encode_side(
    tokenizer: Tokenizer, fmt: ChatFormat, prompt: Messages, response: str
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of the prompt turns plus the response turn, and a 0/1 mask on the response and its marker."""
    text, spans = fmt.render([*prompt, {"role": "assistant", "content": response}])
    start, end = spans[-1]
    encoding = tokenizer.encode(text[:end], add_special_tokens=False)
    starts = np.array([s for s, _ in encoding.offsets], dtype=np.int64)
    return np.array(encoding.ids, dtype=np.int32), (starts >= start).astype(np.uint8)


def fit_to_context(ids: np.ndarray, mask: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The side cut to `seq_len + 1` tokens (inputs and shifted targets), or None when no response token fits."""
    ids, mask = ids[: seq_len + 1], mask[: seq_len + 1]
    return (ids, mask) if mask[1:].any() else None


class PreferenceManifest(Artifact):
    """Encoded preference pairs (train and held-out Arrow files plus the held-out pairs as JSONL)."""

    version: int
    tokenizer_digest: str
    pad_id: int
    seq_len: int
    # what the chat format writes after an answer's end-of-turn token when the conversation ends there: a whole
    # side, as the reward model scores it, is its tokens and these (the rendered conversation's end)
    after_turn_ids: list[int]
    counts: dict[
        str, int
    ]  # pairs per split, plus dropped_identical / dropped_empty / dropped_too_long / truncated
    config: dict[str, Any]

    @classmethod
    def load(cls, directory: str | Path) -> PreferenceManifest:
        if not (Path(directory) / MANIFEST).is_file():
            raise DataError(f"{directory}: no {MANIFEST}; run `lmforge dpo` to build the preference pairs")
        return cls.from_file(Path(directory) / MANIFEST)


def run_preference_data(
    cfg: PreferenceConfig, pairs: list[Pair], tok: TokenizerRef, seq_len: int, root: str | Path
) -> PreferenceManifest:
    """Stage: encode `pairs` into `<root>/preference_data/pairs-<hash>/{train,heldout}.arrow` (+ heldout.jsonl)."""
    config = {
        "config": cfg.model_dump(mode="json", exclude={"source"}),
        "pairs": digest_of([p.as_json() for p in pairs]),
        "tokenizer": tok.digest,
        "seq_len": seq_len,
        **chat_format(tok).key,
    }
    step = Step("preference_data", "pairs", PREFERENCE_FORMAT_VERSION, config, PreferenceManifest)
    return run_step(root, step, lambda out, _key: _encode_pairs(cfg, pairs, tok, seq_len, out))


def _encode_pairs(
    cfg: PreferenceConfig, pairs: list[Pair], tok: TokenizerRef, seq_len: int, out: Path
) -> PreferenceManifest:
    tokenizer, fmt = tok.load(), chat_format(tok)
    counts = dict.fromkeys(("dropped_identical", "dropped_empty", "dropped_too_long", "truncated"), 0)
    splits: dict[str, list[list[np.ndarray]]] = {"train": [], "heldout": []}
    heldout: list[Pair] = []
    for pair in pairs:
        if not pair.chosen.strip() or not pair.rejected.strip():
            counts["dropped_empty"] += 1
            continue
        if pair.chosen.strip() == pair.rejected.strip():
            counts["dropped_identical"] += 1
            continue
        sides = [
            encode_side(tokenizer, fmt, pair.prompt, response) for response in (pair.chosen, pair.rejected)
        ]
        fitted = [fit_to_context(ids, mask, seq_len) for ids, mask in sides]
        if None in fitted:
            counts["dropped_too_long"] += 1
            continue
        counts["truncated"] += any(len(ids) > seq_len + 1 for ids, _ in sides)
        split = (
            "heldout"
            if split_of(json.dumps(pair.as_json(), sort_keys=True), cfg.heldout_fraction) == "val"
            else "train"
        )
        splits[split].append([array for side in fitted for array in side])
        if split == "heldout":
            heldout.append(pair)
    dropped = {k: v for k, v in counts.items() if v}
    if dropped:
        log.warning("preference pairs: %s", ", ".join(f"{k} {v}" for k, v in dropped.items()))
    if not splits["train"] or not splits["heldout"]:
        raise DataError(
            f"preference source {cfg.source!r}: too few usable pairs for a train and a held-out split "
            f"({len(pairs)} read, {counts}); add pairs, or change data.preference.heldout_fraction so both splits "
            "get some"
        )
    for split, rows in splits.items():
        names = ["chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask"]
        write_rows(out / f"{split}.arrow", rows, names)
    atomic_write_bytes(
        out / "heldout.jsonl", "".join(json.dumps(p.as_json()) + "\n" for p in heldout).encode()
    )
    return PreferenceManifest(
        version=PREFERENCE_FORMAT_VERSION,
        path=str(out.resolve()),
        tokenizer_digest=tok.digest,
        pad_id=tok.pad_id,
        seq_len=seq_len,
        after_turn_ids=tokenizer.encode(fmt.after_turn, add_special_tokens=False).ids,
        counts={**counts, **{split: len(rows) for split, rows in splits.items()}},
        config=cfg.model_dump(mode="json"),
    )


def read_heldout_pairs(path: str | Path, limit: int | None = None) -> list[Pair]:
    lines = Path(path).read_text().splitlines()[:limit]
    return [Pair(**json.loads(line)) for line in lines if line]


# ---- loading ----------------------------------------------------------------------------------------------


class PreferenceLoader(SampledLoader):
    """Padded pair batches in the same deterministic, rank-sharded, resumable order as the other loaders;
    `reference` ((pairs, 2) log-probabilities, row-aligned with the split) rides along when given. `whole`: each
    side as the reward model scores it (`whole_rows`) instead of next-token inputs and targets."""

    def __init__(
        self,
        manifest: PreferenceManifest,
        split: str = "train",
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        accumulation: int = 1,
        reference: np.ndarray | None = None,
        whole: bool = False,
    ) -> None:
        table = read_rows(Path(manifest.path) / f"{split}.arrow")
        self.columns = {name: table.column(name) for name in table.schema.names}
        self.seq_len, self.pad_id = manifest.seq_len, manifest.pad_id
        self.after_turn = np.array(manifest.after_turn_ids, dtype=np.int64) if whole else None
        if reference is not None and len(reference) != len(table):
            raise DataError(
                f"{manifest.path}: {len(reference)} reference log-probabilities for {len(table)} {split} pairs; "
                "recompute the reference log-probabilities for this data"
            )
        self.reference = reference
        self.sampler = EpochSampler(len(table), batch_size, rank, world_size, seed, shuffle, accumulation)

    def __len__(self) -> int:
        return self.sampler.n_items

    def _row(self, side: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        """One side's stored (ids, loss mask)."""
        return (
            self.columns[f"{side}_ids"][index].values.to_numpy(),
            self.columns[f"{side}_mask"][index].values.to_numpy(),
        )

    def batch_of(self, indices: np.ndarray) -> PairBatch:
        rows = [
            self._row(side, int(i)) for side in SIDES for i in indices
        ]  # every chosen row, then every rejected
        reference = None if self.reference is None else torch.from_numpy(self.reference[indices])
        if self.after_turn is not None:
            return PairBatch(
                *whole_rows([ids for ids, _ in rows], self.after_turn, self.seq_len, self.pad_id), reference
            )
        return PairBatch(*padded_rows(rows, self.seq_len, self.pad_id), reference)


def whole_rows(
    sides: list[np.ndarray], after_turn: np.ndarray, width: int, pad_id: int
) -> tuple[Tensor, Tensor]:
    """Sides as the reward model scores them, (len(sides), width) right-padded with `pad_id`: each side's tokens
    (which end with the answer's end-of-turn token unless the answer was cut) and then `after_turn`, the end of the
    rendered conversation, at most `width` tokens; no targets (all IGNORE_INDEX)."""
    inputs = torch.full((len(sides), width), pad_id, dtype=torch.int64)
    for row, ids in enumerate(sides):
        tokens = torch.from_numpy(np.concatenate([ids.astype(np.int64), after_turn])[:width])
        inputs[row, : len(tokens)] = tokens
    return inputs, torch.full_like(inputs, IGNORE_INDEX)


def preference_loaders(
    manifest: PreferenceManifest,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    accumulation: int,
    reference: Callable[[str], np.ndarray] | None = None,
    whole: bool = False,
) -> tuple[PreferenceLoader, PreferenceLoader]:
    """A training stage's pairs: the training split shuffled (epochs of whole optimiser steps) and the held-out
    split in order — one smaller than a batch per rank is still scored, in smaller batches. `reference(split)`:
    that split's reference log-probabilities (DPO); `whole`: sides as the reward model scores them."""
    common = {"rank": rank, "world_size": world_size, "whole": whole}
    train = PreferenceLoader(
        manifest,
        "train",
        batch_size=batch_size,
        seed=seed,
        accumulation=accumulation,
        reference=reference("train") if reference else None,
        **common,
    )
    heldout_batch = max(1, min(batch_size, manifest.counts["heldout"] // world_size))
    heldout = PreferenceLoader(
        manifest,
        "heldout",
        batch_size=heldout_batch,
        shuffle=False,
        reference=reference("heldout") if reference else None,
        **common,
    )
    return train, heldout
