"""The GPU check's other figures (`benchmarks/gpu_check.sh`), one JSON line:
- `zero2_vs_zero0`: step time of our engine under ZeRO-2 over ZeRO-0 (one device, bf16; ZeRO-2 partitions
  nothing with one rank, so this is its bookkeeping cost).
- `fp16`: a run under fp16 with DeepSpeed's dynamic loss scaling: skipped (overflow) steps, the final scale,
  first and last loss; `ok` when every applied step's loss is finite and the loss fell.
- `export_bf16`: the verified Hugging Face export loaded with `AutoModelForCausalLM` in bf16 on the device vs our
  model in bf16 on the same tokens: max |logit difference| over the logits' std, and next-token agreement.

    python benchmarks/gpu_extras.py [--shape gpt2-small-like] [--steps 12]   (on a CPU: the demo shape, no fp16)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
from pathlib import Path

import torch
from train_throughput import (  # this script's directory
    SHAPES,
    batches,
    engine_step,
    release,
    time_interleaved,
)

from flows.recipe import load_recipe
from training.model.export import export_hf
from training.model.transformer import Transformer


def zero_ratio(shape: str, steps: int, device: torch.device, precision: str) -> dict:
    cfg, seq, micro = SHAPES[shape]()
    data = batches(cfg, seq, micro, steps, device)
    s = time_interleaved(
        {
            "zero0": engine_step(cfg, seq, micro, device, precision, zero_stage=0),
            "zero2": engine_step(cfg, seq, micro, device, precision, zero_stage=2),
        },
        data,
    )
    release()
    return {
        "zero0_s": round(s["zero0"], 4),
        "zero2_s": round(s["zero2"], 4),
        "ratio": round(s["zero2"] / s["zero0"], 3),
    }


def current_scale(optimizer: object) -> float:
    """DeepSpeed's dynamic loss scale now (where its fp16 optimisers keep it, by version and ZeRO stage)."""
    for path in ("loss_scale_config.cur_scale", "loss_scaler.cur_scale", "cur_scale"):
        value = optimizer
        try:
            for part in path.split("."):
                value = getattr(value, part)
            return float(value)
        except AttributeError:
            continue
    return float("nan")


def fp16_run(steps: int, device: torch.device) -> dict:
    """The demo model under fp16 for `steps` steps at a high learning rate, from loss scale 2^16."""
    from training.parallel import build_engine

    recipe = load_recipe(
        "demo", ["parallel.precision=fp16", "parallel.zero_stage=1", "optim.lr=0.003", "optim.warmup_steps=2"]
    )
    cfg = recipe.model
    engine = build_engine(Transformer(cfg, seed=0).to(device), recipe.optim, recipe.parallel, recipe.train)
    data = batches(cfg, 128, recipe.train.micro_batch_size, 4, device)  # 4 batches, seen again and again
    losses, skipped = [], 0
    for i in range(steps):
        for _ in range(engine.accumulation_steps):
            loss = engine.forward(data[i % len(data)]).loss
            engine.backward(loss)
        engine.step(recipe.optim.lr)
        if engine.ds.skipped_steps > skipped:
            skipped = engine.ds.skipped_steps
        else:
            losses.append(float(loss))
    scale = current_scale(engine.ds.optimizer)
    release()
    return {
        "steps": steps,
        "skipped_steps": skipped,
        "final_loss_scale": scale,
        "first_loss": round(losses[0], 4),
        "last_loss": round(losses[-1], 4),
        "ok": all(math.isfinite(v) for v in losses) and losses[-1] < losses[0] and scale >= 1,
    }


@torch.no_grad()
def export_parity(shape: str, device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM

    cfg, seq, _ = SHAPES[shape]()
    ours = Transformer(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, min(seq, 256)), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as out:
        verification = export_hf(ours.state_dict(), cfg, None, Path(out) / "hf")
        theirs = (
            AutoModelForCausalLM.from_pretrained(Path(out) / "hf", dtype=torch.bfloat16).to(device).eval()
        )
        ours = ours.to(device=device, dtype=torch.bfloat16).eval()
        a = ours(tokens.to(device)).logits.float()
        b = theirs(tokens.to(device)).logits.float()
    release()
    return {
        "export_verified_fp32": verification["valid"],
        "max_abs_diff_over_std": round(float((a - b).abs().max() / a.std()), 4),
        "next_token_agreement": round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=list(SHAPES), help="default: gpt2-small-like on CUDA, demo on CPU")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--fp16-steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from training.parallel import init_distributed

    init_distributed()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = "bf16" if device.type == "cuda" else "fp32"
    shape = args.shape or ("gpt2-small-like" if device.type == "cuda" else "demo")
    report: dict = {
        "benchmark": "gpu_extras",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    report["zero2_vs_zero0"] = zero_ratio(shape, args.steps, device, precision)
    if device.type == "cuda":  # DeepSpeed's CPU accelerator has no fp16
        report["fp16"] = fp16_run(args.fp16_steps, device)
    report["export_bf16"] = export_parity(shape, device)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
