"""Training throughput: our DeepSpeed step vs a plain PyTorch loop, MFU, MoE cost, and 2-worker scaling.

All in one run, one JSON line, per model shape (`demo`, the demo's tiny model, and `wide`, d_model=384, 1,024 tokens a
micro-batch; `wide-4k` when asked, the same at 4,096; on CUDA `gpt2-small-like` (124M) and `1b`):
- `<shape>.ratio_engine_vs_plain`: tokens/s of our step (DeepSpeed engine, 1 worker, ZeRO-0 as by default, eager) over a plain
  loop on the same model, dtype and batch (torch AdamW, clipping, autocast for bf16). Goal >= 0.97.
- `<shape>.mfu_vs_measured_gemm`: model FLOP/s (6N + attention, `training/model/accounting.py`) of our step over the
  machine's GEMM peak measured in this run (the best of a large square GEMM and one at the model's shapes, same
  dtype and threads). Goal >= 0.60 for d_model >= 384. `mfu_compiled` is the same with `parallel.compile=true`
  (`--compile`), whose start (engine and first step) takes `compile_seconds` longer and which is ahead of the eager run after
  `compile_pays_after_steps` steps (absent when it is not faster); on CUDA also `mfu_vs_published_peak` (989
  TFLOP/s for H100/H200).
- `<shape>.ratio_moe_vs_dense`: a top-2-of-8 MoE (sort + grouped GEMM dispatch) vs the dense model with the same
  active parameters (d_ff = 2 x expert d_ff), both through our engine, timed after `MOE_WARMUP` steps. Goal >= 0.90.
  `moe_optimizer_ms` and `same_active_dense_optimizer_ms`: the optimiser's step in each (the MoE has 2x the
  parameters to update); `ratio_moe_vs_dense_forward_backward`: the ratio without them (routing, dispatch and
  grouped GEMMs only). With
  `--compile` also both compiled: `ratio_moe_vs_dense_compiled` (and `_forward_backward`), `moe_compiled_tokens_per_s`,
  `moe_compiled_optimizer_ms` and `moe_blocks_compiled` (false where the compile's trial step failed and the
  blocks stayed eager).
- `scaling_2_vs_1_workers`: tokens/s of 2 Ray Train workers over 1 (`lmforge pretrain demo`, ZeRO-2).

    .venv/bin/python benchmarks/train_throughput.py [--precision fp32] [--shapes demo,wide] [--skip-scaling]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from data_pipeline.loader import Batch
from flows.recipe import load_recipe
from training.model.accounting import flops_per_token
from training.model.config import ModelConfig, MoEConfig
from training.model.transformer import Transformer
from training.perf import measure_matmul_peak, published_peak

DIST_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# steps an MoE pair takes before it is timed: on a CPU the MoE's first steps meet expert row counts (and batched
# shapes) whose oneDNN kernels are not built yet; at the demo shape in bf16 its steps 0-39 ran beside dense at
# MoE/dense 0.69-0.73, steps 40-79 at 0.748-0.754 (a training run's thousands of steps see the latter)
MOE_WARMUP = 40
WIDE = ModelConfig(
    vocab_size=8192, d_model=384, n_layers=4, n_heads=6, n_kv_heads=6, d_ff=1024, max_seq_len=256
)
ONE_B = ModelConfig(
    vocab_size=50304, d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, d_ff=5632, max_seq_len=2048
)
# shape -> (model, sequence length, micro-batch)
SHAPES: dict[str, Callable[[], tuple[ModelConfig, int, int]]] = {
    "demo": lambda: (load_recipe("demo").model, 128, 8),
    "wide": lambda: (WIDE, 128, 8),
    # the same model at 4,096 tokens a micro-batch (not in the default list): GEMMs and experts' groups 4x taller, the
    # optimiser's pass over the weights a quarter of the share
    "wide-4k": lambda: (WIDE, 128, 32),
    "gpt2-small-like": lambda: (load_recipe("gpt2-small-like").model, 1024, 16),
    "1b": lambda: (ONE_B, 2048, 4),
}


def batches(cfg: ModelConfig, seq: int, micro: int, n: int, device: torch.device) -> list[Batch]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (micro, seq + 1), generator=g).to(device)
        out.append(Batch(tokens[:, :-1], tokens[:, 1:]))
    return out


def time_interleaved(steps: dict[str, Callable[[Batch], object]], data: list[Batch], warmup: int = 3) -> dict:
    """Median seconds per step of each contender, run in turn on the same batches (so drifts in the machine's
    speed hit all of them alike), after `warmup` steps each."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for i, batch in enumerate(data):
        for name, step in steps.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            step(batch)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def engine_step(
    cfg: ModelConfig,
    seq: int,
    micro: int,
    device: torch.device,
    precision: str,
    compile: bool = False,
    zero_stage: int = 0,
):
    """One optimiser step of our engine (DeepSpeed, 1 worker, the default ZeRO-0) as a function of the batch."""
    from training.parallel import build_engine

    recipe = load_recipe(
        "demo",
        [
            f"parallel.precision={precision}",
            f"parallel.compile={str(compile).lower()}",
            f"parallel.zero_stage={zero_stage}",
            f"model.max_seq_len={max(seq, cfg.max_seq_len)}",  # the recipe's check; the model is `cfg`
            f"train.seq_len={seq}",
            f"train.micro_batch_size={micro}",
            f"train.global_batch_size={micro}",
        ],
    )
    engine = build_engine(Transformer(cfg, seed=0).to(device), recipe.optim, recipe.parallel, recipe.train)
    optimizer_s: list[float] = []  # the optimiser's share of each step (engine.step), read by `optimizer_ms`

    def step(batch: Batch) -> None:
        engine.backward(engine.forward(batch, logits_grad=False).loss)  # as the loop's objective
        start = time.perf_counter()
        engine.step(recipe.optim.lr)
        optimizer_s.append(time.perf_counter() - start)

    step.optimizer_s = optimizer_s  # type: ignore[attr-defined]
    step.compiled_blocks = "forward" in vars(engine.module.model.layers[-1])  # type: ignore[attr-defined]
    return step


