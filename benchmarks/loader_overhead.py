"""Data-loader cost per batch as a fraction of one training step of the smoke model (goal: under 2%).

Both are measured in this process with one torch thread: the loader's `next_batch()` on a tokenized slice of
the stdlib corpus, and a forward + backward + AdamW step of the smoke recipe's model on batches of the same
shape. Prints one JSON line.

    .venv/bin/python benchmarks/loader_overhead.py [--recipe smoke] [--batches 300] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from data_pipeline.loader import PackedLoader
from data_pipeline.tokenize import run_tokenize
from flows.recipe import load_recipe
from training.model.transformer import Transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default="smoke")
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(args.recipe, ["data.max_documents=200", "data.num_workers=1"])
    with tempfile.TemporaryDirectory() as root:
        manifest = run_tokenize(recipe.data, root)
        loader = PackedLoader(
            manifest,
            seq_len=recipe.train.seq_len,
            batch_size=recipe.train.micro_batch_size,
            seed=recipe.train.seed,
        )
        loader.next_batch()  # first touch of the memory map
        started = time.perf_counter()
        for _ in range(args.batches):
            inputs, targets = loader.next_batch()
        batch_s = (time.perf_counter() - started) / args.batches

    model = Transformer(recipe.model, seed=recipe.train.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.optim.lr)

    def step() -> None:
        loss = model(inputs, targets=targets).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()  # warm-up: allocator, optimizer state
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    step_s = (time.perf_counter() - started) / args.steps
    print(
        json.dumps(
            {
                "benchmark": "loader_overhead",
                "recipe": recipe.name,
                "batch_shape": list(inputs.shape),
                "loader_ms_per_batch": round(batch_s * 1e3, 4),
                "train_step_ms": round(step_s * 1e3, 2),
                "loader_fraction_of_step": round(batch_s / step_s, 5),
                "goal_fraction": 0.02,
            }
        )
    )


if __name__ == "__main__":
    main()
