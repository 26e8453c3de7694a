"""Hang detection in the training loop, in a child process (the watchdog ends the process it guards): a step that
hangs is reported within its limit with every thread's stack, and the process exits 3 so the attempt restarts."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from training.watchdog import EXIT_HUNG

ROOT = Path(__file__).resolve().parents[2]
HANGS_AT_STEP_8 = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from data_pipeline.loader import Batch
    from infra.tracking import NullTracker
    from training.config import OptimConfig, TrainConfig
    from training.engine import PlainEngine
    from training.loop import LoopSetup, LoopState, train_loop
    from training.model.config import ModelConfig
    from training.model.transformer import Transformer
    from training.objective import TokenCrossEntropy

    class Repeat:
        def __init__(self, batch): self.batch, self.position = batch, 0
        def next_batch(self): return self.batch
        def state_dict(self): return {}
        def load_state_dict(self, state): pass

    class HangsAt:
        def __init__(self, call): self.call, self.calls, self.inner = call, 0, TokenCrossEntropy()
        def units(self, batch): return self.inner.units(batch)
        def __call__(self, engine, batch):
            self.calls += 1
            if self.calls == self.call:
                time.sleep(120)  # a collective that never returns
            return self.inner(engine, batch)

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16)
    model = Transformer(cfg, seed=1)
    engine = PlainEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, grad_clip=0.0)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    train = TrainConfig(seq_len=8, micro_batch_size=2, max_steps=20, hang_factor=5.0, hang_min_seconds=1.0)
    optim = OptimConfig(lr=0.1, warmup_steps=0, schedule="constant", grad_clip=0.0)
    run_dir = Path(sys.argv[1])
    setup = LoopSetup(run_dir=run_dir, rank=0, world_size=1, flops_per_token=1, peak_flops=1.0, meta={})
    train_loop(engine, Repeat(Batch(ids, ids)), None, train, optim, setup, NullTracker(), LoopState(), HangsAt(8))
    """
)


def test_a_hung_step_is_reported_with_the_stacks_and_ends_the_attempt(tmp_path: Path) -> None:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", HANGS_AT_STEP_8, str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=100,
    )
    assert time.monotonic() - start < 60  # not the 120 s the step would have slept
    assert done.returncode == EXIT_HUNG, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("lmforge:")]
    assert line.startswith("lmforge: step 8 hung: still running after 1.0 s") and "hang-rank0.txt" in line
    stacks = (tmp_path / "hang-rank0.txt").read_text()
    assert "step 8 still running after 1.0 s" in stacks and "in __call__" in stacks  # where it hung
    assert [s for s in (tmp_path / "metrics.jsonl").read_text().splitlines()][-1].startswith('{"step": 7')
