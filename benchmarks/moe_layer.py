"""One MoE layer's forward and backward with its experts' GEMMs batched (`bmm`, every expert padded to the
largest one's rows) vs grouped (`grouped_mm`, each padded to 32 rows), and SwiGLU on the GEMM output's strided gate
vs a contiguous copy; one JSON line.

Top-2-of-8 experts, 8 × 128 tokens, bf16 weights and activations on a CPU, one thread, at the two shapes of
`train_throughput.py` (`demo`: d_model 64, experts 96 wide; `wide`: 384 and 512), on inputs the router spreads
evenly (balanced) and on the same shifted by a constant, which it sends to a few experts (skewed). The contenders are called in turn, the order
reversed every step (the first after another contender ran measurably slower here).
- `<shape>.<routing>.grouped_ms`, `.batched_ms`, `.auto_ms` (lmforge's choice, `moe.pays_to_batch`): medians;
  `.padding`: rows the batched layout runs over the grouped one's; `.auto_batches`: whether the choice batched.
- `<shape>.swiglu_view_ms`, `.swiglu_copy_ms`: SiLU(gate) · up with its backward on the layer's (rows, 2I) output,
  the gate as the strided half or copied first (`moe.swiglu` copies where a row is not a multiple of 128 bytes).

    .venv/bin/python benchmarks/moe_layer.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from infra.allocator import keep_freed_memory
from training.model import moe
from training.model.config import MoEConfig

SHAPES = {"demo": (64, 96), "wide": (384, 512)}


def medians_ms(runs: dict[str, Callable[[], object]], steps: int, warmup: int = 3) -> dict[str, float]:
    """Each run's median milliseconds, called in turn, the order reversed every step."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(warmup + steps):
        for name in list(runs)[:: 1 if i % 2 else -1]:
            start = time.perf_counter()
            runs[name]()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {name: round(1e3 * statistics.median(t), 3) for name, t in times.items()}


def layer_step(layer: moe.MoE, x: torch.Tensor, batch_padding: float) -> Callable[[], None]:
    """One forward and backward of `layer` on x with `moe.BATCH_PADDING` at `batch_padding`."""

    def run() -> None:
        moe.BATCH_PADDING = batch_padding
        for p in layer.parameters():
            p.grad = None
        out, stats = layer(x)
        (out.float().square().mean() + 0.01 * stats.aux_loss).backward()

    return run


def swiglu_step(gate_up: torch.Tensor, copy: bool) -> Callable[[], None]:
    def run() -> None:
        gate_up.grad = None
        gate, up = gate_up.chunk(2, dim=-1)
        (F.silu(gate.contiguous() if copy else gate) * up).sum().backward()

    return run


def measure(d_model: int, d_ff: int, steps: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    layer = moe.MoE(d_model, MoEConfig(n_experts=8, top_k=2, d_ff_expert=d_ff))
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=generator))
    layer = layer.to(torch.bfloat16)
    x = torch.randn(8, 128, d_model, generator=generator).to(torch.bfloat16).requires_grad_()
    default = moe.BATCH_PADDING
    out: dict = {}
    for routing, shift in (("balanced", 0.0), ("skewed", 2.0)):  # a shared offset favours some experts
        inputs = (x + shift).detach().requires_grad_()
        with torch.no_grad():
            _, ids, _, _ = layer.gate(inputs.reshape(-1, d_model))
        counts = torch.bincount(ids.reshape(-1), minlength=8)
        batches = moe.pays_to_batch(counts, 32)
        runs = {
            "grouped": layer_step(layer, inputs, 0.0),
            "batched": layer_step(layer, inputs, float("inf")),
            "auto": layer_step(layer, inputs, default),
        }
        ms = medians_ms(runs, steps)
        out[routing] = {
            **{f"{k}_ms": v for k, v in ms.items()},
            "padding": round(moe.batch_padding(counts, 32), 3),
            "auto_batches": batches,
        }
    moe.BATCH_PADDING = default
    rows = 2 * 8 * 128 + 8 * 32  # assignments and about their padding
    gate_up = torch.randn(rows, 2 * d_ff, generator=generator).to(torch.bfloat16).requires_grad_()
    ms = medians_ms({"view": swiglu_step(gate_up, False), "copy": swiglu_step(gate_up, True)}, steps)
    return {**out, "swiglu_view_ms": ms["view"], "swiglu_copy_ms": ms["copy"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as the engine does
    result = {"benchmark": "moe_layer", "dtype": "bf16", "tokens": 1024, "experts": "top-2 of 8"}
    for name, (d_model, d_ff) in SHAPES.items():
        result[name] = {"d_model": d_model, "d_ff_expert": d_ff, **measure(d_model, d_ff, args.steps)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
