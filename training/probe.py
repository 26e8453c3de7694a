"""A downstream task loss measured during training (the OLMo ladder's first step): conditional bits per byte of
each task's continuation given its context, e.g. HumanEval's canonical solution given its prompt. Contexts are
cut from the left to fit the training window; the continuation is always scored whole."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from data_pipeline.humaneval import TaskPair
from data_pipeline.loader import IGNORE_INDEX


class TaskProbe:
    """`probe(module) -> {"probe/bpb", "probe/loss"}` over fixed (context, continuation) pairs."""

    def __init__(self, pairs: list[TaskPair], window: int, batch_size: int = 32) -> None:
        self.pairs = [p for p in pairs if len(p.continuation) < window]
        self.dropped = len(pairs) - len(self.pairs)  # continuations longer than the window
        self.window, self.batch_size = window, batch_size
        if not self.pairs:
            raise ValueError(
                f"no task continuation fits the {window}-token training window; raise train.seq_len or drop the probe"
            )

    def sequences(self) -> list[tuple[list[int], int]]:
        """(tokens, number of leading context tokens) per pair, at most `window` + 1 tokens."""
        out = []
        for pair in self.pairs:
            context = pair.context[-(self.window + 1 - len(pair.continuation)) :]
            out.append((context + pair.continuation, len(context)))
        return out

    @torch.no_grad()
    def __call__(self, module: nn.Module) -> dict[str, float]:
        device = next(module.parameters()).device
        nats, n_tokens = 0.0, 0
        sequences = self.sequences()
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            length = max(len(tokens) for tokens, _ in chunk) - 1
            inputs = torch.zeros(len(chunk), length, dtype=torch.long)
            targets = torch.full((len(chunk), length), IGNORE_INDEX, dtype=torch.long)
            for i, (tokens, n_context) in enumerate(chunk):
                seq = torch.tensor(tokens)
                inputs[i, : len(tokens) - 1] = seq[:-1]
                targets[i, n_context - 1 : len(tokens) - 1] = seq[n_context:]
            logits = module(inputs.to(device)).logits.float()
            nats += float(
                F.cross_entropy(
                    logits.flatten(0, 1),
                    targets.to(device).flatten(),
                    ignore_index=IGNORE_INDEX,
                    reduction="sum",
                )
            )
            n_tokens += int((targets != IGNORE_INDEX).sum())
        n_bytes = sum(p.n_bytes for p in self.pairs)
        return {
            "probe/bpb": nats / (math.log(2) * n_bytes),
            "probe/loss": nats / n_tokens,
            "probe/tasks": float(len(self.pairs)),
        }
