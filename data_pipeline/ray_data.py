"""Tokenization on Ray Data (`data.backend: ray`): the cluster reads and encodes, this process writes the shards.

The corpus's files, in order, become a Ray Data dataset of (source, file) indices; a pool of `num_workers`
actors (one CPU each, anywhere in the cluster) each reads a file (`Corpus.read_file`: decoding, bad-record
handling, object-storage sources) and encodes its documents with the corpus tokenizer; the dataset is consumed
in order (`preserve_order`), so this process sees the documents exactly as the local backend does and the shards
are byte-identical. Memory is bounded by Ray Data's streaming backpressure, a file at a time per actor.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Generator, Iterator

import numpy as np

from data_pipeline.config import DataConfig
from data_pipeline.sources import Corpus, ReadStats
from data_pipeline.tokenizer import corpus_tokenizer, encode_texts
from infra.ray_cluster import ensure_ray


class _ReadAndEncode:
    """A Ray Data actor: the corpus (resolved once) and the tokenizer, reading and encoding one file per row."""

    def __init__(self, cfg: dict[str, object], tokenizer_path: str, eos_id: int, dtype: str) -> None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one CPU per actor; the pool is the parallelism
        self.corpus = Corpus(DataConfig.model_validate(cfg))
        self.tokenizer, self.eos_id, self.dtype = corpus_tokenizer(tokenizer_path), eos_id, dtype

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        payloads = []
        for source, file in zip(batch["source"], batch["file"], strict=True):
            documents, stats = self.corpus.read_file(int(source), int(file))
            arrays = encode_texts(self.tokenizer, [d.text for d in documents], self.eos_id, self.dtype)
            payloads.append(pickle.dumps(([d.doc_id for d in documents], arrays, stats)))
        return {"payload": np.array(payloads, dtype=object)}


def encode_files(
    corpus: Corpus, tokenizer_path: str, eos_id: int, dtype: str, workers: int
) -> Iterator[tuple[list[str], list[np.ndarray], ReadStats]]:
    """(document ids, token arrays, read stats) of each file of `corpus`, in corpus order, encoded on Ray Data
    (the cluster at RAY_ADDRESS, or a private local instance)."""
    import ray

    ensure_ray(workers, log_to_driver=False)
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True
    context.enable_progress_bars = False
    files = corpus.files()
    dataset = ray.data.from_items(
        [{"source": s, "file": f} for s, f in files], override_num_blocks=max(1, min(len(files), 4 * workers))
    ).map_batches(
        _ReadAndEncode,
        fn_constructor_args=(corpus.cfg.model_dump(mode="json"), tokenizer_path, eos_id, dtype),
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=workers),
        num_cpus=1,
    )
    running = set(threading.enumerate())
    rows = iter(dataset.iter_rows())
    try:
        for row in rows:
            yield pickle.loads(row["payload"])
    finally:  # also when the caller stops early (data.max_documents): see `_stop_reading`
        _stop_reading(rows, set(threading.enumerate()) - running)


def _stop_reading(rows: Iterator[dict[str, object]], started: set[threading.Thread]) -> None:
    """Close Ray Data's row iterator and wait for the threads it started to fetch blocks ahead: left running
    after the caller stopped early, one of them called into Ray after the caller had shut Ray down, which ends
    the process ("The core worker has already been shutdown"). Its parked block prefetchers never wake again."""
    if isinstance(rows, Generator):
        rows.close()  # Ray Data's early-stop path: its workers stop after their current block
    for thread in started:
        if thread.name == "iter_threaded":
            thread.join(timeout=60)
