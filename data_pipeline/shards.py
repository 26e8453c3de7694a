"""Arrow IPC token shards: the on-disk format, its manifest, a crash-safe writer and a zero-copy reader.

A shard is one Arrow IPC file with one record batch and one column, `tokens: list<uint16|uint32>`, a row per
document, each ending with the end-of-text id. The flat values buffer of that column is therefore the packed
token stream, memory-mapped without a copy, and the list offsets keep document boundaries.
Each shard is written to a temporary name, flushed and renamed, then described by a sidecar JSON (written the
same way) holding its sha256 and the documents it covers; a shard without a valid sidecar is not complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from data_pipeline.sources import DataError
from infra import blob_cache
from infra.object_store import open_store
from infra.steps import Artifact
from infra.storage import (
    MANIFEST,
    TMP_SUFFIX,
    atomic_write_json,
    damaged_file,
    digest_of,
    fsync_and_replace,
    sha256_file,
)

Split = Literal["train", "val"]
SPLITS: tuple[Split, ...] = ("train", "val")


class ShardInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    file: str
    n_tokens: int
    n_docs: int
    sha256: str
    bytes: int
    first_doc: int  # index of the first document in the corpus stream
    end_doc: int  # one past the last document of this split in the shard


class SplitInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    n_tokens: int
    n_docs: int
    shards: list[ShardInfo]


class TokenizerInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: str
    digest: str
    vocab_size: int
    eos_id: int
    pad_id: int


class DatasetManifest(Artifact):
    """What `run_tokenize` produced; written last, so its presence means every shard is complete."""

    lazy_files: ClassVar[tuple[str, ...]] = ("*.arrow",)  # on object storage, read through the shard cache

    version: int
    tokenizer: TokenizerInfo
    source_fingerprint: str
    dtype: Literal["uint16", "uint32"]
    splits: dict[str, SplitInfo]
    read_stats: dict[str, object]
    config: dict[str, object]

    @classmethod
    def load(cls, directory: str | Path) -> DatasetManifest:
        directory = Path(directory)
        path = directory / MANIFEST
        if not path.is_file():
            partial = any(directory.glob("*.arrow")) if directory.is_dir() else False
            hint = "an interrupted run: rerun `lmforge tokenize` to resume it" if partial else "not a dataset"
            raise DataError(f"{directory}: no {MANIFEST} ({hint})")
        return cls.from_file(path)

    def digest(self) -> str:
        """The data itself: the tokenizer and every shard's sha256 (not where they live)."""
        shards = {split: [s.sha256 for s in info.shards] for split, info in self.splits.items()}
        return digest_of({"tokenizer": self.tokenizer.digest, "shards": shards})

    def check_tokenizer(self, expected_digest: str) -> None:
        """Refuse data made with another tokenizer, showing both digests."""
        if self.tokenizer.digest != expected_digest:
            raise DataError(
                f"{self.path} was tokenized with tokenizer {self.tokenizer.digest[:16]}..., "
                f"but this run expects tokenizer {expected_digest[:16]}...; re-tokenize the data with the model's "
                "tokenizer (data.tokenizer.path) or use the matching model"
            )


def token_dtype(vocab_size: int) -> Literal["uint16", "uint32"]:
    return "uint16" if vocab_size <= 2**16 else "uint32"


def sidecar_path(shard: Path) -> Path:
    return shard.with_suffix(".json")


class ShardWriter:
    """Accumulates whole documents of one split and cuts a shard once it holds `shard_tokens` tokens."""

    def __init__(
        self, directory: Path, split: Split, dtype: str, shard_tokens: int, done: list[ShardInfo]
    ) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.shards = list(done)
        self._docs: list[np.ndarray] = []
        self._first_doc = -1
        self._last_doc = -1
        self._tokens = 0

    def add(self, doc_index: int, tokens: np.ndarray) -> None:
        if not self._docs:
            self._first_doc = doc_index
        self._docs.append(tokens)
        self._last_doc = doc_index
        self._tokens += len(tokens)
        if self._tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._docs:
            return
        name = f"{self.split}-{len(self.shards):05d}.arrow"
        path = self.directory / name
        lengths = np.fromiter((len(d) for d in self._docs), dtype=np.int64, count=len(self._docs))
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = pa.array(np.concatenate(self._docs).astype(self.dtype, copy=False))
        column = pa.ListArray.from_arrays(pa.array(offsets), values)
        batch = pa.record_batch([column], names=["tokens"])
        tmp = path.with_name(name + TMP_SUFFIX)
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
            writer.write_batch(batch)
        fsync_and_replace(tmp, path)
        info = ShardInfo(
            file=name,
            n_tokens=int(lengths.sum()),
            n_docs=len(self._docs),
            sha256=sha256_file(path),
            bytes=path.stat().st_size,
            first_doc=self._first_doc,
            end_doc=self._last_doc + 1,
        )
        atomic_write_json(sidecar_path(path), info.model_dump())
        self.shards.append(info)
        self._docs, self._tokens = [], 0


