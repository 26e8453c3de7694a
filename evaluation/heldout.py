"""Held-out text metrics: loss, perplexity and bits per byte on the validation split, overall and per source.

Documents are read from the corpus (the same deterministic train/val split as tokenization) and tokenized with
each model's own tokenizer, so bits per byte compare models with different tokenizers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from data_pipeline.config import DataConfig
from data_pipeline.sources import Corpus, split_of
from evaluation.model_io import EvalModel
from evaluation.scoring import rolling_windows, score_continuations


@dataclass(frozen=True)
class HeldoutDoc:
    source: str
    text: str


def source_name(spec: str) -> str:
    """A short, metric-safe name for a data.sources entry: `stdlib`, `hf:x`, or a glob's last component."""
    name = spec if spec.startswith("hf:") or "/" not in spec else Path(spec).name
    return name.replace("/", "_").replace("*", "x")


def heldout_documents(cfg: DataConfig, max_documents: int) -> list[HeldoutDoc]:
    """The first `max_documents` validation documents of the corpus, in corpus order."""
    docs = []
    for doc in Corpus(cfg):
        if split_of(doc.doc_id, cfg.val_fraction) == "val":
            docs.append(HeldoutDoc(source_name(doc.source), doc.text))
            if len(docs) >= max_documents:
                break
    if not docs:
        raise ValueError(
            f"no held-out documents in data.sources {cfg.sources} (val_fraction={cfg.val_fraction}); "
            "raise data.val_fraction or add documents"
        )
    return docs


def heldout_metrics(em: EvalModel, docs: list[HeldoutDoc], batch_size: int) -> dict[str, dict[str, float]]:
    """{"all": {...}, "<source>": {...}} with loss (nats/token), perplexity, bits_per_byte, tokens, bytes."""
    window = em.max_len
    eos = em.tokenizer_ref.eos_id
    requests, owner = [], []
    for index, doc in enumerate(docs):
        for request in rolling_windows(em.tokenizer.encode(doc.text).ids, eos, window):
            requests.append(request)
            owner.append(index)
    scored = score_continuations(em.model, requests, batch_size)
    totals: dict[str, list[float]] = {}
    for index, s in zip(owner, scored, strict=True):
        for key in ("all", docs[index].source):
            t = totals.setdefault(key, [0.0, 0.0, 0.0])
            t[0] -= s.logprob
            t[1] += s.n_tokens
    for doc in docs:
        for key in ("all", doc.source):
            totals[key][2] += len(doc.text.encode("utf-8"))
    return {
        key: {
            "loss": nats / tokens,
            "perplexity": math.exp(nats / tokens),
            "bits_per_byte": nats / math.log(2) / n_bytes,
            "tokens": tokens,
            "bytes": n_bytes,
        }
        for key, (nats, tokens, n_bytes) in totals.items()
    }
