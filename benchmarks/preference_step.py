"""Step cost of the new objectives against the ones they extend, same model, engine and loop, one JSON line:

- `ratio_dpo_vs_sft`: a DPO step on B pairs (chosen and rejected through the policy only: 2B rows, the reference
  log-probabilities cached) over an SFT step on B sequences. Goal <= 2.2 (2 would be the forward/backward work).
- `ratio_distill_vs_pretrain`: a distillation step (student plus a frozen teacher's forward, the teacher twice
  the student's depth) over a pretraining step of the student alone.

Both through `training.loop.optimizer_step` on the DeepSpeed engine (1 process, the demo model, fp32 by default).

    .venv/bin/python benchmarks/preference_step.py [--steps 20] [--precision fp32|bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from data_pipeline.loader import IGNORE_INDEX, Batch
from data_pipeline.preference import PairBatch
from flows.recipe import load_recipe
from training.config import PreferenceLoss
from training.loop import optimizer_step
from training.model.config import ModelConfig
from training.model.transformer import Transformer
from training.objective import TokenCrossEntropy
from training.stages.distill import DistillObjective
from training.stages.dpo import PreferenceObjective

SEQ, MICRO = 128, 16


class Fixed:
    """A loader that yields the same batch (the benchmark times compute, not data)."""

    def __init__(self, batch: Batch | PairBatch) -> None:
        self.batch = batch

    def next_batch(self) -> Batch | PairBatch:
        return self.batch


def sft_like(cfg: ModelConfig, rows: int, g: torch.Generator) -> Batch:
    """Rows with a prompt (no loss) of 40 tokens, then an answer to the end: SFT's and DPO's target pattern."""
    tokens = torch.randint(0, cfg.vocab_size, (rows, SEQ + 1), generator=g)
    targets = tokens[:, 1:].clone()
    targets[:, :40] = IGNORE_INDEX
    return Batch(tokens[:, :-1], targets)


def step_time(cfg: ModelConfig, objective, batch, precision: str, steps: int) -> float:
    from training.parallel import build_engine

    recipe = load_recipe("demo", [f"parallel.precision={precision}", f"train.micro_batch_size={MICRO}"])
    engine = build_engine(Transformer(cfg, seed=0), recipe.optim, recipe.parallel, recipe.train)
    loader, times = Fixed(batch), []
    for i in range(steps + 3):
        start = time.perf_counter()
        optimizer_step(engine, loader, objective, 1e-4, 1)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="fp32")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from training.parallel import init_distributed

    init_distributed()
    cfg = load_recipe("demo").model
    g = torch.Generator().manual_seed(0)
    sft = sft_like(cfg, MICRO, g)
    rows = sft_like(cfg, 2 * MICRO, g)
    pairs = PairBatch(rows.inputs, rows.targets, torch.zeros(MICRO, 2) - 50.0)
    sft_s = step_time(cfg, TokenCrossEntropy(), sft, args.precision, args.steps)
    dpo_s = step_time(cfg, PreferenceObjective(PreferenceLoss()), pairs, args.precision, args.steps)

    tokens = Batch(*torch.randint(0, cfg.vocab_size, (2, MICRO, SEQ), generator=g))
    student = cfg.model_copy(update={"n_layers": max(1, cfg.n_layers // 2)})
    teacher = Transformer(cfg, seed=1).requires_grad_(False)
    pretrain_s = step_time(student, TokenCrossEntropy(), tokens, args.precision, args.steps)
    distill_s = step_time(
        student, DistillObjective(teacher, "kl", 0.5, 2.0, 0.5), tokens, args.precision, args.steps
    )
    print(
        json.dumps(
            {
                "benchmark": "preference_step",
                "threads": torch.get_num_threads(),
                "precision": args.precision,
                "model": f"demo d_model={cfg.d_model} n_layers={cfg.n_layers}",
                "batch": f"{MICRO} x {SEQ} tokens (DPO: {MICRO} pairs)",
                "sft_step_s": round(sft_s, 4),
                "dpo_step_s": round(dpo_s, 4),
                "ratio_dpo_vs_sft": round(dpo_s / sft_s, 3),
                "goal_dpo_vs_sft": 2.2,
                "pretrain_step_s": round(pretrain_s, 4),
                "distill_step_s": round(distill_s, 4),
                "ratio_distill_vs_pretrain": round(distill_s / pretrain_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
