"""DeepSpeed's checkpoint files, hashed as they are written, and optionally written while training goes on.

DeepSpeed hands every file of a checkpoint to its checkpoint engine's `save`. This one serialises it (without
torch's per-record CRC32: the file's sha256 covers it), hashes the bytes while they go out (so the `COMPLETE`
marker needs no second read) and fsyncs. With `background` (`train.async_checkpoint`) `save` only copies the
state dict's tensors into CPU memory, which is all the training step waits for, and queues the write on a writer
thread. `wait()` blocks until every file is on disk and returns their records; the loop commits the checkpoint
only then, so a crash mid-write leaves a staging directory that is never loaded (`training/checkpoint.py`).
Measured by `benchmarks/checkpoint_io.py`.
"""

from __future__ import annotations

import copy
import hashlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.utils.serialization
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine


class HashingFile:
    """A write-only file whose bytes are counted and hashed (sha256) as they are written: a large chunk is hashed
    on a second thread while the file takes it (hashlib and the write both release the GIL), without a copy, and
    its write-back to disk starts at once."""

    PARALLEL_ABOVE = 1 << 20

    def __init__(self, path: str) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 - closed by `close`
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes) -> int:
        self.bytes += len(data)
        if len(data) < self.PARALLEL_ABOVE:
            self.sha256.update(data)
            with self.naming_errors():
                return self.file.write(data)
        hashing = HASHER.submit(self.sha256.update, data)
        with self.naming_errors():
            written = self.file.write(data)
        if hasattr(os, "posix_fadvise"):  # start writing these pages back now: the closing fsync waits less
            os.posix_fadvise(self.file.fileno(), self.bytes - len(data), len(data), os.POSIX_FADV_DONTNEED)
        hashing.result()
        return written

    def flush(self) -> None:
        with self.naming_errors():
            self.file.flush()

    def close(self) -> None:
        with self.naming_errors():
            try:
                self.file.flush()
                os.fsync(self.file.fileno())
            finally:
                self.file.close()

    @contextmanager
    def naming_errors(self) -> Iterator[None]:
        """OS errors that name this file: a full disk's says only "No space left on device"."""
        try:
            yield
        except OSError as error:
            if error.filename:
                raise
            raise OSError(error.errno, error.strerror, self.file.name) from None


HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash")


def write_file(state: Any, path: str) -> tuple[str, dict[str, Any]]:
    out = HashingFile(path)
    try:
        with torch.utils.serialization.config.patch({"save.compute_crc32": False}):
            torch.save(state, out)
    finally:
        out.close()
    return path, {"bytes": out.bytes, "sha256": out.sha256.hexdigest()}


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], item: Any) -> Any:
    """`item` with every tensor inside dicts, lists and tuples replaced by `fn(tensor)`; anything else, a
    `torch.Size` included (ZeRO-3's parameter shapes must stay one), is kept as it is."""
    if isinstance(item, torch.Tensor):
        return fn(item)
    if isinstance(item, dict):
        out = copy.copy(item)  # the same mapping type (OrderedDict, defaultdict, ...)
        for key, value in item.items():
            out[key] = map_tensors(fn, value)
        return out
    if type(item) in (list, tuple):
        return type(item)(map_tensors(fn, value) for value in item)
    return item


def without_views(state: Any) -> Any:
    """The state dict with each tensor that is a view into a larger storage cloned (torch.save would write all
    of that storage), the others as they are: what DeepSpeed's `clone_tensors_for_torch_save` guards against,
    without copying every tensor (a fresh 160 MB copy took 0.1 s here, as long as writing it)."""

    def own(v: torch.Tensor) -> torch.Tensor:
        whole = v.storage_offset() == 0 and v.untyped_storage().nbytes() == v.numel() * v.element_size()
        return v.detach() if whole else v.detach().clone()

    return map_tensors(own, state)


class CheckpointWriter(CheckpointEngine):
    """A DeepSpeed checkpoint engine that records each file's digest; with `background`, `save` returns once the
    state is copied and the files are written on a thread (`wait` for them)."""

    def __init__(self, background: bool = False) -> None:
        super().__init__()
        self.name = "lmforge"
        self.pool = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-writer") if background else None
        )
        self.pending: list[Future[tuple[str, dict[str, Any]]]] = []
        self.written: list[tuple[str, dict[str, Any]]] = []
        # file name -> the last snapshot's tensors, reused by the next
        self.copies: dict[str, list[torch.Tensor]] = {}

    def create(self, info: CheckpointCommitInfo) -> None:
        self.wait()  # a new checkpoint: records of an earlier save nobody asked for are dropped

    def save(self, state_dict: Any, path: str) -> None:
        if self.pool is None:
            self.written.append(write_file(without_views(state_dict), path))
        else:
            self.pending.append(
                self.pool.submit(write_file, self.snapshot(state_dict, Path(path).name), path)
            )

    def snapshot(self, state: Any, name: str) -> Any:
        """`state` with every tensor copied to CPU memory (training changes the originals next step), into the
        previous checkpoint's copies of the same file where shapes match: memory already mapped takes a copy
        several times faster than a fresh allocation. `create` has waited for that checkpoint's writes."""
        previous, copies = self.copies.get(name, []), []

        def copy_of(value: torch.Tensor) -> torch.Tensor:
            old = previous[len(copies)] if len(copies) < len(previous) else None
            if old is not None and (old.shape, old.dtype) == (value.shape, value.dtype):
                copies.append(old.copy_(value.detach()))
            else:
                copies.append(value.detach().to("cpu", copy=True))
            return copies[-1]

        snapshot = map_tensors(copy_of, state)
        self.copies[name] = copies
        return snapshot

    def load(self, path: str, map_location: Any = None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed need not clone every tensor first: `without_views` / `snapshot` see to it

    def wait(self) -> dict[Path, dict[str, Any]]:
        """{path: {bytes, sha256}} of the current checkpoint's files, once all are on disk; a failed write raises
        here."""
        pending, self.pending = self.pending, []
        written, self.written = [*self.written, *(future.result() for future in pending)], []
        return {Path(path): record for path, record in written}
