"""Configuration of stage 1: where documents come from, the tokenizer, shard layout and SFT examples."""

from __future__ import annotations

import codecs
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, field_validator, model_validator

EOS = "<|endoftext|>"
PAD = "<|pad|>"
ROLES = ("system", "user", "assistant")
END_OF_TURN = "<|end|>"
SPECIAL_TOKENS = [EOS, PAD, *(f"<|{role}|>" for role in ROLES), END_OF_TURN]
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # byte-level BPE: every byte, then the special tokens


class TokenizerConfig(BaseModel):
    """Train a byte-level BPE on the corpus (or a sample of it), or load an existing `tokenizer.json`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vocab_size: PositiveInt = 8192
    min_frequency: PositiveInt = 2
    train_bytes: PositiveInt = 20_000_000  # train on the first documents up to this many bytes
    path: str | None = None  # an existing tokenizer.json (or a directory holding one) instead of training

    @model_validator(mode="after")
    def _room_for_bytes(self) -> TokenizerConfig:
        if self.path is None and self.vocab_size < MIN_VOCAB:
            raise ValueError(
                f"vocab_size={self.vocab_size} cannot hold the 256 bytes and {len(SPECIAL_TOKENS)} special tokens "
                f"of a byte-level BPE; use at least {MIN_VOCAB} (a few thousand for real text)"
            )
        return self


class SFTDataConfig(BaseModel):
    """Supervised fine-tuning examples: a JSONL file, or `builtin` (questions about the stdlib corpus)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = "builtin"
    max_examples: PositiveInt | None = 2000
    heldout_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    overflow: Literal["truncate", "drop"] = "drop"  # examples longer than the sequence length


RejectedMode = Literal["other_answer", "shuffled", "swapped", "garbled"]


class PreferenceConfig(BaseModel):
    """Preference pairs for DPO and the reward model: derived from the SFT examples (chosen = the reference answer,
    rejected = another question's answer or the reference corrupted), or a JSONL/Parquet file of `{"prompt", "chosen",
    "rejected"}` records (`prompt` a string or a list of chat turns)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = "derived"
    # how derived pairs get their rejected side (a list: the pairs take the modes in turn); `shuffled` (the
    # answer's words in another order) teaches even a small model something that carries over to held-out
    # questions, another question's answer mostly does not; `garbled` (a third of the answer's characters
    # replaced by byte noise) teaches a reward model that text beats the bytes a drifting policy samples
    rejected: RejectedMode | Annotated[list[RejectedMode], Field(min_length=1)] = "shuffled"
    max_pairs: PositiveInt | None = 2000
    heldout_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    seed: int = 0


class PromptsConfig(BaseModel):
    """Prompts for reinforcement learning: the SFT conversations' prompts (`sft`), the built-in toy task `digits`
    (requests for numbers, for a verifiable reward that a tiny model can learn), or a JSONL file of
    `{"prompt", "tests"}` records (`prompt` a string or a list of chat turns; `tests`, optional, Python code that
    a completion must pass, for the `unit_tests` reward)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source: str = "sft"
    max_prompts: PositiveInt | None = 2000
    heldout_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)


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
    # a JSONL line that is not JSON or lacks text_field, a text file that looks binary: refuse, or skip and count
    on_bad_record: Literal["error", "skip"] = "error"
    encoding: str = "utf-8"  # of text and JSONL files (a leading byte-order mark is dropped)
    val_fraction: float = Field(default=0.05, ge=0.0, lt=1.0)
    tokenizer: TokenizerConfig = TokenizerConfig()
    shard_tokens: PositiveInt = 1_000_000
    num_workers: PositiveInt = 2
    backend: Literal["processes", "ray"] = "processes"
    sft: SFTDataConfig = SFTDataConfig()
    preference: PreferenceConfig = PreferenceConfig()
    prompts: PromptsConfig = PromptsConfig()

    @field_validator("encoding")
    @classmethod
    def _known_codec(cls, value: str) -> str:
        try:
            return codecs.lookup(value).name
        except LookupError:
            raise ValueError(
                f"unknown encoding {value!r}; use a Python codec name such as utf-8 or latin-1"
            ) from None
