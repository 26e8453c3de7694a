"""Checkpoint I/O: our crash-safe checkpoint vs a raw sequential write of the same bytes, in one run, one JSON line.

The model is the `wide` shape of `train_throughput.py` (d_model=384, ~13M parameters) in our DeepSpeed engine
(fp32, ZeRO-0, AdamW after one step, so the checkpoint holds weights and both moments). Each contender runs
`--repeats` times, alternately, and the best time counts:
- `raw`: the checkpoint's byte count written to one file in 16 MiB chunks, then fsync.
- `checkpoint`: `training.loop.save_checkpoint` (DeepSpeed files, rank state, rename, sha256 COMPLETE marker),
  then fsync of every file it wrote (durable, like `raw`).
`ratio_checkpoint_vs_raw_write` = raw seconds / checkpoint seconds (throughput ratio; goal >= 0.5).
`stall_vs_write` = seconds the training loop is blocked by a save (the save, without the fsync it does not wait
for) / raw write seconds (goal <= 1: checkpointing never stalls training longer than writing the bytes).

    .venv/bin/python benchmarks/checkpoint_io.py [--repeats 5] [--dir /path/on/the/disk/to/measure]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from train_throughput import WIDE, batches  # this script's directory

from flows.recipe import load_recipe
from training.loop import LoopSetup, LoopState, save_checkpoint
from training.model import Transformer
from training.parallel import build_engine

CHUNK = 16 << 20


class Position:
    """The loader state a checkpoint stores (a position only)."""

    def state_dict(self) -> dict[str, Any]:
        return {"position": 1}


def fsync_tree(root: Path) -> None:
    for path in [p for p in root.rglob("*") if p.is_file()] + [root]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def raw_write(path: Path, size: int) -> float:
    block = os.urandom(CHUNK)
    start = time.perf_counter()
    with path.open("wb") as f:
        for offset in range(0, size, CHUNK):
            f.write(block[: min(CHUNK, size - offset)])
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temporary directory)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(
        "demo", ["train.seq_len=128", "train.micro_batch_size=8", "train.global_batch_size=8"]
    )
    engine = build_engine(Transformer(WIDE, seed=0), recipe.optim, recipe.parallel, recipe.train)
    (batch,) = batches(WIDE, 128, 8, 1, torch.device("cpu"))
    engine.backward(engine.forward(batch).loss)
    engine.step(recipe.optim.lr)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run_dir = Path(tmp)
        setup = LoopSetup(run_dir=run_dir, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
        save_times, durable_times, raw_times, size = [], [], [], 0
        for step in range(1, args.repeats + 1):
            start = time.perf_counter()
            final = save_checkpoint(engine, Position(), setup, LoopState(step=step), keep=1)
            saved = time.perf_counter()
            fsync_tree(final)
            save_times.append(saved - start)
            durable_times.append(time.perf_counter() - start)
            size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
            raw_times.append(raw_write(run_dir / "raw.bin", size))
        shutil.rmtree(run_dir / "checkpoints")
    raw, durable, save = min(raw_times), min(durable_times), min(save_times)
    print(
        json.dumps(
            {
                "benchmark": "checkpoint_io",
                "checkpoint_mb": round(size / 1e6, 1),
                "raw_write_mb_s": round(size / 1e6 / raw, 1),
                "checkpoint_mb_s": round(size / 1e6 / durable, 1),
                "ratio_checkpoint_vs_raw_write": round(raw / durable, 3),
                "stall_vs_write": round(save / raw, 3),
                "goal": {"ratio_checkpoint_vs_raw_write": 0.5, "stall_vs_write": 1.0},
            }
        )
    )


if __name__ == "__main__":
    main()
