"""Checkpoints mirrored to object storage, so a worker restarted on another node resumes from the newest one.

The local protocol (`training/checkpoint.py`) is unchanged; the store gets a copy in the same layout. Each rank
uploads the files it wrote as soon as they are on its disk; rank 0, once every rank has (the same all_gather that
gates the local COMPLETE), uploads `meta.json`, the run's `metrics.jsonl`, and last `COMPLETE`, which lists every
file's size and sha256: a remote checkpoint without COMPLETE is never used, and a pulled one is verified against
it. Remote checkpoints beyond `keep`, and incomplete older ones, are deleted (COMPLETE first).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from infra.object_store import Store
from infra.storage import sha256_file
from training import checkpoint as ckpt

_STEP = re.compile(r"^(step-\d{8})/(.+)$")  # a file of a checkpoint, relative to checkpoints/


def upload_rank_files(
    store: Store, staging: Path, step: int, written: Iterable[str], rank: int
) -> dict[str, dict[str, Any]]:
    """Every rank: the checkpoint files it wrote into `staging` (the engine's and `rank-<r>.pt`) to
    `checkpoints/step-N/` in the store; returns the record of `rank-<r>.pt`, which COMPLETE lists too."""
    target = ckpt.step_dir(Path("checkpoints"), step).as_posix()
    rank_file = staging / f"rank-{rank}.pt"
    for relative in [*written, rank_file.name]:
        store.upload(staging / relative, f"{target}/{relative}")
    return {rank_file.name: {"bytes": rank_file.stat().st_size, "sha256": sha256_file(rank_file)}}


def publish(store: Store, run_dir: Path, final: Path, keep: int) -> None:
    """Rank 0, after every rank uploaded its files: meta, the metrics so far, COMPLETE last; then prune."""
    target = f"checkpoints/{final.name}"
    store.upload(final / "meta.json", f"{target}/meta.json")
    if (run_dir / "metrics.jsonl").is_file():
        store.upload(run_dir / "metrics.jsonl", "metrics.jsonl")
    store.upload(final / ckpt.COMPLETE, f"{target}/{ckpt.COMPLETE}")
    prune(store, keep)


def prune(store: Store, keep: int) -> None:
    """Delete remote checkpoints older than the newest `keep` complete ones, and incomplete older leftovers."""
    files: dict[str, list[str]] = {}
    for relative in store.listing("checkpoints"):
        match = _STEP.match(relative)
        if match:
            files.setdefault(match.group(1), []).append(match.group(2))
    complete = sorted(name for name, names in files.items() if ckpt.COMPLETE in names)
    kept = set(complete[-keep:])
    newest = complete[-1] if complete else ""
    for name, names in files.items():
        if name in kept or name > newest:  # a newer one may be being uploaded right now
            continue
        for relative in sorted(names, key=lambda n: n != ckpt.COMPLETE):  # COMPLETE first
            store.delete(f"checkpoints/{name}/{relative}")
