"""Checkpoint directories that a crash can never leave half-valid.

`<run>/checkpoints/step-00000050/` holds DeepSpeed's files (module, optimizer, step counters), one
`rank-<r>.pt` per rank (python/numpy/torch RNG states and the data loader's position) and `meta.json`
(step, config digest, MLflow run id, loop counters). Everything is written into `.tmp-step-...`, renamed into
place, and only then is the `COMPLETE` marker written, holding every file's size and sha256: a directory without
it is never loaded and is deleted on the next save. The newest intact checkpoint is the resume point (a damaged
newer one is skipped with a warning); older ones beyond `keep` are removed.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import threading
import uuid
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from infra.storage import atomic_write_json, damaged_file, file_records

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def staging_dir(root: Path, step: int) -> Path:
    return root / f".tmp-step-{step:08d}"


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, directory) of every complete checkpoint, oldest first."""
    found = []
    for path in root.glob("step-*") if root.is_dir() else []:
        match = _STEP_DIR.match(path.name)
        if match and (path / COMPLETE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a complete checkpoint (a missing, truncated or altered file), or None if intact."""
    try:
        files = json.loads((checkpoint / COMPLETE).read_text()).get("files")
    except (OSError, ValueError) as error:
        return f"{checkpoint / COMPLETE}: unreadable ({error})"
    return damaged_file(checkpoint, files) if files is not None else _incomplete_torch_file(checkpoint)


def _incomplete_torch_file(checkpoint: Path) -> str | None:
    """For a checkpoint written before checksums: its first torch file without the zip directory that ends every
    complete one (what a cut-short copy or write leaves), else None. Altered bytes go unseen without checksums."""
    for path in sorted(checkpoint.rglob("*.pt")):
        if not zipfile.is_zipfile(path):
            return (
                f"{path}: truncated ({path.stat().st_size} bytes, no zip directory; written before checksums)"
            )
    return None


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint whose files match their checksums; damaged newer ones are skipped (and
    named in a warning), never loaded."""
    for _, path in reversed(complete_checkpoints(root)):
        problem = damage(path)
        if problem is None:
            return path
        log.warning("checkpoint %s is damaged (%s); falling back to an earlier one", path, problem)
    return None


def prepare_staging(root: Path, step: int) -> Path:
    """Rank 0, before any rank writes: an empty staging directory for `step`."""
    staging = staging_dir(root, step)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def commit(
    root: Path, step: int, meta: dict[str, Any], keep: int, written: dict[str, dict[str, Any]] | None = None
) -> Path:
    """Rank 0, after every rank wrote into the staging directory: rename into place, mark complete, prune.
    `written`: {relative path: {bytes, sha256}} of files hashed as they were written (not read again)."""
    staging, final = staging_dir(root, step), step_dir(root, step)
    atomic_write_json(staging / "meta.json", meta)
    if final.exists():  # an incomplete leftover of a crashed save of the same step
        shutil.rmtree(final)
    staging.rename(final)
    # every rank's files: on object storage, ranks on other nodes wrote theirs only there
    files = {**(written or {}), **file_records(final, known=written)}
    atomic_write_json(final / COMPLETE, {"step": step, "files": dict(sorted(files.items()))})
    for _, old in complete_checkpoints(root)[:-keep]:
        discard(old)
    for leftover in root.iterdir():
        is_incomplete = _STEP_DIR.match(leftover.name) and not (leftover / COMPLETE).is_file()
        if leftover.is_dir() and (
            is_incomplete or (leftover.name.startswith(".tmp-") and leftover != staging)
        ):
            shutil.rmtree(leftover)
        elif leftover.name.startswith(".trash-"):  # left by a process that ended while deleting it
            shutil.rmtree(leftover, ignore_errors=True)
    return final


def discard(checkpoint: Path) -> None:
    """Remove an old checkpoint: renamed away at once (it is no longer listed), deleted on a thread (unlinking
    gigabytes takes a while, and the training step need not wait for it)."""
    trash = checkpoint.with_name(f".trash-{checkpoint.name}-{uuid.uuid4().hex[:8]}")
    checkpoint.rename(trash)
    threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True).start()


def read_meta(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / "meta.json").read_text())


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_rank_state(staging: Path, rank: int, loader_state: dict[str, Any]) -> None:
    torch.save({"rng": rng_state(), "loader": loader_state}, staging / f"rank-{rank}.pt")


def load_rank_state(checkpoint: Path, rank: int) -> dict[str, Any]:
    path = checkpoint / f"rank-{rank}.pt"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the checkpoint is incomplete; resume from an earlier one (delete this one)"
        )
    return torch.load(path, weights_only=False)
