"""Importing a Hugging Face checkpoint: lmforge's `load_export` (safetensors read tensor by tensor onto a model built
on the meta device) against `AutoModelForCausalLM.from_pretrained`, on a random Llama written to disk in bf16,
sharded. Each load runs in a fresh process (one torch thread); its peak is the resident memory's high-water mark
during the load (reset just before it) less what was resident before (the imports). One JSON line: the weights' bytes, each side's seconds and peak, and
the ratios (lmforge / transformers; goals: time ≤ 1.2, memory ≤ 1.0, and peak ≤ 1.2x the weights).

    .venv/bin/python benchmarks/hf_import.py            # ~350M parameters (about 0.7 GB in bf16)
    .venv/bin/python benchmarks/hf_import.py --small    # ~40M, a quick look
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # hidden, layers, heads, intermediate, vocab
    "350m": (1024, 24, 16, 2816, 32_000),
    "small": (512, 8, 8, 1408, 32_000),
}


def write_model(directory: Path, size: str) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, intermediate, vocab = SIZES[size]
    config = LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads // 4,
        intermediate_size=intermediate,
        vocab_size=vocab,
        tie_word_embeddings=False,
    )
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(directory), max_shard_size="200MB")
    return sum(p.numel() for p in model.parameters())


def rss(field: str) -> int:
    """Resident bytes from /proc/self/status: now (VmRSS) or the peak since the last reset (VmHWM)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
    return int(line.split()[1]) * 1024


def measure(side: str, directory: str) -> None:
    """In the child process: load once, print {"seconds", "peak_bytes"}."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM  # noqa: F401 - imported before the baseline

    from training.model.hf_interop import load_export

    before = rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to what is resident now
    start = time.perf_counter()
    if side == "lmforge":
        model = load_export(directory, dtype=None)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    seconds = time.perf_counter() - start
    peak = rss("VmHWM") - before
    assert next(model.parameters()).dtype == torch.bfloat16
    print(json.dumps({"seconds": seconds, "peak_bytes": peak}))


def child(side: str, directory: Path) -> dict[str, float]:
    env_cmd = [sys.executable, __file__, "--child", side, str(directory)]
    out = subprocess.run(env_cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        measure(*args.child)
        return
    size = "small" if args.small else "350m"
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "llama"
        params = write_model(directory, size)
        weights = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        # transformers first, then lmforge, then both again: the better of two, so the page cache favours neither
        runs = {side: [child(side, directory)] for side in ("transformers", "lmforge")}
        for side in runs:
            runs[side].append(child(side, directory))
        best = {side: min(r, key=lambda x: x["seconds"]) for side, r in runs.items()}
        peak = {side: max(x["peak_bytes"] for x in r) for side, r in runs.items()}
    print(
        json.dumps(
            {
                "benchmark": "hf_import",
                "params": params,
                "weights_bytes": weights,
                "lmforge_seconds": round(best["lmforge"]["seconds"], 3),
                "transformers_seconds": round(best["transformers"]["seconds"], 3),
                "lmforge_peak_bytes": peak["lmforge"],
                "transformers_peak_bytes": peak["transformers"],
                "time_ratio": round(best["lmforge"]["seconds"] / best["transformers"]["seconds"], 3),
                "memory_ratio": round(peak["lmforge"] / peak["transformers"], 3),
                "peak_over_weights": round(peak["lmforge"] / weights, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
