"""Checkpoint I/O: our crash-safe checkpoint vs a raw sequential write of the same bytes, in one run, one JSON line.

The model is the `wide` shape of `train_throughput.py` (d_model=384, ~13M parameters) in our DeepSpeed engine
(fp32, ZeRO-0, AdamW after one step, so the checkpoint holds weights and both moments). Each contender runs
`--repeats` times, in turn, and the best time counts:
- `raw`: the checkpoint's byte count written to one file in 16 MiB chunks, then fsync.
- `sync` / `async` (`train.async_checkpoint`): the loop's checkpoint (DeepSpeed files hashed as they are
  written, rank state, rename, `COMPLETE` marker with every file's sha256), then fsync of every file: durable.
`ratio_checkpoint_vs_raw_write` = raw seconds / the faster checkpoint's seconds (throughput ratio; goal >= 0.5).
`stall_vs_write` = seconds the training loop is blocked by a save (sync: all of it; async: until the state is
copied) / raw write seconds (goal <= 1: checkpointing never stalls training longer than writing the bytes).

    .venv/bin/python benchmarks/checkpoint_io.py [--repeats 5] [--dir /path/on/the/disk/to/measure]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from train_throughput import WIDE, batches  # this script's directory

from flows.recipe import load_recipe
from training.loop import LoopSetup, LoopState, finish_checkpoint, start_checkpoint
from training.model.transformer import Transformer
from training.parallel import build_engine, init_distributed
from training.parallel.checkpoint_writer import CheckpointWriter

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


def wide_engine() -> Any:
    """The `wide` model in our DeepSpeed engine after one AdamW step (weights and both moments to save)."""
    init_distributed()
    recipe = load_recipe(
        "demo",
        [
            "train.seq_len=128",
            "train.micro_batch_size=8",
            "train.global_batch_size=8",
            "parallel.compile=false",
        ],
    )  # eager: only the state is saved here, and compiling would add seconds to each start
    engine = build_engine(Transformer(WIDE, seed=0), recipe.optim, recipe.parallel, recipe.train)
    (batch,) = batches(WIDE, 128, 8, 1, torch.device("cpu"))
    engine.backward(engine.forward(batch).loss)
    engine.step(recipe.optim.lr)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to write (default: a temporary directory)"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = wide_engine()

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        run_dir = Path(tmp)
        setup = LoopSetup(run_dir=run_dir, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
        times: dict[str, list[float]] = {
            name: [] for name in ("raw", "sync", "sync_stall", "async", "async_stall")
        }
        size = 0
        writers = {"sync": CheckpointWriter(), "async": CheckpointWriter(background=True)}
        for step in range(1, args.repeats + 1):
            for mode in ("sync", "async"):
                engine.ds.checkpoint_engine = writers[mode]  # one per run, as in training
                start = time.perf_counter()
                pending = start_checkpoint(engine, Position(), setup, LoopState(step=2 * step))
                blocked = time.perf_counter() - start  # async: training resumes here
                final = finish_checkpoint(engine, setup, pending, keep=1)
                if mode == "sync":
                    blocked = time.perf_counter() - start
                fsync_tree(final)
                times[mode].append(time.perf_counter() - start)
                times[f"{mode}_stall"].append(blocked)
            size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
            times["raw"].append(raw_write(run_dir / "raw.bin", size))
    best = {name: min(t) for name, t in times.items()}
    print(
        json.dumps(
            {
                "benchmark": "checkpoint_io",
                "checkpoint_mb": round(size / 1e6, 1),
                "raw_write_mb_s": round(size / 1e6 / best["raw"], 1),
                "checkpoint_mb_s": {mode: round(size / 1e6 / best[mode], 1) for mode in ("sync", "async")},
                "ratio_checkpoint_vs_raw_write": round(best["raw"] / min(best["sync"], best["async"]), 3),
                "stall_vs_write": {
                    mode: round(best[f"{mode}_stall"] / best["raw"], 3) for mode in ("sync", "async")
                },
                "goal": {"ratio_checkpoint_vs_raw_write": 0.5, "stall_vs_write": 1.0},
            }
        )
    )


if __name__ == "__main__":
    main()
