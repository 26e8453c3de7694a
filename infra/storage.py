"""Content digests and crash-safe file writes, the ground the cached-step protocol (`infra/steps.py`) stands on.

Files are written to a temporary name, flushed to disk and renamed (and the rename made durable), so a crash
leaves either the old file or the new one, never half of one. `manifest.json` is the name of the file whose
presence marks a finished stage.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"


def digest_of(value: Any) -> str:
    """sha256 of the canonical JSON of `value` (sorted keys, no whitespace)."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def fsync_and_replace(tmp: Path, final: Path) -> None:
    """Make `tmp` durable, then atomically move it over `final` (and make the rename durable)."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.write_bytes(data)
    fsync_and_replace(tmp, path)


def atomic_write_json(path: str | Path, value: Any) -> None:
    """Keys stay in their order (an evaluation's models are compared in the order given; sorting them made a
    loaded report put "lora" before "pretrain", and a cached `eval --register` take the wrong base)."""
    atomic_write_bytes(path, (json.dumps(value, indent=2) + "\n").encode())


def remove_partial_files(directory: Path) -> list[Path]:
    """Delete leftovers of interrupted writes (`*.tmp`) in `directory`; return what was removed."""
    removed = sorted(directory.glob(f"*{TMP_SUFFIX}")) if directory.is_dir() else []
    for path in removed:
        path.unlink()
    return removed


# per directory: {relative path: [bytes, mtime_ns, ctime_ns, sha256]} of files already checked. The inode's change
# time is part of the key because no rewrite can keep it (a rewrite that restores the size and mtime, `touch -r`,
# still moves it) and a copy gets its own, so a copy is verified on its own bytes.
VERIFIED = ".verified.json"
_verified: dict[tuple[str, int, int, int], str] = {}  # this process's checks, keyed like the file's entry


def _stamp(path: Path, stat: os.stat_result) -> tuple[str, int, int, int]:
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def file_records(
    directory: Path, exclude: tuple[str, ...] = (), known: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """{relative path: {bytes, sha256}} of every regular file under `directory` (dotfiles and `exclude` left
    out): what a marker records so a later reader can tell a damaged copy from the one that was written. Files in
    `known` (hashed by their writer as they were written) are not read again while their size matches."""
    records = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory).as_posix()
        if relative in exclude or any(part.startswith(".") for part in Path(relative).parts):
            continue
        stat, record = path.stat(), (known or {}).get(relative)
        digest = (
            record["sha256"] if record is not None and record["bytes"] == stat.st_size else sha256_file(path)
        )
        records[relative] = {"bytes": stat.st_size, "sha256": digest}
        _verified[_stamp(path, stat)] = digest  # just hashed: no re-check
    return records


def damaged_file(directory: Path, records: dict[str, dict[str, Any]], force: bool = False) -> str | None:
    """The first file of `records` under `directory` that is missing or differs (one line: the path and what is
    wrong), else None. Each file is hashed once per (path, size, mtime, ctime): checks are cached in this process
    and in `<directory>/.verified.json`, so a later run re-hashes only files that changed; `force` re-hashes all."""
    cache_path = directory / VERIFIED
    try:
        cache: dict[str, list] = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        cache = {}
    changed = False
    for relative, record in records.items():
        path = directory / relative
        try:
            stat = path.stat()
        except FileNotFoundError:
            return f"{path}: missing"
        if stat.st_size != record["bytes"]:
            return f"{path}: {stat.st_size} bytes, {record['bytes']} when written (truncated or replaced)"
        key = _stamp(path, stat)
        seen = [*key[1:], record["sha256"]]
        if not force and (_verified.get(key) == record["sha256"] or cache.get(relative) == seen):
            _verified[key] = record["sha256"]
            continue
        if sha256_file(path) != record["sha256"]:
            return (
                f"{path}: bytes differ from the sha256 recorded when it was written (modified or corrupted)"
            )
        _verified[key], cache[relative], changed = record["sha256"], seen, True
    if changed:
        with contextlib.suppress(OSError):  # a read-only copy: checked again next time
            atomic_write_json(cache_path, cache)
    return None
