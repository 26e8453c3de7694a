"""Held-out preference accuracy of any model: how often it gives the chosen answer a higher log-probability
than the rejected one (reference-free, so base, fine-tuned and preference-tuned models compare directly)."""

from __future__ import annotations

import torch

from data_pipeline.chat import chat_format
from data_pipeline.preference import Pair, encode_side, fit_to_context
from data_pipeline.sft import padded_rows
from evaluation.model_io import EvalModel
from training.stages.dpo import sequence_logps


@torch.no_grad()
def preference_metrics(em: EvalModel, pairs: list[Pair], batch_size: int) -> dict[str, float]:
    """`accuracy` (log π(chosen) > log π(rejected)), the mean log-probability margin, and how many pairs fit."""
    rows, fmt = [], chat_format(em.tokenizer_ref)
    for pair in pairs:
        sides = [
            fit_to_context(*encode_side(em.tokenizer, fmt, pair.prompt, r), em.max_len)
            for r in (pair.chosen, pair.rejected)
        ]
        if None not in sides:
            rows.append(sides)
    margins = []
    for start in range(0, len(rows), batch_size):
        chunk = [side for pair in rows[start : start + batch_size] for side in pair]  # chosen, rejected, ...
        width = max(len(ids) for ids, _ in chunk) - 1
        inputs, targets = padded_rows(chunk, width, em.tokenizer_ref.pad_id)
        logps, _ = sequence_logps(em.model(inputs).logits, targets)
        margins.append(logps[0::2] - logps[1::2])
    margin = torch.cat(margins) if margins else torch.zeros(0)
    return {
        "accuracy": float((margin > 0).float().mean()) if len(margin) else float("nan"),
        "logp_margin": float(margin.mean()) if len(margin) else float("nan"),
        "pairs": float(len(margin)),
    }
