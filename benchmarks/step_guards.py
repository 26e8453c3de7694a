"""What the training loop's guards cost per step: the loss-spike detector (one all-reduced scalar per micro-batch
and a window's mean and deviation per step; its roll-back only acts on spikes), the hang watchdog (a timer armed
and cancelled per step), the straggler timing (two clock reads per micro-batch) and the stop-file check, against the
same loop with them off (`train.spike_window=0`, `rollback_spikes=0`, `hang_factor=0`, `straggler_window=0`), in
one run, one JSON line.

The model is the demo's (train_throughput.py's `demo` shape) in the plain-PyTorch engine on one repeated batch;
runs alternate, `--repeats` times each, and each run's wall time per step (logging included) counts (the best of
the repeats).
`overhead` = guarded / unguarded - 1 (goal <= 0.01).

    .venv/bin/python benchmarks/step_guards.py [--steps 200] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from train_throughput import SHAPES, batches  # this script's directory

from infra.tracking import NullTracker
from training.config import OptimConfig, TrainConfig
from training.engine import PlainEngine
from training.loop import LoopSetup, LoopState, train_loop
from training.model.transformer import Transformer


class Repeat:
    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def next_batch(self) -> Any:
        return self.batch

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


def median_step(guarded: bool, steps: int) -> float:
    cfg, seq, micro = SHAPES["demo"]()
    model = Transformer(cfg, seed=0)
    engine = PlainEngine(model, torch.optim.AdamW(model.parameters(), lr=1e-3), 1, grad_clip=1.0)
    (batch,) = batches(cfg, seq, micro, 1, torch.device("cpu"))
    off = {"spike_window": 0, "rollback_spikes": 0, "hang_factor": 0.0, "straggler_window": 0}
    guards = {} if guarded else off
    train = TrainConfig(
        seq_len=seq, micro_batch_size=micro, max_steps=steps, checkpoint_every=10**6, **guards
    )
    optim = OptimConfig(lr=1e-3, warmup_steps=0, schedule="constant")
    with tempfile.TemporaryDirectory() as run_dir:
        setup = LoopSetup(Path(run_dir), 0, 1, flops_per_token=1, peak_flops=1.0, meta={})
        start = time.perf_counter()
        train_loop(engine, Repeat(batch), None, train, optim, setup, NullTracker(), LoopState())
        return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    on, off = [], []
    for _ in range(args.repeats):
        on.append(median_step(True, args.steps))
        off.append(median_step(False, args.steps))
    print(
        json.dumps(
            {
                "benchmark": "step_guards",
                "step_s_guarded": min(on),
                "step_s_unguarded": min(off),
                "overhead": min(on) / min(off) - 1,
                "goal": "overhead <= 0.01",
            }
        )
    )


if __name__ == "__main__":
    main()
