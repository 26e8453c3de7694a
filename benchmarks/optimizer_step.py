"""Cost and progress of the optimisers on the demo model, one JSON line.

For every `optim.name` (AdamW, DeepSpeed's Muon, SOAP, Shampoo, PSGD-Kron, K-FAC), through the DeepSpeed engine
(1 process, fp32, ZeRO-0, the demo model without μP, 16 × 128 tokens per step) and `training.loop.optimizer_step`:
- `step_ratio_vs_adamw`: median step time (forward, backward, optimiser step, preconditioner refreshes
  included at their cadence) over AdamW's;
- `loss`: held-out loss after the same `--steps` steps (the same tokens, in the same order) on the committed
  stdlib corpus, every optimiser at the recipe's learning rate and schedule (not tuned per optimiser).

    .venv/bin/python benchmarks/optimizer_step.py [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from data_pipeline.loader import PackedLoader
from data_pipeline.tokenize import run_tokenize
from flows.recipe import load_recipe
from training.loop import optimizer_step
from training.model.transformer import Transformer
from training.objective import TokenCrossEntropy
from training.optim.optimizers import lr_at

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "assets" / "corpus" / "stdlib_docstrings.jsonl"
NAMES = ("adamw", "muon", "soap", "shampoo", "kron", "kfac")


def train(name: str, out: Path, steps: int) -> tuple[float, float]:
    """(median step seconds, held-out loss after `steps`) for one optimiser."""
    from training.parallel import build_engine

    sets = [f"data.sources=[{CORPUS}]", "data.num_workers=1", f"output_dir={out}", "model.mup=null"]
    sets += [f"optim.name={name}", f"train.max_steps={steps}"]
    recipe = load_recipe("demo", sets)
    data = run_tokenize(recipe.data, recipe.output_dir)
    torch.manual_seed(0)
    engine = build_engine(Transformer(recipe.model, seed=0), recipe.optim, recipe.parallel, recipe.train)
    loader = PackedLoader(data, seq_len=recipe.train.seq_len, batch_size=recipe.train.micro_batch_size)
    objective, times = TokenCrossEntropy(), []
    for step in range(steps):
        start = time.perf_counter()
        optimizer_step(engine, loader, objective, lr_at(step, recipe.optim, steps), 1)
        times.append(time.perf_counter() - start)
    val = PackedLoader(data, seq_len=recipe.train.seq_len, batch_size=16, split="val")
    engine.train(False)
    with torch.no_grad():
        losses = [float(engine.forward(batch).ce_loss) for batch in val.epoch_batches(8)]
    return statistics.median(times[3:]), sum(losses) / len(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from training.parallel import init_distributed

    init_distributed()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in NAMES:
            results[name] = train(name, Path(tmp), args.steps)
    adamw = results["adamw"][0]
    print(
        json.dumps(
            {
                "benchmark": "optimizer_step",
                "threads": torch.get_num_threads(),
                "steps": args.steps,
                "tokens": args.steps * 16 * 128,
                "step_s": {n: round(s, 4) for n, (s, _) in results.items()},
                "step_ratio_vs_adamw": {n: round(s / adamw, 3) for n, (s, _) in results.items()},
                "loss": {n: round(loss, 4) for n, (_, loss) in results.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
