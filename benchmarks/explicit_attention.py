"""Explicit causal attention vs PyTorch's SDPA in bf16 on this CPU, by sequence length, one JSON line.

What `training/model/transformer.EXPLICIT_ATTENTION_MAX_LEN` was chosen from: forward + backward of one attention
(6 heads of 64, 2,048 tokens a batch at every length), one thread, median of `--repeats` timings each;
`ratio_explicit_vs_sdpa` > 1 where the explicit path is faster. `bf16_matrix_units` says whether this CPU runs bf16
GEMMs natively (where the model takes the explicit path at all).

    .venv/bin/python benchmarks/explicit_attention.py [--lengths 64 128 192 256 512 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from training.model.transformer import (
    EXPLICIT_ATTENTION_MAX_LEN,
    cpu_has_bf16_matrix_units,
    explicit_causal_attention,
)

HEADS, HEAD_DIM, TOKENS = 6, 64, 2048


def seconds(attend: Callable[..., torch.Tensor], length: int, repeats: int) -> float:
    """Median seconds of forward + backward at `length` (batch TOKENS // length), after one warm-up."""
    g = torch.Generator().manual_seed(0)
    shape = (max(1, TOKENS // length), HEADS, length, HEAD_DIM)
    q, k, v = (torch.randn(shape, generator=g).bfloat16().requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=g).bfloat16()
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        attend(q, k, v).backward(grad)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 192, 256, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    scale = HEAD_DIM**-0.5
    ratios = {}
    for length in args.lengths:
        sdpa = seconds(
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), length, args.repeats
        )
        explicit = seconds(lambda q, k, v: explicit_causal_attention(q, k, v, scale), length, args.repeats)
        ratios[str(length)] = round(sdpa / explicit, 2)
    print(
        json.dumps(
            {
                "benchmark": "explicit_attention",
                "bf16_matrix_units": cpu_has_bf16_matrix_units(),
                "explicit_max_len": EXPLICIT_ATTENTION_MAX_LEN,
                "ratio_explicit_vs_sdpa": ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
