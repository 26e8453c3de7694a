"""The policy-gradient math of group-relative RL (GRPO, RLOO), as TRL defines it, so numbers compare across tools.

Shapes: B completions in groups of G consecutive rows (one group per prompt); per-token tensors (B, T) over the
completion tokens, `mask` 1 on real completion tokens. `group_advantages` turns the rewards (B,) into advantages
(GRPO: the reward minus its group's mean, over the group's standard deviation; RLOO: minus the mean of the other
G-1 rewards, the leave-one-out baseline). `clipped_policy_loss` is PPO's clipped importance-weighted objective
with the k3 estimate of KL(π‖π_ref) per token (Schulman), normalised per sequence (`grpo`), per token over the
batch (`bnpo`) or by B x the maximum completion length (`dr_grpo`, Liu et al. 2025). RLOO, as TRL's
`RLOOTrainer` has it, clips whole completions' ratios instead (`sequence_policy_loss`) and charges the KL in the
reward (`sequence_kl`).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from training.model.cross_entropy import token_cross_entropy

LossType = Literal["grpo", "bnpo", "dr_grpo"]
EPS = 1e-4  # TRL's, in the advantages' denominator


def group_advantages(
    rewards: Tensor, group: int, baseline: Literal["grpo", "rloo"] = "grpo", scale: bool = True
) -> Tensor:
    """Advantages (B,) of rewards (B,) in groups of `group` consecutive rows. GRPO: (r − group mean), divided by
    (the group's sample standard deviation + 1e-4) when `scale`; RLOO: r − the mean of the group's other rewards,
    normalised over the batch when `scale` (TRL's `normalize_advantages`)."""
    grouped = rewards.view(-1, group)
    if baseline == "grpo":
        advantages = grouped - grouped.mean(dim=1, keepdim=True)
        if scale:
            advantages = advantages / (grouped.std(dim=1, keepdim=True) + EPS)
        return advantages.reshape(-1)
    others = (grouped.sum(dim=1, keepdim=True) - grouped) / (group - 1)
    advantages = (grouped - others).reshape(-1)
    return (advantages - advantages.mean()) / (advantages.std() + EPS) if scale else advantages


def clipped_policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    ref_logps: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    beta: float,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    loss_type: LossType = "grpo",
    max_completion_length: int | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss and its metrics: `kl` (mean per token, when `beta` > 0) and the clipped fractions."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    advantages = advantages.unsqueeze(1)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    metrics: dict[str, Tensor] = {}
    if beta != 0.0:
        assert ref_logps is not None, "a KL penalty needs the reference model's log-probabilities"
        kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1
        per_token = per_token + beta * kl
        metrics["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1.0)).detach()
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    else:
        assert max_completion_length is not None, "dr_grpo normalises by the maximum completion length"
        loss = (per_token * mask).sum() / (per_token.size(0) * max_completion_length)
    tokens = mask.sum().clamp(min=1.0)
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).to(mask.dtype)
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(mask.dtype)
    metrics["clip_ratio/low_mean"] = ((low * mask).sum() / tokens).detach()
    metrics["clip_ratio/high_mean"] = ((high * mask).sum() / tokens).detach()
    return loss, metrics


def sequence_policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> tuple[Tensor, dict[str, Tensor]]:
    """RLOO's loss (TRL's `RLOOTrainer._compute_loss`): the clipped objective on whole completions' log-probabilities
    (summed over their tokens), averaged over the completions; the KL penalty lives in the reward instead
    (`sequence_kl`)."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp((logps * mask).sum(1) - (old_logps * mask).sum(1))
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped * advantages).mean()
    low = ((ratio < 1 - epsilon_low) & (advantages < 0)).to(logps.dtype)
    high = ((ratio > 1 + epsilon_high) & (advantages > 0)).to(logps.dtype)
    return loss, {"clip_ratio/low_mean": low.mean().detach(), "clip_ratio/high_mean": high.mean().detach()}


def sequence_kl(old_logps: Tensor, ref_logps: Tensor, mask: Tensor) -> Tensor:
    """Each completion's KL to the reference as RLOO puts it in the reward: the first-order log-ratio
    log π_old − log π_ref summed over its tokens (Ahmadian et al. 2024), (B,)."""
    return ((old_logps - ref_logps) * mask.to(old_logps.dtype)).sum(-1)


def token_logps(logits: Tensor, targets: Tensor) -> Tensor:
    """Per-token log-probabilities (B, T) of `targets` under `logits` (B, T, V), 0 where a target is ignored."""
    return -token_cross_entropy(logits.flatten(0, 1), targets.flatten()).view(targets.shape)


def token_entropy(logits: Tensor) -> Tensor:
    """The policy's entropy (B, T) at each position, in nats."""
    logps = torch.log_softmax(logits.float(), dim=-1)
    return -(logps.exp() * logps).sum(-1)
