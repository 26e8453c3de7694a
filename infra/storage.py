"""Content-addressed stage directories and crash-safe file writes.

A stage writes into `<root>/<stage>/<name>-<hash>/`, where the hash covers everything that determines its
output (versioned config, upstream digests). `manifest.json` is written last, atomically: its presence is the
only sign a stage finished. Files are written to a temporary name, flushed to disk and renamed, so a crash
leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

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


def stage_dir(root: str | Path, stage: str, name: str, key: Any) -> Path:
    """`<root>/<stage>/<name>-<first 12 hex of digest_of(key)>`; not created."""
    return Path(root) / stage / f"{name}-{digest_of(key)[:12]}"


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
    atomic_write_bytes(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def remove_partial_files(directory: Path) -> list[Path]:
    """Delete leftovers of interrupted writes (`*.tmp`) in `directory`; return what was removed."""
    removed = sorted(directory.glob(f"*{TMP_SUFFIX}")) if directory.is_dir() else []
    for path in removed:
        path.unlink()
    return removed
