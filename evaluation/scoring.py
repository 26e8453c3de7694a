"""Batched log-likelihood scoring and text generation: what every evaluation (held-out text, tasks, the
lm-eval adapter) is built from. Runs under `torch.inference_mode`, longest requests first so batches pad little.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training.model.sampling import generate, greedy_each, until_eos
from training.model.transformer import Transformer


@dataclass(frozen=True)
class Scored:
    """Log-probability of a continuation given its context, and whether greedy decoding would produce it."""

    logprob: float
    greedy: bool
    n_tokens: int
    truncated: bool  # the context was cut from the left to fit the model's context window


def score_continuations(
    model: Transformer, requests: Sequence[tuple[list[int], list[int]]], batch_size: int = 16
) -> list[Scored]:
    """Score each (context ids, continuation ids); the context must hold at least one token."""
    limit = model.cfg.max_seq_len + 1
    prepared = []
    for context, continuation in requests:
        if not context or not continuation:
            raise ValueError("score_continuations needs a non-empty context and continuation")
        sequence = (context + continuation)[-limit:]
        n_cont = min(len(continuation), len(sequence) - 1)
        prepared.append((sequence, n_cont, len(context) + len(continuation) > limit))
    results: list[Scored | None] = [None] * len(prepared)
    order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))
    device = model.lm_head.weight.device
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            width = max(len(prepared[i][0]) for i in chunk) - 1
            tokens = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, i in enumerate(chunk):
                seq = prepared[i][0]
                tokens[row, : len(seq) - 1] = torch.tensor(seq[:-1])
            logits = model(tokens.to(device)).logits
            for row, i in enumerate(chunk):
                seq, n_cont, truncated = prepared[i]
                end = len(seq) - 1
                scores = F.log_softmax(logits[row, end - n_cont : end].float(), dim=-1)
                target = torch.tensor(seq[-n_cont:], device=device)
                logprob = float(scores.gather(1, target[:, None]).sum())
                greedy = bool((scores.argmax(-1) == target).all())
                results[i] = Scored(logprob, greedy, n_cont, truncated)
    return [r for r in results if r is not None]


def rolling_windows(ids: list[int], start_id: int, window: int) -> list[tuple[list[int], list[int]]]:
    """Split a document into scoring requests that predict every token once: [start] + ids, in windows."""
    seq = [start_id, *ids]
    return [(seq[i : i + 1], seq[i + 1 : i + 1 + window]) for i in range(0, len(seq) - 1, window)]


def generate_greedy(
    model: Transformer,
    prompts: Sequence[list[int]],
    max_new_tokens: int | Sequence[int],
    eos_id: int | None,
    batch_size: int = 16,
) -> list[tuple[list[int], bool]]:
    """`generate_text`'s greedy continuation of each prompt (cut from the left to leave room for its budget: one
    `max_new_tokens` for all, or one each) and whether it was cut, `batch_size` prompts at a time (`greedy_each`),
    in the prompts' order."""
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    cut = [ids[-_room(model, budget) :] for ids, budget in zip(prompts, budgets, strict=True)]
    new = greedy_each(model, cut, budgets, eos_id, batch_size)
    return [(ids, len(p) > len(c)) for ids, p, c in zip(new, prompts, cut, strict=True)]


def _room(model: Transformer, max_new_tokens: int) -> int:
    """The longest prompt that leaves room for `max_new_tokens` in the model's context."""
    room = model.cfg.max_seq_len - max_new_tokens
    if room < 1:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in {model.cfg.max_seq_len} tokens"
        )
    return room


def generate_text(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    eos_id: int | None,
    temperature: float = 0.0,
    seed: int = 0,
) -> tuple[list[int], bool]:
    """Greedy (temperature 0) or sampled continuation ids, and whether the prompt was cut to fit the context."""
    room = _room(model, max_new_tokens)
    truncated = len(prompt_ids) > room
    ids = torch.tensor([prompt_ids[-room:]])
    generator = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        out = generate(
            model,
            ids,
            max_new_tokens,
            temperature=temperature,
            top_p=0.95 if temperature > 0 else None,
            eos_id=eos_id,
            generator=generator,
        )
    return until_eos(out[0, ids.shape[1] :].tolist(), eos_id), truncated
