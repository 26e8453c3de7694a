"""Training throughput: our DeepSpeed step vs a plain PyTorch loop, MFU, MoE cost, and 2-worker scaling.

All in one run, one JSON line:
- `ratio_engine_vs_plain`: tokens/s of our step (DeepSpeed engine, 1 worker, bf16, ZeRO-1) divided by a plain
  loop on the same model and batch (torch AdamW + bf16 autocast). Goal >= 0.9.
- `mfu_vs_measured_gemm`: model FLOP/s (6N + attention) of our step over a GEMM of the same dtype measured at
  the model's shapes on the same device; on CUDA also `mfu_vs_published_peak` (989 TFLOP/s for H100/H200).
- `ratio_moe_vs_dense`: a top-2-of-8 MoE vs the dense model with the same active parameters (d_ff = 2 x expert
  d_ff), both through our engine. Goal >= 0.67.
- `scaling_2_vs_1_workers`: tokens/s of 2 Ray Train workers over 1 (`lmforge pretrain`, bf16, ZeRO-2).

    .venv/bin/python benchmarks/train_throughput.py [--steps 20] [--skip-scaling]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from data_pipeline.loader import Batch
from flows.recipe import load_recipe
from training.accounting import flops_per_token
from training.model import ModelConfig, Transformer
from training.moe import MoEConfig
from training.perf import measure_matmul_peak, published_peak

SEQ, MICRO = 128, 8
DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def batches(cfg: ModelConfig, n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (MICRO, SEQ + 1), generator=g).to(device)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def time_steps(step, data, warmup: int = 3) -> float:
    """Median seconds per step after `warmup` steps."""
    times = []
    for i, (x, y) in enumerate(data):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        step(x, y)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def engine_step_time(cfg: ModelConfig, steps: int, device: torch.device, precision: str) -> float:
    from training.parallel import build_engine

    recipe = load_recipe(
        "demo",
        [
            f"parallel.precision={precision}",
            "parallel.zero_stage=1",
            f"train.seq_len={SEQ}",
            f"train.micro_batch_size={MICRO}",
            f"train.global_batch_size={MICRO}",
        ],
    )
    engine = build_engine(Transformer(cfg, seed=0).to(device), recipe.optim, recipe.parallel, recipe.train)

    def step(x, y):
        engine.backward(engine.forward(Batch(x, y)).loss)
        engine.step(recipe.optim.lr)

    return time_steps(step, batches(cfg, steps, device))


def plain_step_time(cfg: ModelConfig, steps: int, device: torch.device, precision: str) -> float:
    model = Transformer(cfg, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(x, targets=y).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return time_steps(step, batches(cfg, steps, device))


def scaling(steps: int, precision: str) -> dict[str, float]:
    """Median tokens/s of 1 and 2 workers through `lmforge pretrain` (Ray Train for 2)."""
    result = {}
    for workers in (1, 2):
        with tempfile.TemporaryDirectory() as out:
            sets = [
                f"output_dir={out}",
                "data.max_documents=200",
                "data.num_workers=1",
                f"train.max_steps={steps}",
                f"train.checkpoint_every={steps}",
                "train.eval_every=1000",
                f"parallel.precision={precision}",
                "parallel.zero_stage=2",
                "train.micro_batch_size=8",
                f"train.global_batch_size={8 * workers}",
            ]
            args = [
                str(Path(sys.executable).with_name("lmforge")),
                "pretrain",
                "demo",
                "--workers",
                str(workers),
            ]
            env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}  # not this process's group
            subprocess.run(
                args + [a for s in sets for a in ("--set", s)],
                check=True,
                capture_output=True,
                env={**env, "OMP_NUM_THREADS": "1"},
            )
            metrics = (Path(out) / "pretrain").glob("*/metrics.jsonl")
            rates = [
                json.loads(line).get("perf/tokens_per_s") for line in next(metrics).read_text().splitlines()
            ]
            result[workers] = statistics.median([r for r in rates if r][3:])
    return {
        "tokens_per_s_1_worker": round(result[1]),
        "tokens_per_s_2_workers": round(result[2]),
        "scaling_2_vs_1_workers": round(result[2] / result[1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-scaling", action="store_true")
    parser.add_argument(
        "--precision",
        choices=["bf16", "fp32"],
        default="bf16",
        help="fp32 on CPUs without AVX-512 BF16, where bf16 GEMMs are emulated and ~50x slower",
    )
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from training.parallel import init_distributed

    init_distributed()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dense = load_recipe("demo").model
    tokens = MICRO * SEQ

    p = args.precision
    plain_s = plain_step_time(dense, args.steps, device, p)
    engine_s = engine_step_time(dense, args.steps, device, p)
    model_flops = flops_per_token(dense, SEQ).training * tokens / engine_s
    dtype = torch.bfloat16 if p == "bf16" else torch.float32
    gemm_peak = measure_matmul_peak(dtype, device, tokens, dense.d_model, dense.d_ff)

    moe_cfg = dense.model_copy(update={"moe": MoEConfig(n_experts=8, top_k=2, d_ff_expert=dense.d_ff // 2)})
    same_active = dense.model_copy(update={"d_ff": 2 * (dense.d_ff // 2)})
    moe_s = engine_step_time(moe_cfg, args.steps, device, p)
    same_active_s = engine_step_time(same_active, args.steps, device, p)

    report = {
        "benchmark": "train_throughput",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "precision": p,
        "model": f"demo d_model={dense.d_model} n_layers={dense.n_layers}",
        "batch_tokens": tokens,
        "plain_tokens_per_s": round(tokens / plain_s),
        "engine_tokens_per_s": round(tokens / engine_s),
        "ratio_engine_vs_plain": round(plain_s / engine_s, 3),
        "goal_engine_vs_plain": 0.9,
        "gemm_peak_gflops_at_model_shapes": round(gemm_peak / 1e9, 1),
        "mfu_vs_measured_gemm": round(model_flops / gemm_peak, 3),
        "moe_tokens_per_s": round(tokens / moe_s),
        "same_active_dense_tokens_per_s": round(tokens / same_active_s),
        "ratio_moe_vs_dense": round(same_active_s / moe_s, 3),
        "goal_moe_vs_dense": 0.67,
    }
    if (peak := published_peak(device)) is not None:
        report["mfu_vs_published_peak"] = round(model_flops / peak, 4)
    if not args.skip_scaling:
        report.update(scaling(args.steps + 10, p))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
