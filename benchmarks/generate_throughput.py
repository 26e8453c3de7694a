"""Generation with a KV cache: `training/model/sampling.py` vs `transformers`' `generate` on the exported model.

Same weights (our model converted as the export converts it), greedy decoding of `--new` tokens after a
`--prompt`-token prompt, batch `--batch`, KV cache on both sides, fp32, one thread; the two run alternately
`--repeats` times and the best time counts. Hugging Face runs with its fastest attention here (the better of
`sdpa` and `eager`). `ratio_ours_vs_hf` = our tokens/s over theirs (goal >= 1.0); `same_tokens` says whether the
greedy continuations agree token for token.

    .venv/bin/python benchmarks/generate_throughput.py [--shape demo|wide] [--batch 1] [--prompt 32] [--new 96]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
from torch import Tensor
from train_throughput import WIDE  # this script's directory

from flows.recipe import load_recipe
from training.model.hf_interop import build_hf_model, to_hf_state_dict
from training.model.sampling import generate
from training.model.transformer import Transformer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("demo", "wide"), default="demo")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_recipe("demo").model if args.shape == "demo" else WIDE
    ours = Transformer(cfg, seed=0).eval()
    prompt = torch.randint(
        0, cfg.vocab_size, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0)
    )
    contenders: dict[str, Callable[[], Tensor]] = {"ours": lambda: generate(ours, prompt, args.new)}
    for attention in ("sdpa", "eager"):
        hf = build_hf_model(cfg).eval()
        hf.load_state_dict(to_hf_state_dict(ours.state_dict(), cfg), strict=True)
        hf.config._attn_implementation = attention
        settings = {
            "max_new_tokens": args.new,
            "min_new_tokens": args.new,
            "do_sample": False,
            "use_cache": True,
        }
        settings |= {"pad_token_id": 0, "eos_token_id": None, "attention_mask": torch.ones_like(prompt)}
        contenders[f"hf_{attention}"] = lambda hf=hf, settings=settings: hf.generate(prompt, **settings)

    seconds: dict[str, float] = {name: float("inf") for name in contenders}
    outputs: dict[str, Tensor] = {}
    with torch.inference_mode():
        for name, run in contenders.items():  # warm-up
            outputs[name] = run()
        for _ in range(args.repeats):
            for name, run in contenders.items():
                start = time.perf_counter()
                run()
                seconds[name] = min(seconds[name], time.perf_counter() - start)
    tokens = args.batch * args.new
    hf_best = min(("hf_sdpa", "hf_eager"), key=seconds.__getitem__)
    print(
        json.dumps(
            {
                "benchmark": "generate_throughput",
                "shape": args.shape,
                "batch": args.batch,
                "prompt": args.prompt,
                "new_tokens": args.new,
                "tokens_per_s": {name: round(tokens / s, 1) for name, s in seconds.items()},
                "hf_baseline": hf_best,
                "ratio_ours_vs_hf": round(seconds[hf_best] / seconds["ours"], 3),
                "same_tokens": bool(torch.equal(outputs["ours"], outputs[hf_best])),
                "goal": 1.0,
            }
        )
    )


if __name__ == "__main__":
    main()
