"""Configuration of stage 1: where documents come from, the tokenizer, shard layout and SFT examples."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class TokenizerConfig(BaseModel):
    """Train a byte-level BPE on the corpus (or a sample of it), or load an existing `tokenizer.json`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: PositiveInt = 8192
    min_frequency: PositiveInt = 2
    train_bytes: PositiveInt = 20_000_000  # train on the first documents up to this many bytes
    path: str | None = None  # an existing tokenizer.json (or a directory holding one) instead of training


class SFTConfig(BaseModel):
    """Supervised fine-tuning examples: a JSONL file, or `builtin` (questions about the stdlib corpus)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = "builtin"
    max_examples: PositiveInt | None = 2000
    heldout_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    overflow: Literal["truncate", "drop"] = "drop"  # examples longer than the sequence length


class DataConfig(BaseModel):
    """Sources, tokenizer and shard layout of the pretraining corpus.

    `sources` entries are file globs (`.txt`, `.md`, `.jsonl`, `.parquet`, each optionally `.gz`), `stdlib`
    (the installed Python standard library, present on every machine), or `hf:<dataset>[:<split>]` for users
    with the `datasets` package and the data cached locally.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sources: tuple[str, ...] = ("stdlib",)
    text_field: str = "text"  # JSONL key or parquet column holding the text
    max_documents: PositiveInt | None = None  # first N documents in source order (quick runs)
    on_bad_record: Literal["error", "skip"] = "error"  # a JSONL line that is not JSON or lacks text_field
    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    tokenizer: TokenizerConfig = TokenizerConfig()
    shard_tokens: PositiveInt = 1_000_000
    num_workers: PositiveInt = 2
    backend: Literal["processes", "ray"] = "processes"
    sft: SFTConfig = SFTConfig()
