"""Object storage vs local disk, in one run against a real S3-protocol server on 127.0.0.1 (moto), one JSON line.

- `shard_read_mb_s`: one split's shards opened and every token touched, from local disk (memory map), from the
  store with an empty cache (download + sha256 + map) and with the cache warm.
- `loader_fraction_of_step`: the packed loader's time per batch over the smoke model's training step (forward,
  backward, AdamW; goal < 2%), with the shards on local disk and through the cache.
- `checkpoint_s`: the loop's checkpoint of the `wide` model (d_model 384, AdamW state, ~160 MB) to a local run
  directory and to one on the store (each rank uploads its files, COMPLETE last); best of `--repeats`.
- `tokenize_tokens_s`: the same corpus into shards with `data.backend` processes and ray (2 workers each; the
  tokenizer is trained once beforehand; ray once including Ray's start, once with Ray running), and with the
  processes backend writing to the store.

    .venv/bin/python benchmarks/object_storage.py [--documents 600] [--repeats 3]

moto keeps objects in memory and runs in one Python process: a real MinIO or S3 is faster at big transfers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/s3_server.py: the test server
from checkpoint_io import Position, fsync_tree, wide_engine  # this script's directory

from data_pipeline.loader import PackedLoader
from data_pipeline.shards import ShardReader
from data_pipeline.tokenize import run_tokenize
from flows.recipe import load_recipe
from infra import blob_cache
from infra.object_store import open_store
from tests.s3_server import s3_server
from training.loop import LoopSetup, LoopState, save_checkpoint
from training.model.transformer import Transformer


def timed(function, *args):  # noqa: ANN001, ANN202 - a stopwatch
    start = time.perf_counter()
    result = function(*args)
    return result, time.perf_counter() - start


def touch_all(manifest, split: str = "train") -> int:  # noqa: ANN001
    reader = ShardReader(manifest, split)
    return sum(int(array.sum(dtype="int64") % 7) + array.nbytes for array in reader.arrays)


def loader_ms(manifest, recipe, batches_n: int = 300) -> tuple[float, torch.Tensor, torch.Tensor]:  # noqa: ANN001
    loader = PackedLoader(
        manifest, seq_len=recipe.train.seq_len, batch_size=recipe.train.micro_batch_size, seed=0
    )
    inputs, targets = loader.next_batch()
    start = time.perf_counter()
    for _ in range(batches_n):
        inputs, targets = loader.next_batch()
    return (time.perf_counter() - start) / batches_n * 1e3, inputs, targets


def step_ms(recipe, inputs: torch.Tensor, targets: torch.Tensor, steps: int = 20) -> float:  # noqa: ANN001
    model = Transformer(recipe.model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.optim.lr)
    for i in range(steps + 3):
        if i == 3:
            start = time.perf_counter()
        model(inputs, targets=targets).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict[str, object] = {"benchmark": "object_storage"}
    with tempfile.TemporaryDirectory() as tmp, s3_server(Path(tmp) / "moto.log") as server:
        os.environ.update(server.env(Path(tmp) / "cache"))
        base = ["data.num_workers=2", f"data.max_documents={args.documents}", "data.shard_tokens=200000"]
        first = run_tokenize(load_recipe("smoke", base).data, f"{tmp}/warm")
        settings = [*base, f"data.tokenizer.path={first.tokenizer.path}"]

        # --- tokenization: processes vs ray (local), processes to the store
        tokens = sum(s.n_tokens for s in first.splits.values())
        rates = {}
        for name, extra, root in (
            ("processes", [], f"{tmp}/processes"),
            ("ray", ["data.backend=ray"], f"{tmp}/ray"),  # includes starting Ray and its actors
            ("ray_started", ["data.backend=ray"], f"{tmp}/ray-again"),  # Ray already up: actors only
            ("processes_to_s3", [], "s3://lmforge/bench"),
        ):
            manifest, seconds = timed(run_tokenize, load_recipe("smoke", [*settings, *extra]).data, root)
            rates[name] = round(tokens / seconds)
        out["tokenize_tokens_s"] = rates
        out["ratio_tokenize_ray_vs_processes"] = {
            "with_ray_start": round(rates["ray"] / rates["processes"], 3),
            "ray_running": round(rates["ray_started"] / rates["processes"], 3),
        }
        out["tokens"] = tokens
        local = run_tokenize(load_recipe("smoke", settings).data, f"{tmp}/processes")
        remote = manifest

        # --- shard reads: local, store with an empty cache, store with a warm cache
        size = sum(s.bytes for s in local.splits["train"].shards)
        shutil.rmtree(Path(remote.path))  # read as a node that did not write them: through the cache
        shutil.rmtree(blob_cache.blob_dir(), ignore_errors=True)
        _, cold = timed(touch_all, remote)
        _, warm = timed(touch_all, remote)
        _, disk = timed(touch_all, local)
        out["shard_mb"] = round(size / 1e6, 2)
        out["shard_read_mb_s"] = {
            "local": round(size / 1e6 / disk, 1),
            "s3_cold": round(size / 1e6 / cold, 1),
            "s3_cached": round(size / 1e6 / warm, 1),
        }
        recipe = load_recipe("smoke", settings)
        local_ms, inputs, targets = loader_ms(local, recipe)
        remote_ms, _, _ = loader_ms(remote, recipe)
        train_ms = step_ms(recipe, inputs, targets)
        out["train_step_ms"] = round(train_ms, 2)
        out["loader_fraction_of_step"] = {
            "local": round(local_ms / train_ms, 5),
            "s3_cached": round(remote_ms / train_ms, 5),
            "goal": 0.02,
        }

        # --- checkpoints: local run directory vs one on the store
        engine = wide_engine()
        seconds: dict[str, list[float]] = {"local": [], "s3": []}
        for repeat in range(1, args.repeats + 1):
            for where in ("local", "s3"):
                run_dir = Path(tmp) / f"run-{where}"
                store = open_store("s3://lmforge/bench-checkpoints") if where == "s3" else None
                setup = LoopSetup(run_dir, 0, 1, 1, 1.0, {}, remote=store)
                start = time.perf_counter()
                final = save_checkpoint(engine, Position(), setup, LoopState(step=repeat), keep=1)
                fsync_tree(final)
                seconds[where].append(time.perf_counter() - start)
        mb = sum(p.stat().st_size for p in final.rglob("*") if p.is_file()) / 1e6
        best = {where: min(t) for where, t in seconds.items()}
        out["checkpoint_mb"] = round(mb, 1)
        out["checkpoint_s"] = {where: round(t, 3) for where, t in best.items()}
        out["ratio_checkpoint_s3_vs_local_time"] = round(best["s3"] / best["local"], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
