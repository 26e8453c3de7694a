"""RL's sampling: its throughput inside an RL step (the stage's objective: `group_size` completions per prompt
from the policy held by the engine, every prompt's group in one batch) against the sampler's own `generate` on the
same model and batch of prompts outside any step, and the share of an RL step spent sampling; one run, one JSON
line.

The model is the demo's (train_throughput.py's `demo` shape) in the plain-PyTorch engine; every completion runs
to `--new` tokens (no end-of-turn stop), rewards are the `length` function (scoring costs ~nothing), the KL
penalty is on (a frozen reference forward per step). Steps and standalone generations alternate `--repeats`
times; the best of each counts.
`sampling_ratio` = tokens/s sampled inside the step over standalone tokens/s (goal >= 0.9);
`sampling_share` = sampling seconds over the whole step's.

    .venv/bin/python benchmarks/rl_step.py [--prompts 2] [--group 4] [--prompt 32] [--new 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import time

import torch
from step_guards import Repeat  # this script's directory
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from train_throughput import SHAPES

from data_pipeline.prompts import Prompt, PromptBatch
from training.config import OptimConfig, RewardTerm, RLSpec, TrainConfig
from training.engine import PlainEngine
from training.loop import optimizer_step
from training.model.sampling import generate
from training.model.transformer import Transformer
from training.rewards import Rewards
from training.stages.rl import RLObjective


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg, _, _ = SHAPES["demo"]()
    model = Transformer(cfg, seed=0)
    engine = PlainEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-6), 1, grad_clip=1.0)
    spec = RLSpec(
        name="bench",
        output_dir="/tmp",
        rewards=(RewardTerm(function="length", target_tokens=args.new),),
        group_size=args.group,
        max_new_tokens=args.new,
        optim=OptimConfig(lr=1e-6, warmup_steps=0, schedule="constant"),
        train=TrainConfig(seq_len=args.prompt + args.new, micro_batch_size=args.prompts, spike_window=0),
    )
    ids = torch.randint(
        0, cfg.vocab_size, (args.prompts, args.prompt), generator=torch.Generator().manual_seed(0)
    )
    batch = PromptBatch(ids.tolist(), [Prompt([{"role": "user", "content": "x"}])] * args.prompts)
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    rewards = Rewards(spec.rewards, None, spec.train.seq_len)
    objective = RLObjective(spec, rewards, reference, tokenizer, end_of_turn=-1, pad_id=0)
    loader = Repeat(batch)

    def standalone() -> None:
        with torch.no_grad():
            generate(model.eval(), ids.repeat_interleave(args.group, 0), args.new, temperature=1.0)
        model.train()

    step_s, sampling_s, alone_s = float("inf"), float("inf"), float("inf")
    optimizer_step(engine, loader, objective, 1e-6, 1)  # warm-up
    standalone()
    for _ in range(args.repeats):
        start = time.perf_counter()
        outcome = optimizer_step(engine, loader, objective, 1e-6, 1)
        elapsed = time.perf_counter() - start
        if elapsed < step_s:
            step_s, sampling_s = elapsed, outcome.metrics["perf/sampling_s"]
        start = time.perf_counter()
        standalone()
        alone_s = min(alone_s, time.perf_counter() - start)
    tokens = args.prompts * args.group * args.new
    print(
        json.dumps(
            {
                "benchmark": "rl_step",
                "shape": "demo",
                "prompts": args.prompts,
                "group": args.group,
                "prompt_tokens": args.prompt,
                "new_tokens": args.new,
                "sampled_tokens_per_s": {
                    "in_rl_step": round(tokens / sampling_s, 1),
                    "generate": round(tokens / alone_s, 1),
                },
                "sampling_ratio": round(alone_s / sampling_s, 3),
                "sampling_share": round(sampling_s / step_s, 3),
                "step_s": round(step_s, 4),
                "goal": 0.9,
            }
        )
    )


if __name__ == "__main__":
    main()
