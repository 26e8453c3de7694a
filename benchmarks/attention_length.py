"""Softmax vs linear vs FAVOR+ attention as the sequence grows, on this machine, one JSON line.

A 4-layer d_model=256 model (4 heads of 64; FAVOR+ with 64 features), the same tokens per step at every length
(4096: batch 16 × 256, 4 × 1024, 1 × 4096), fp32, one thread:
- `train_tokens_per_s`: forward + backward of the language-model loss;
- `decode_ms_per_token`: one more token after a prompt of the full length (KV cache vs running sums);
- `ratio_linear_vs_softmax` / `ratio_favor_vs_softmax`: training tokens/s over softmax's, per length, and
  `linear_wins_from`: the shortest measured length at which linear attention trains faster.

    .venv/bin/python benchmarks/attention_length.py [--lengths 256 1024 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from training.model.config import ModelConfig
from training.model.transformer import Transformer

TOKENS = 4096
KINDS = ("softmax", "linear", "favor")


def config(kind: str, length: int) -> ModelConfig:
    extra = {"attention_features": 64} if kind == "favor" else {}
    return ModelConfig(
        vocab_size=512,
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        d_ff=688,
        max_seq_len=length + 1,
        attention=kind,
        **extra,
    )


def best_of(repeats: int, fn) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(kind: str, length: int, repeats: int) -> tuple[float, float]:
    """(training tokens/s, decode ms per token after a full-length prompt)."""
    model = Transformer(config(kind, length), seed=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 512, (TOKENS // length, length + 1), generator=g)

    def train_step() -> None:
        model.zero_grad(set_to_none=True)
        model(tokens[:, :-1], targets=tokens[:, 1:]).loss.backward()

    train_step()  # warm-up
    seconds = best_of(repeats, train_step)
    model.eval()
    with torch.no_grad():
        cache = model.new_cache(1, length + 1)
        model(tokens[:1, :-1], cache=cache)
        state = [c.length for c in cache]

        def decode() -> None:
            for c, n in zip(cache, state, strict=True):
                c.length = (
                    n  # the KV cache overwrites its last slot; the linear state is re-added (timing only)
                )
            model(tokens[:1, -1:], cache=cache)

        decode_s = best_of(repeats * 3, decode)
    return TOKENS / seconds, 1000 * decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    train = {k: {} for k in KINDS}
    decode = {k: {} for k in KINDS}
    for length in args.lengths:
        for kind in KINDS:
            train[kind][length], decode[kind][length] = measure(kind, length, args.repeats)
    ratio = {
        k: {t: round(train[k][t] / train["softmax"][t], 3) for t in args.lengths} for k in ("linear", "favor")
    }
    wins = [t for t in args.lengths if ratio["linear"][t] > 1.0]
    print(
        json.dumps(
            {
                "benchmark": "attention_length",
                "threads": torch.get_num_threads(),
                "model": "d_model=256 n_layers=4 heads=4x64 favor m=64",
                "tokens_per_step": TOKENS,
                "train_tokens_per_s": {k: {t: round(v) for t, v in d.items()} for k, d in train.items()},
                "decode_ms_per_token": {k: {t: round(v, 3) for t, v in d.items()} for k, d in decode.items()},
                "ratio_linear_vs_softmax": ratio["linear"],
                "ratio_favor_vs_softmax": ratio["favor"],
                "linear_wins_from": wins[0] if wins else None,
            }
        )
    )


if __name__ == "__main__":
    main()
