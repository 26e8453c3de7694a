"""The weight-gradient GEMM's pace in bf16, beside the forward's, at a linear layer's shapes: where a CPU training
step's matrix multiplies lose time (issue 38).

For y = x·Wᵀ (x: tokens × in), autograd computes the weight gradient as gᵀ·x with gᵀ a transposed view of the
output's gradient (tokens × out): a GEMM with a long reduction (the tokens) and its first operand transposed. Timed
in turn on the same tensors, one torch thread: the forward x·Wᵀ, the input gradient g·W, autograd's gᵀ·x, the same
with gᵀ made contiguous beforehand (its copy timed apart), and x's transpose instead. One JSON line: TFLOP/s per
shape and the ratios (weight gradient / forward; contiguous / autograd; the copy in ms).

    .venv/bin/python benchmarks/gemm_layouts.py [--tokens 4096] [--width 384]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def seconds(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def shape_record(tokens: int, d_in: int, d_out: int, dtype: torch.dtype, reps: int) -> dict[str, object]:
    """TFLOP/s of the forward, the input gradient and three ways to the weight gradient at one layer's shape."""
    x = torch.randn(tokens, d_in, dtype=dtype)
    g = torch.randn(tokens, d_out, dtype=dtype)
    w = torch.randn(d_out, d_in, dtype=dtype)
    g_t = g.t().contiguous()
    flops = 2.0 * tokens * d_in * d_out
    timed = {
        "forward": lambda: torch.nn.functional.linear(x, w),
        "input_grad": lambda: torch.mm(g, w),
        "weight_grad_autograd": lambda: torch.mm(g.t(), x),
        "weight_grad_contiguous": lambda: torch.mm(g_t, x),
        "weight_grad_x_transposed": lambda: torch.mm(x.t(), g),
    }
    tflops = {k: flops / seconds(fn, reps) / 1e12 for k, fn in timed.items()}
    return {
        "shape": {"tokens": tokens, "in": d_in, "out": d_out},
        "tflops": {k: round(v, 3) for k, v in tflops.items()},
        "weight_grad_over_forward": round(tflops["weight_grad_autograd"] / tflops["forward"], 3),
        "contiguous_over_autograd": round(
            tflops["weight_grad_contiguous"] / tflops["weight_grad_autograd"], 3
        ),
        "transpose_copy_ms": round(seconds(lambda: g.t().contiguous(), reps) * 1e3, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    w = args.width
    shapes = [(w, w), (w, 4 * w), (4 * w, w)]  # attention projections, MLP up, MLP down
    records = [shape_record(args.tokens, d_in, d_out, dtype, args.reps) for d_in, d_out in shapes]
    print(
        json.dumps(
            {"benchmark": "gemm_layouts", "dtype": args.dtype, "torch": torch.__version__, "shapes": records}
        )
    )


if __name__ == "__main__":
    main()
