"""Byte-level BPE tokenizer (Hugging Face `tokenizers`), saved so `transformers.AutoTokenizer` loads it.

References: Sennrich et al. 2016 (BPE); Radford et al. 2019 (byte-level BPE, GPT-2 pre-tokenisation).
Special tokens: end-of-text (document separator), padding, and chat role markers used by the chat template.
The tokenizer digest (sha256 of `tokenizer.json`) is recorded in every downstream manifest; data made with one
tokenizer is refused by a model or loader expecting another.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from data_pipeline.config import EOS, PAD, SPECIAL_TOKENS, TokenizerConfig
from data_pipeline.sources import Corpus, DataError
from infra.steps import Artifact, Step, run_step

log = logging.getLogger(__name__)

# Each turn renders as "<|role|>\n{content}<|end|>\n"; `data_pipeline/sft.py` builds loss masks on this layout.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOKENIZER_VERSION = 1  # bump when training or saving changes what the same config produces


@dataclass(frozen=True)
class TokenizerRef:
    """A saved tokenizer: directory (loadable by AutoTokenizer), digest and the ids the pipeline needs."""

    path: str
    digest: str
    vocab_size: int
    eos_id: int
    pad_id: int

    def load(self) -> Tokenizer:
        return Tokenizer.from_file(str(Path(self.path) / "tokenizer.json"))


MAX_PIECE_CHARS = 1 << 20  # longer documents are encoded (and counted for training) piece by piece


def pieces(text: str, limit: int = MAX_PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at most ~`limit` characters, each cut just before a space that follows a
    non-space and precedes a non-space: a boundary of the byte-level pre-tokenizer, so encoding the pieces and
    concatenating gives the ids of the whole (and a 50 MB one-line document needs memory for one piece)."""
    if len(text) <= limit:
        return [text]
    out, start = [], 0
    while len(text) - start > limit:
        cut = start + limit
        while cut > start + limit // 2 and not (
            text[cut] == " " and not text[cut - 1].isspace() and not text[cut + 1 : cut + 2].isspace()
        ):
            cut -= 1
        if cut <= start + limit // 2:
            cut = start + limit  # no word boundary nearby: a hard cut (may split one pre-token)
        out.append(text[start:cut])
        start = cut
    return [*out, text[start:]]


def train_bpe(texts: Iterable[str], cfg: TokenizerConfig) -> Tokenizer:
    """Train byte-level BPE on `texts` (all 256 bytes in the base alphabet, so nothing is ever unknown)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` (with the chat template) and the special-tokens map."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS, PAD)],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out_dir))


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def describe(path: Path) -> TokenizerRef:
    """A TokenizerRef for a directory holding `tokenizer.json` (or the file itself). End-of-text and padding are
    the ones `tokenizer_config.json` names where the directory has one (a Hugging Face model's tokenizer: padding
    falls back to end-of-text, as transformers' users set it), lmforge's `<|endoftext|>` and `<|pad|>` otherwise."""
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(
            f"{path}: no tokenizer.json; give data.tokenizer.path a tokenizer.json or its directory"
        )
    tokenizer = Tokenizer.from_file(str(file))
    named = named_specials(file.parent)
    eos = named.get("eos_token") or EOS
    pad = named.get("pad_token") or (PAD if tokenizer.token_to_id(PAD) is not None or not named else eos)
    missing = [t for t in (eos, pad) if tokenizer.token_to_id(t) is None]
    if missing:
        raise DataError(
            f"{file}: lacks special tokens {missing}; lmforge needs an end-of-text and a padding token in the "
            f"vocabulary ({EOS} and {PAD}, or the ones tokenizer_config.json names)"
        )
    return TokenizerRef(
        path=str(file.parent.resolve()),
        digest=file_digest(file),
        vocab_size=tokenizer.get_vocab_size(),
        eos_id=tokenizer.token_to_id(eos),
        pad_id=tokenizer.token_to_id(pad),
    )


def named_specials(directory: Path) -> dict[str, str]:
    """The end-of-text and padding tokens `tokenizer_config.json` names (plain strings or AddedToken records)."""
    settings = directory / "tokenizer_config.json"
    if not settings.is_file():
        return {}
    config = json.loads(settings.read_text())
    named = {}
    for field in ("eos_token", "pad_token"):
        value = config.get(field)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            named[field] = value
    return named


def _sample(corpus: Corpus, max_bytes: int) -> Iterator[str]:
    """The first documents of the corpus up to `max_bytes` of UTF-8."""
    seen = 0
    for doc in corpus:
        yield from pieces(doc.text)
        seen += len(doc.text.encode())
        if seen >= max_bytes:
            return


class TokenizerManifest(Artifact):
    """A trained tokenizer's directory and its `TokenizerRef` fields."""

    tokenizer: dict[str, Any]


def run_train_tokenizer(
    cfg: TokenizerConfig, corpus: Corpus, fingerprint: str, root: str | Path
) -> TokenizerRef:
    """Stage: train (or reuse) the tokenizer in `<root>/tokenizer/bpe<V>-<hash>/`; an existing path is used as is."""
    if cfg.path is not None:
        return describe(Path(cfg.path))
    config = {"config": cfg.model_dump(mode="json"), "source": fingerprint}
    step = Step("tokenizer", f"bpe{cfg.vocab_size}", TOKENIZER_VERSION, config, TokenizerManifest)
    return TokenizerRef(**run_step(root, step, lambda out, _key: _train(cfg, corpus, out)).tokenizer)


def _train(cfg: TokenizerConfig, corpus: Corpus, out: Path) -> TokenizerManifest:
    log.info("training a %d-token BPE on up to %d bytes of the corpus", cfg.vocab_size, cfg.train_bytes)
    tokenizer = train_bpe(_sample(corpus, cfg.train_bytes), cfg)
    if corpus.stats.documents == 0:
        raise DataError(f"no text to train the tokenizer on ({corpus.stats.as_dict()}); check data.sources")
    save_tokenizer(tokenizer, out)  # overwrites what an interrupted attempt left; the manifest comes last
    return TokenizerManifest(path=str(out.resolve()), tokenizer=asdict(describe(out)))


def corpus_tokenizer(path: str) -> Tokenizer:
    """The tokenizer for raw text: special-token strings inside documents are encoded as plain text."""
    tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    tokenizer.encode_special_tokens = True
    return tokenizer


def encode_texts(tokenizer: Tokenizer, texts: list[str], eos_id: int, dtype: str) -> list[np.ndarray]:
    """Token ids of each text followed by end-of-text (a very long text is encoded piece by piece)."""
    if all(len(text) <= MAX_PIECE_CHARS for text in texts):
        return [np.array([*e.ids, eos_id], dtype=dtype) for e in tokenizer.encode_batch(texts)]
    out = []
    for text in texts:
        ids = [np.array(e.ids, dtype=dtype) for e in tokenizer.encode_batch(pieces(text))]
        out.append(np.concatenate([*ids, np.array([eos_id], dtype=dtype)]))
    return out
