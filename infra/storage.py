"""Content digests and crash-safe file writes, the ground the cached-step protocol (`infra/steps.py`) stands on.

Files are written to a temporary name, flushed to disk and renamed (and the rename made durable), so a crash
leaves either the old file or the new one, never half of one. `manifest.json` is the name of the file whose
presence marks a finished stage.
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
