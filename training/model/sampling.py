"""Autoregressive generation with a KV cache: greedy, temperature, top-k and nucleus (top-p) sampling.

References: Fan et al. 2018 (top-k sampling); Holtzman et al. 2020 (nucleus sampling).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from training.model.transformer import Transformer


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set logits (B, V) outside the top-k and outside the smallest set with mass >= top_p to -inf."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        drop_sorted = (
            sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        )  # keeps the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def left_padded(
    prompts: Sequence[list[int]], device: torch.device | str | None = None
) -> tuple[Tensor, Tensor | None]:
    """Prompts of any lengths as one (B, longest) batch, each left-padded with its own first token, and each row's
    padding for `generate` (None when no row is padded)."""
    width = max(len(ids) for ids in prompts)
    ids = torch.tensor([[row[0]] * (width - len(row)) + row for row in prompts], device=device)
    padding = torch.tensor([width - len(row) for row in prompts], device=device)
    return ids, padding if bool(padding.any()) else None


def greedy_each(
    model: Transformer,
    prompts: Sequence[list[int]],
    budgets: Sequence[int],
    eos_id: int | None,
    batch_size: int = 16,
) -> list[list[int]]:
    """Each prompt's greedy continuation of at most its budget's tokens, cut before `eos_id`, in the prompts' order:
    `batch_size` prompts at a time, longest first, left-padded (`left_padded`), a batch closed where the next
    prompt's budget would not fit beside its longest in the context. The same ids as one prompt at a time, but where
    two tokens' logits tie to float rounding (a batch's GEMMs may round differently); models without softmax
    attention go one prompt at a time (no padding there)."""
    limit = model.cfg.max_seq_len
    for ids, budget in zip(prompts, budgets, strict=True):
        if not ids or budget < 1 or len(ids) + budget > limit:
            raise ValueError(f"a prompt of {len(ids)} tokens and {budget} new ones do not fit in {limit}")
    size = batch_size if model.cfg.attention == "softmax" else 1
    results: list[list[int]] = [[] for _ in prompts]
    batches: list[list[int]] = []
    for i in sorted(range(len(prompts)), key=lambda i: -len(prompts[i])):
        batch = batches[-1] if batches else []
        longest = len(prompts[batch[0]]) if batch else 0
        if not batch or len(batch) == size or longest + max(budgets[j] for j in (*batch, i)) > limit:
            batches.append([i])
        else:
            batch.append(i)
    with torch.inference_mode():
        for batch in batches:
            ids, padding = left_padded([prompts[i] for i in batch])
            out = generate(model, ids, max(budgets[i] for i in batch), eos_id=eos_id, padding=padding)
            for row, i in enumerate(batch):
                results[i] = until_eos(out[row, ids.shape[1] : ids.shape[1] + budgets[i]].tolist(), eos_id)
    return results


def until_eos(ids: list[int], eos_id: int | None) -> list[int]:
    """ids up to (not including) the first `eos_id`."""
    return ids[: ids.index(eos_id)] if eos_id is not None and eos_id in ids else ids


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    padding: Tensor | None = None,
) -> Tensor:
    """prompt (B, T) -> (B, T + n) with n <= max_new_tokens; temperature 0 is greedy. `padding` (B,): prompts of
    different lengths in one batch, each row's left-padded by that many positions (any token: never attended to;
    softmax attention, with the cache).

    Without the cache every step recomputes the whole prefix, which is the reference the cached path is tested
    against. Generation stops early once every row has produced `eos_id`.
    """
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 means greedy)")
    total = prompt.shape[1] + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({prompt.shape[1]}) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
            f"model.max_seq_len={model.cfg.max_seq_len}; shorten the prompt or generate fewer tokens"
        )
    if padding is not None and not use_cache:
        raise ValueError("left-padded prompts are generated with the cache (use_cache=True)")
    cache = model.new_cache(prompt.shape[0], total, padding) if use_cache else None
    tokens = prompt
    step_input = prompt
    finished = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    for _ in range(max_new_tokens):
        logits = model(step_input if use_cache else tokens, cache=cache).logits[:, -1, :].float()  # (B, V)
        if temperature == 0.0:
            next_token = logits.argmax(dim=-1, keepdim=True)
        else:
            probs = filter_logits(logits / temperature, top_k, top_p).softmax(dim=-1)
            next_token = torch.multinomial(probs, 1, generator=generator)
        if eos_id is not None:
            next_token = next_token.masked_fill(finished[:, None], eos_id)
            finished |= next_token.squeeze(1) == eos_id
        tokens = torch.cat([tokens, next_token], dim=1)
        step_input = next_token
        if eos_id is not None and bool(finished.all()):
            break
    return tokens
