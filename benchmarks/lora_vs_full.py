"""LoRA vs full fine-tuning on the same model and batch, through our DeepSpeed engine (fp32, ZeRO-0).

Prints one JSON line: step-time ratio (LoRA / full), optimizer-state bytes ratio and trainable-parameter ratio.

    .venv/bin/python benchmarks/lora_vs_full.py [--recipe demo] [--steps 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from data_pipeline.loader import Batch
from flows.recipe import load_recipe
from training.model.lora import apply_lora, trainable_counts
from training.model.transformer import Transformer


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if torch.is_tensor(t)
    )


def measure(model: torch.nn.Module, recipe, steps: int) -> tuple[float, int, int]:  # noqa: ANN001
    from training.parallel import build_engine

    ft = recipe.sft
    engine = build_engine(model, ft.optim, recipe.parallel, ft.train)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(
        0, recipe.model.vocab_size, (ft.train.micro_batch_size, ft.train.seq_len + 1), generator=g
    )
    x, y = tokens[:, :-1], tokens[:, 1:]
    times = []
    for step in range(steps):
        start = time.perf_counter()
        engine.backward(engine.forward(Batch(x, y)).loss)
        engine.step(ft.optim.lr)
        if step >= 3:
            times.append(time.perf_counter() - start)
    trainable, _ = trainable_counts(model)
    return statistics.median(times), optimizer_state_bytes(engine.ds.optimizer), trainable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--recipe", default="demo")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from training.parallel import init_distributed

    init_distributed()
    recipe = load_recipe(args.recipe, ["parallel.precision=fp32", "parallel.zero_stage=0"])
    full_s, full_bytes, full_params = measure(Transformer(recipe.model, seed=0), recipe, args.steps)
    lora_model = apply_lora(Transformer(recipe.model, seed=0), recipe.sft.lora)
    lora_s, lora_bytes, lora_params = measure(lora_model, recipe, args.steps)
    print(
        json.dumps(
            {
                "benchmark": "lora_vs_full",
                "recipe": recipe.name,
                "lora_r": recipe.sft.lora.r,
                "targets": list(recipe.sft.lora.target_modules),
                "full_step_ms": round(full_s * 1e3, 2),
                "lora_step_ms": round(lora_s * 1e3, 2),
                "step_time_ratio_lora_vs_full": round(lora_s / full_s, 3),
                "optimizer_state_bytes_full": full_bytes,
                "optimizer_state_bytes_lora": lora_bytes,
                "optimizer_state_ratio_lora_vs_full": round(lora_bytes / full_bytes, 4),
                "trainable_params_full": full_params,
                "trainable_params_lora": lora_params,
                "trainable_ratio_lora_vs_full": round(lora_params / full_params, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