def completed_shards(directory: Path, split: Split) -> list[ShardInfo]:
    """Shards of `split` from an interrupted run that are complete and intact, in order.

    The first shard without a sidecar, or whose bytes no longer match its sha256, ends the list; it and
    every later shard of the split are deleted so they are rewritten.
    """
    done: list[ShardInfo] = []
    shards = sorted(directory.glob(f"{split}-*.arrow"))
    for index, shard in enumerate(shards):
        sidecar = sidecar_path(shard)
        valid = shard.name == f"{split}-{index:05d}.arrow" and sidecar.is_file()
        if valid:
            info = ShardInfo.model_validate(json.loads(sidecar.read_text()))
            valid = info.bytes == shard.stat().st_size and info.sha256 == sha256_file(shard)
        if not valid:
            for stale in shards[index:]:
                stale.unlink()
                sidecar_path(stale).unlink(missing_ok=True)
            break
        done.append(info)
    return done


def verify_shard(path: Path, info: ShardInfo, force: bool = False) -> None:
    """Check a shard's bytes against its sha256 in the manifest, once per (path, size, mtime) (see
    `damaged_file`); a mismatch is a one-line DataError naming the shard, so garbage never reaches a model."""
    problem = damaged_file(path.parent, {path.name: {"bytes": info.bytes, "sha256": info.sha256}}, force)
    if problem:
        raise DataError(f"shard {problem}; delete the dataset directory and re-run `lmforge tokenize`")


class ShardReader:
    """Memory-maps the shards of one split as one flat token stream (zero-copy per shard). Every shard is
    verified against the manifest's sha256 first (cached by path, size and mtime: see `verify_shard`);
    `verify="always"` re-hashes regardless of the cache."""

    def __init__(
        self, manifest: DatasetManifest, split: str, verify: bool | Literal["always"] = True
    ) -> None:
        if split not in manifest.splits:
            raise DataError(f"{manifest.path}: no split {split!r} (has {sorted(manifest.splits)})")
        self.documents: list[np.ndarray] = []  # per shard: end offset of each document
        self.arrays: list[np.ndarray] = []
        for info in manifest.splits[split].shards:
            path = Path(manifest.path) / info.file
            if not path.is_file() and manifest.uri:  # on object storage: through this node's cache
                path = blob_cache.fetch(open_store(manifest.uri), info.file, info.sha256, info.bytes)
            if not path.is_file():
                raise DataError(f"{path}: shard listed in the manifest is missing; re-run `lmforge tokenize`")
            if verify:
                verify_shard(path, info, force=verify == "always")
            self.arrays.append(self._open(path, manifest.dtype))
        sizes = np.array([len(a) for a in self.arrays], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        self.n_tokens = int(self.starts[-1])

    def _open(self, path: Path, dtype: str) -> np.ndarray:
        try:
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
            if reader.num_record_batches != 1:
                raise DataError(f"{path}: expected one record batch, found {reader.num_record_batches}")
            column = reader.get_batch(0).column("tokens")
        except (pa.ArrowException, OSError, KeyError) as error:
            raise DataError(f"{path}: not a readable token shard ({error})") from None
        values = column.values.to_numpy(zero_copy_only=True)
        if values.dtype != np.dtype(dtype):
            raise DataError(f"{path}: tokens are {values.dtype}, the manifest says {dtype}")
        self.documents.append(column.offsets.to_numpy()[1:])
        return values

    def slice(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the split's stream, crossing shard boundaries if needed."""
        pieces = []
        shard = int(np.searchsorted(self.starts, start, side="right")) - 1
        while length > 0:
            offset = start - int(self.starts[shard])
            piece = self.arrays[shard][offset : offset + length]
            pieces.append(piece)
            start += len(piece)
            length -= len(piece)
            shard += 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def document_lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(np.concatenate([[0], ends])) for ends in self.documents])


def token_counts(manifest: DatasetManifest, vocab_size: int, split: str = "train") -> np.ndarray:
    """How often each token id occurs in the split (one pass over its memory-mapped shards)."""
    reader = ShardReader(manifest, split)
    counts = np.zeros(vocab_size, dtype=np.int64)
    for array in reader.arrays:
        counts += np.bincount(array, minlength=vocab_size)[:vocab_size]
    return counts


def training_documents(manifest: DatasetManifest, split: str = "train") -> Iterator[str]:
    """The split's documents decoded back to text, in shard order (for contamination checks)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(manifest.tokenizer.path) / "tokenizer.json"))
    reader = ShardReader(manifest, split)
    for array, ends in zip(reader.arrays, reader.documents, strict=True):
        starts = np.concatenate([[0], ends[:-1]])
        docs = [array[a:b].tolist() for a, b in zip(starts, ends, strict=True)]
        for i in range(0, len(docs), 256):
            yield from tokenizer.decode_batch(docs[i : i + 256], skip_special_tokens=True)
