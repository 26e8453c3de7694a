"""A bounded local cache of remote files keyed by their sha256 (token shards read from object storage).

Each node downloads a file once, to `<cache>/blobs/<sha256>`, hashed as it arrives and renamed into place only
when the digest matches, so a corrupt or partial download is never read. The cache holds at most
`$LMFORGE_CACHE_GB` gigabytes (default 50): after each download the least recently used files are deleted
(a file already memory-mapped stays readable by whoever mapped it until they close it).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

from infra.mirror import cache_root
from infra.object_store import Store

log = logging.getLogger(__name__)


def blob_dir() -> Path:
    return cache_root() / "blobs"


def limit_bytes() -> int:
    return int(float(os.environ.get("LMFORGE_CACHE_GB", "50")) * (1 << 30))


def fetch(store: Store, relative: str, sha256: str, size: int) -> Path:
    """A verified local copy of `relative` in `store`, whose bytes have digest `sha256`."""
    path = blob_dir() / sha256
    if path.is_file() and path.stat().st_size == size:
        os.utime(path)  # most recently used
        return path
    lock = blob_dir() / f".{sha256}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as handle:  # two ranks on one node download it once
        fcntl.flock(handle, fcntl.LOCK_EX)
        if not (path.is_file() and path.stat().st_size == size):
            store.download(relative, path, sha256, size)
            log.debug("cached %s (%.1f MB)", store.url(relative), size / 1e6)
            evict(limit_bytes(), keep=path)
    lock.unlink(missing_ok=True)
    return path


def evict(limit: int, keep: Path) -> list[Path]:
    """Delete least recently used blobs (never `keep`) until the cache holds at most `limit` bytes."""
    stats = []
    for path in blob_dir().iterdir():
        with contextlib.suppress(FileNotFoundError):  # another process evicted it meanwhile
            if not path.name.startswith("."):
                stats.append((path.stat().st_mtime, path.stat().st_size, path))
    total = sum(size for _, size, _ in stats)
    removed = []
    for _, size, path in sorted(stats):
        if total <= limit:
            break
        if path != keep:
            total -= size
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
