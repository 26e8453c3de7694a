"""The output head and its loss, lmforge's cross-entropy vs `F.cross_entropy` on the logits cast to fp32, one JSON line.

At d_model 384, vocab 8,192, 8 × 128 tokens (the `wide` shape of `train_throughput.py`), bf16 weights and
activations, one thread: the head's GEMM, the loss and their backward, eager and compiled (`torch.compile`, as
`training/compile.py` compiles the head with its loss), the two losses called in turn on the same tensors.
- `<mode>.ms`, `<mode>.ms_torch`: medians of the head and loss forward and backward (the logits returned, as the
  model does; gradients of the hidden states and the head) with ours and with torch's;
  `<mode>.ratio_torch_vs_ours`: their ratio (> 1: ours is faster).
- `gemms_ms`: the head's three GEMMs alone (forward, the two of the backward): the floor under both.
- `max_grad_difference`: the largest difference between the two losses' gradients of the hidden states.

    .venv/bin/python benchmarks/cross_entropy.py [--dtype bf16|fp16] [--vocab 8192]
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
from training.model.cross_entropy import cross_entropy


def median_ms(*runs: Callable[[], object], steps: int = 21, warmup: int = 3) -> list[float]:
    """Each run's median milliseconds, the runs called in turn (a drift in the machine's pace hits all alike)."""
    times: list[list[float]] = [[] for _ in runs]
    for i in range(warmup + steps):
        for run, spent in zip(runs, times, strict=True):
            start = time.perf_counter()
            run()
            if i >= warmup:
                spent.append(time.perf_counter() - start)
    return [1e3 * statistics.median(spent) for spent in times]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--vocab", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as the engine does
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    generator = torch.Generator().manual_seed(0)
    tokens, width = 8 * 128, 384
    hidden = torch.randn(tokens, width, generator=generator).to(dtype).requires_grad_()
    head = (0.02 * torch.randn(args.vocab, width, generator=generator)).to(dtype).requires_grad_()
    targets = torch.randint(0, args.vocab, (tokens,), generator=generator)

    def ours(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # as `Transformer.logits_and_loss`
        logits = F.linear(h, head)
        return logits, cross_entropy(logits, targets)

    def torchs(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(h, head)
        return logits, F.cross_entropy(logits.float(), targets)

    def step(
        loss_fn: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            hidden.grad = head.grad = None
            loss_fn(hidden)[1].backward()
            return hidden.grad

        return run

    result: dict = {"benchmark": "cross_entropy", "dtype": args.dtype, "vocab": args.vocab, "tokens": tokens}
    for mode, wrap in (("eager", lambda f: f), ("compiled", lambda f: torch.compile(f, dynamic=False))):
        mine, theirs = step(wrap(ours)), step(wrap(torchs))
        if mode == "eager":
            result["max_grad_difference"] = float((mine() - theirs()).float().abs().max())
        ms, ms_torch = median_ms(mine, theirs)
        result[mode] = {
            "ms": round(ms, 2),
            "ms_torch": round(ms_torch, 2),
            "ratio_torch_vs_ours": round(ms_torch / ms, 3),
        }
    grad_out = torch.randn(tokens, args.vocab, generator=generator).to(dtype)
    with torch.no_grad():
        h, w = hidden.detach(), head.detach()
        (gemms,) = median_ms(lambda: (F.linear(h, w), grad_out @ w, grad_out.t() @ h))
    result["gemms_ms"] = round(gemms, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