def started(
    cfg: ModelConfig, seq: int, micro: int, device: torch.device, precision: str, compile: bool, batch: Batch
) -> tuple[Callable[[Batch], None], float]:
    """An `engine_step` and the seconds from building it to the end of its first step on `batch`."""
    start = time.perf_counter()
    step = engine_step(cfg, seq, micro, device, precision, compile=compile)
    step(batch)
    return step, time.perf_counter() - start


def optimizer_ms(step: Callable[[Batch], None]) -> float:
    """Median milliseconds of an `engine_step`'s optimiser step (clipping and the fp32 master copies included)."""
    return round(1000 * statistics.median(step.optimizer_s), 1)  # type: ignore[attr-defined]


def forward_backward_ratio(moe_s: float, dense_s: float, steps: dict[str, Callable[[Batch], None]]) -> float:
    """MoE/dense tokens/s without the optimiser's step: what routing, dispatch and the grouped GEMMs cost."""
    dense = dense_s - optimizer_ms(steps["dense"]) / 1000
    return round(dense / (moe_s - optimizer_ms(steps["moe"]) / 1000), 3)


def plain_step(cfg: ModelConfig, device: torch.device, precision: str):
    """The same step as a plain PyTorch loop: AdamW, clipping at 1.0, bf16 autocast when asked."""
    model = Transformer(cfg, seed=0).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # as the engine

    def step(batch: Batch) -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = model(batch.inputs, targets=batch.targets).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def release() -> None:
    """Free the previous contenders' memory (DeepSpeed engines hold reference cycles) before building the next."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def gemm_peak(dtype: torch.dtype, device: torch.device, cfg: ModelConfig, tokens: int) -> float:
    """The machine's GEMM peak for this dtype: the best of a large square GEMM and one at the model's shapes."""
    square = 8192 if device.type == "cuda" else 1024
    return max(
        measure_matmul_peak(dtype, device, square, square, square),
        measure_matmul_peak(dtype, device, tokens, cfg.d_model, cfg.d_ff),
    )


def measure_shape(name: str, steps: int, device: torch.device, precision: str, compile: bool) -> dict:
    cfg, seq, micro = SHAPES[name]()
    tokens = seq * micro
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    peak = gemm_peak(dtype, device, cfg, tokens)
    flops = flops_per_token(cfg, seq).training * tokens
    moe = cfg.model_copy(update={"moe": MoEConfig(n_experts=8, top_k=2, d_ff_expert=cfg.d_ff // 2)})
    same_active = cfg.model_copy(update={"d_ff": 2 * (cfg.d_ff // 2)})
    data = batches(cfg, seq, micro, steps, device)
    s = time_interleaved(
        {
            "plain": plain_step(cfg, device, precision),
            "engine": engine_step(cfg, seq, micro, device, precision),
        },
        data,
    )
    release()
    contenders = {
        "moe": engine_step(moe, seq, micro, device, precision),
        "dense": engine_step(same_active, seq, micro, device, precision),
    }
    moe_data = batches(cfg, seq, micro, MOE_WARMUP + steps, device)
    s |= time_interleaved(contenders, moe_data, warmup=MOE_WARMUP)
    plain_s, engine_s, moe_s, dense_s = s["plain"], s["engine"], s["moe"], s["dense"]
    report = {
        "model": f"d_model={cfg.d_model} n_layers={cfg.n_layers} vocab={cfg.vocab_size} seq={seq} micro={micro}",
        "gemm_peak_gflops": round(peak / 1e9, 1),
        "plain_tokens_per_s": round(tokens / plain_s),
        "engine_tokens_per_s": round(tokens / engine_s),
        "ratio_engine_vs_plain": round(plain_s / engine_s, 3),
        "mfu_vs_measured_gemm": round(flops / engine_s / peak, 3),
        "moe_tokens_per_s": round(tokens / moe_s),
        "same_active_dense_tokens_per_s": round(tokens / dense_s),
        "ratio_moe_vs_dense": round(dense_s / moe_s, 3),
        "moe_optimizer_ms": optimizer_ms(contenders["moe"]),
        "same_active_dense_optimizer_ms": optimizer_ms(contenders["dense"]),
        "ratio_moe_vs_dense_forward_backward": forward_backward_ratio(moe_s, dense_s, contenders),
    }
    if (published := published_peak(device)) is not None:
        report["mfu_vs_published_peak"] = round(flops / engine_s / published, 4)
    release()
    if compile:
        # each engine's start: built (the compiled one compiles on a trial step) and its first step taken
        eager_start_s = started(cfg, seq, micro, device, precision, False, data[0])[1]
        step, compiled_start_s = started(cfg, seq, micro, device, precision, True, data[0])
        compiled_s = time_interleaved({"c": step}, data)["c"]  # alone, before the MoE's memory is in the heap
        report["compiled_tokens_per_s"] = round(tokens / compiled_s)
        report["mfu_compiled"] = round(flops / compiled_s / peak, 3)
        report["compile_seconds"] = round(compiled_start_s - eager_start_s, 1)
        if compiled_s < engine_s:  # after how many steps the compiled run is ahead, its warm-up included
            report["compile_pays_after_steps"] = round(report["compile_seconds"] / (engine_s - compiled_s))
        del step
        release()
        # built side by side, as the eager pair (an engine built before another's ran 10-40% slower beside it)
        compiled = {
            "moe": engine_step(moe, seq, micro, device, precision, True),
            "dense": engine_step(same_active, seq, micro, device, precision, True),
        }
        pair = time_interleaved(compiled, moe_data, warmup=MOE_WARMUP)
        report["moe_compiled_tokens_per_s"] = round(tokens / pair["moe"])
        report["ratio_moe_vs_dense_compiled"] = round(pair["dense"] / pair["moe"], 3)
        report["moe_compiled_optimizer_ms"] = optimizer_ms(compiled["moe"])
        report["ratio_moe_vs_dense_compiled_forward_backward"] = forward_backward_ratio(
            pair["moe"], pair["dense"], compiled
        )
        report["moe_blocks_compiled"] = compiled["moe"].compiled_blocks  # type: ignore[attr-defined]
    return report


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--shapes", help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument(
        "--compile", action="store_true", help="also time the engine with parallel.compile=true"
    )
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
    shapes = (args.shapes or ("gpt2-small-like,1b" if device.type == "cuda" else "demo,wide")).split(",")
    if unknown := [s for s in shapes if s not in SHAPES]:
        parser.error(f"unknown shape(s) {unknown}: choose from {', '.join(SHAPES)}")

    report: dict = {
        "benchmark": "train_throughput",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "precision": args.precision,
        "goals": {
            "ratio_engine_vs_plain": 0.97,
            "mfu_vs_measured_gemm (d_model>=384)": 0.60,
            "ratio_moe_vs_dense": 0.90,
        },
    }
    for name in shapes:
        report[name] = measure_shape(name, args.steps, device, args.precision, args.compile)
    if not args.skip_scaling:
        report.update(scaling(args.steps + 10, args.precision))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
