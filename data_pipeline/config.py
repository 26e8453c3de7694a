"""Configuration of stage 1: where documents come from, the tokenizer, and how shards are written."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt


class DataConfig(BaseModel):
    """Sources (file globs, or the built-in `stdlib` corpus), tokenizer training and shard layout."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sources: tuple[str, ...] = ("stdlib",)
    vocab_size: PositiveInt = 8192
    min_frequency: PositiveInt = 2
    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    shard_tokens: PositiveInt = 1_000_000
    num_workers: PositiveInt = 2
    seed: int = 0
