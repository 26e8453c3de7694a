"""Stage 1: documents -> trained tokenizer -> Arrow token shards with a manifest.

Documents are cut into chunks in corpus order and encoded by N worker processes through a bounded window of
chunks in flight (or, with `data.backend: ray`, read and encoded file by file on Ray Data: `ray_data.py`), then
written in order by this process. Each document is encoded on its
own, so the shards are byte-identical for any number of workers, and memory stays bounded by the window and
one shard per split. The output directory is named by the stage config, the source fingerprint and the
tokenizer digest; an interrupted run keeps its complete shards and resumes after the last one.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from data_pipeline.config import DataConfig
from data_pipeline.shards import (
    SPLITS,
    DatasetManifest,
    ShardWriter,
    SplitInfo,
    TokenizerInfo,
    completed_shards,
    token_dtype,
)
from data_pipeline.sources import Corpus, DataError, ReadStats, split_of
from data_pipeline.tokenizer import TokenizerRef, corpus_tokenizer, encode_texts, run_train_tokenizer
from infra.steps import Step, run_step
from infra.storage import remove_partial_files

log = logging.getLogger(__name__)

SHARD_FORMAT_VERSION = 1
# A unit of parallel work ends after CHUNK_DOCS documents or CHUNK_CHARS characters, whichever comes first,
# which bounds memory per chunk. Output never depends on chunking: documents are encoded independently and
# written in corpus order.
CHUNK_DOCS = 256
CHUNK_CHARS = 1 << 18
Progress = Callable[[int, int], None]  # (documents done, tokens done)


@dataclass(frozen=True)
class Chunk:
    indices: list[int]  # positions in the corpus stream
    splits: list[str]
    texts: list[str]


_worker: tuple[Tokenizer, int, str] | None = None


def _init_worker(tokenizer_path: str, eos_id: int, dtype: str) -> None:
    global _worker
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker; the pool is the parallelism
    _worker = (corpus_tokenizer(tokenizer_path), eos_id, dtype)


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    assert _worker is not None, "worker not initialised"
    tokenizer, eos_id, dtype = _worker
    return encode_texts(tokenizer, texts, eos_id, dtype)


def encode_chunks(
    chunks: Iterator[Chunk], tok: TokenizerRef, dtype: str, workers: int
) -> Iterator[tuple[Chunk, list[np.ndarray]]]:
    """Encode chunks in worker processes and yield them in input order, with at most 2 x workers in flight."""
    window = 2 * workers
    if workers == 1:
        tokenizer = corpus_tokenizer(tok.path)
        for chunk in chunks:
            yield chunk, encode_texts(tokenizer, chunk.texts, tok.eos_id, dtype)
        return
    context = get_context("spawn")  # no fork of a parent that may hold threads (torch, tokenizers)
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(tok.path, tok.eos_id, dtype)
    ) as pool:
        pending: deque = deque()
        for chunk in chunks:
            pending.append((chunk, pool.submit(_encode_in_worker, chunk.texts)))
            if len(pending) >= window:
                done, future = pending.popleft()
                yield done, future.result()
        while pending:
            done, future = pending.popleft()
            yield done, future.result()


def chunk_corpus(corpus: Corpus, val_fraction: float, resume_from: dict[str, int]) -> Iterator[Chunk]:
    """The corpus in fixed pieces, leaving out documents already in complete shards of their split."""
    indices: list[int] = []
    splits: list[str] = []
    texts: list[str] = []
    chars = 0
    for index, doc in enumerate(corpus):
        split = split_of(doc.doc_id, val_fraction)
        if index >= resume_from[split]:
            indices.append(index)
            splits.append(split)
            texts.append(doc.text)
        chars += len(doc.text)
        if len(indices) == CHUNK_DOCS or chars >= CHUNK_CHARS:
            if indices:
                yield Chunk(indices, splits, texts)
            indices, splits, texts, chars = [], [], [], 0
    if indices:
        yield Chunk(indices, splits, texts)


def dataset_key(cfg: DataConfig, fingerprint: str, tokenizer_digest: str) -> dict[str, object]:
    """What determines the shards' bytes: not the worker count or backend, which cannot change them, nor where
    the sources live (the fingerprint covers their content and relative names)."""
    fields = {"text_field", "max_documents", "on_bad_record", "val_fraction", "shard_tokens"}
    return {
        "config": cfg.model_dump(mode="json", include=fields),
        "source": fingerprint,
        "tokenizer": tokenizer_digest,
    }


def run_tokenize(cfg: DataConfig, root: str | Path, progress: Progress | None = None) -> DatasetManifest:
    """Stage 1 as a plain function: tokenizer, then shards in `<root>/tokenize/tokens-<hash>/`; idempotent."""
    corpus = Corpus(cfg)
    fingerprint = corpus.fingerprint()
    tok = run_train_tokenizer(cfg.tokenizer, corpus, fingerprint, root)
    config = dataset_key(cfg, fingerprint, tok.digest)
    step = Step("tokenize", "tokens", SHARD_FORMAT_VERSION, config, DatasetManifest)
    return run_step(root, step, lambda out, _key: _write_shards(cfg, corpus, fingerprint, tok, out, progress))


def _encoded(
    cfg: DataConfig, corpus: Corpus, tok: TokenizerRef, dtype: str, resume_from: dict[str, int]
) -> Iterator[list[tuple[int, str, np.ndarray]]]:
    """(corpus position, split, tokens) of every document not already in complete shards, in corpus order, a
    chunk encoded by local processes or a file read and encoded on Ray Data (`data.backend: ray`) at a time."""
    if cfg.backend == "processes":
        chunks = chunk_corpus(corpus, cfg.val_fraction, resume_from)
        for chunk, arrays in encode_chunks(chunks, tok, dtype, cfg.num_workers):
            yield list(zip(chunk.indices, chunk.splits, arrays, strict=True))
        return
    from data_pipeline.ray_data import encode_files  # deferred: Ray loads only for data.backend=ray

    corpus.stats = ReadStats()
    index = 0
    for doc_ids, arrays, stats in encode_files(corpus, tok.path, tok.eos_id, dtype, cfg.num_workers):
        corpus.stats.add(stats)
        group = []
        for doc_id, array in zip(doc_ids, arrays, strict=True):
            if cfg.max_documents is not None and index >= cfg.max_documents:
                break
            split = split_of(doc_id, cfg.val_fraction)
            if index >= resume_from[split]:
                group.append((index, split, array))
            index += 1
        corpus.stats.documents = index
        yield group
        if cfg.max_documents is not None and index >= cfg.max_documents:
            return


def _write_shards(
    cfg: DataConfig, corpus: Corpus, fingerprint: str, tok: TokenizerRef, out: Path, progress: Progress | None
) -> DatasetManifest:
    """Encode the corpus into `out`, resuming after the last complete shard of each split."""
    remove_partial_files(out)
    dtype = token_dtype(tok.vocab_size)
    writers = {s: ShardWriter(out, s, dtype, cfg.shard_tokens, completed_shards(out, s)) for s in SPLITS}
    resume_from = {s: (w.shards[-1].end_doc if w.shards else 0) for s, w in writers.items()}
    if any(resume_from.values()):
        log.info("tokenize: resuming %s after documents %s", out, resume_from)
    docs = tokens = 0
    for group in _encoded(cfg, corpus, tok, dtype, resume_from):
        for index, split, array in group:
            writers[split].add(index, array)
        docs += len(group)
        tokens += sum(len(array) for _, _, array in group)
        if progress is not None:
            progress(docs, tokens)
    for writer in writers.values():
        writer.flush()
    if not any(w.shards for w in writers.values()):
        raise DataError(
            f"data.sources {list(cfg.sources)} hold no text ({corpus.stats.as_dict()}); check the files"
        )
    if cfg.val_fraction > 0 and not writers["val"].shards:
        log.warning(
            "tokenize: the validation split is empty (%d document(s), val_fraction=%g): runs on this data get no "
            "validation loss; add documents (long ones are not split across the splits) or raise data.val_fraction",
            corpus.stats.documents,
            cfg.val_fraction,
        )
    return DatasetManifest(
        version=SHARD_FORMAT_VERSION,
        path=str(out.resolve()),
        tokenizer=TokenizerInfo(**tok.__dict__),
        source_fingerprint=fingerprint,
        dtype=dtype,
        splits={
            s: SplitInfo(
                n_tokens=sum(i.n_tokens for i in w.shards),
                n_docs=sum(i.n_docs for i in w.shards),
                shards=w.shards,
            )
            for s, w in writers.items()
        },
        read_stats=corpus.stats.as_dict(),
        config=cfg.model_dump(mode="json"),
    )
