"""Evaluation throughput vs training: tokens/s of `score_continuations` (batched, inference mode) over the
tokens/s of a training step (forward + backward + AdamW) of the same model at the same batch shape
(goal ≥ 1.5). One torch thread; prints one JSON line.

    .venv/bin/python benchmarks/eval_throughput.py [--recipe demo] [--batches 6]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from evaluation.scoring import score_continuations
from flows.recipe import load_recipe
from training.model.transformer import Transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--batches", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    recipe = load_recipe(args.recipe)
    cfg, batch, seq = recipe.model, recipe.eval.batch_size, recipe.train.seq_len
    model = Transformer(cfg, seed=0)
    tokens = torch.randint(
        0, cfg.vocab_size, (args.batches, batch, seq + 1), generator=torch.Generator().manual_seed(0)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def train() -> None:
        for b in tokens:
            out = model(b[:, :-1], b[:, 1:])
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    requests = [(row[:1].tolist(), row[1:].tolist()) for b in tokens for row in b]

    def evaluate() -> None:
        score_continuations(model.eval(), requests, batch_size=batch)
        model.train()

    n_tokens = args.batches * batch * seq
    timings = {}
    for name, fn in (("train", train), ("eval", evaluate)):
        fn()  # warm-up
        best = min(_timed(fn) for _ in range(3))
        timings[name] = n_tokens / best
    print(
        json.dumps(
            {
                "benchmark": "eval_throughput",
                "model": args.recipe,
                "train_tokens_per_s": round(timings["train"]),
                "eval_tokens_per_s": round(timings["eval"]),
                "ratio": round(timings["eval"] / timings["train"], 2),
                "goal": 1.5,
            }
        )
    )


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
