"""The policy-gradient math against TRL (a test-only extra): the clipped GRPO loss for each normalisation equals
`GRPOTrainer._compute_loss` on the same log-probabilities, old and reference log-probabilities, advantages and
mask, with and without the KL penalty; the advantages equal worked examples of TRL's GRPO and RLOO formulas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from training.policy_gradient import clipped_policy_loss, group_advantages, sequence_kl, sequence_policy_loss

pytestmark = [pytest.mark.parity]


class _Lists(dict):
    def __missing__(self, key: str) -> list:
        self[key] = []
        return self[key]


def trl_loss(logps, old, ref, advantages, mask, beta, loss_type, max_len, eps=(0.2, 0.28)) -> float:
    """`GRPOTrainer._compute_loss` with the per-token log-probabilities handed in (what the model would give)."""
    from trl import GRPOTrainer

    identity = SimpleNamespace(
        gather=lambda x: x.reshape(-1),
        gather_for_metrics=lambda x: x,
        reduce=lambda x, reduction: x,
        sync_gradients=True,
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
        loss_type=loss_type,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_len,
        _entropy_bonus_enabled=False,
        _metrics={"train": _Lists(), "eval": _Lists()},
        accelerator=identity,
    )
    inputs = {
        "prompt_ids": torch.zeros(logps.shape[0], 2, dtype=torch.long),
        "prompt_mask": torch.ones(logps.shape[0], 2, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
    }
    return float(GRPOTrainer._compute_loss(trainer, None, inputs))


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_clipped_loss_equals_trls(loss_type: str, beta: float, generator: torch.Generator) -> None:
    b, t = 6, 9
    logps = -torch.rand(b, t, generator=generator, dtype=torch.float64) * 3
    old = (
        logps + torch.randn(b, t, generator=generator, dtype=torch.float64) * 0.3
    )  # ratios outside the clip too
    ref = logps + torch.randn(b, t, generator=generator, dtype=torch.float64) * 0.2
    advantages = torch.randn(b, generator=generator, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, 5:] = 0  # completions of different lengths
    mask[3, 2:] = 0
    ours, metrics = clipped_policy_loss(logps, old, ref, advantages, mask, beta, 0.2, 0.28, loss_type, t + 3)
    assert float(ours) == pytest.approx(
        trl_loss(logps, old, ref, advantages, mask, beta, loss_type, t + 3), rel=1e-6
    )
    assert 0 < float(metrics["clip_ratio/low_mean"]) + float(metrics["clip_ratio/high_mean"]) < 1
    assert ("kl" in metrics) == (beta != 0.0)


def test_grpo_and_rloo_advantages_on_a_worked_example() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 5.0])  # two prompts, four completions each
    # group 1: mean 0.5, sample std sqrt(1/3); group 2: mean 2.75, sample std 1.5
    grpo = group_advantages(rewards, 4, "grpo")
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25]) / torch.tensor(
        [3**-0.5] * 4 + [1.5] * 4
    ).add(1e-4)
    torch.testing.assert_close(grpo, expected)
    # RLOO: r minus the mean of the other three: group 1 (1 - 1/3, 0 - 2/3, ...), group 2 (2 - 3, ..., 5 - 2)
    rloo = group_advantages(rewards, 4, "rloo", scale=False)
    torch.testing.assert_close(rloo, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, -1.0, -1.0, -1.0, 3.0]))
    scaled = group_advantages(rewards, 4, "rloo")
    torch.testing.assert_close(scaled, (rloo - rloo.mean()) / (rloo.std() + 1e-4))
    assert group_advantages(torch.ones(4), 4).abs().max() == 0  # a group that all agrees teaches nothing


def test_rloos_loss_equals_trls(generator: torch.Generator) -> None:
    """The whole-completion clipped loss equals `RLOOTrainer._compute_loss` on the same log-probabilities."""
    from trl import RLOOTrainer

    b, t = 6, 9
    logps = -torch.rand(b, t, generator=generator, dtype=torch.float64) * 3
    old = logps + torch.randn(b, t, generator=generator, dtype=torch.float64) * 0.1
    advantages = torch.randn(b, generator=generator, dtype=torch.float64)
    mask = torch.ones(b, t, dtype=torch.float64)
    mask[0, 5:] = 0
    mask[3, 2:] = 0
    identity = SimpleNamespace(
        gather=lambda x: x.reshape(-1), gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x
    )
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False,
        epsilon_low=0.2,
        epsilon_high=0.28,
        model=SimpleNamespace(training=True),
        _metrics={"train": _Lists(), "eval": _Lists()},
        accelerator=identity,
    )
    inputs = {
        "prompt_ids": torch.zeros(b, 2, dtype=torch.long),
        "prompt_mask": torch.ones(b, 2, dtype=torch.long),
        "completion_ids": torch.zeros_like(mask, dtype=torch.long),
        "completion_mask": mask,
        "advantages": advantages,
        "old_logps": (old * mask).sum(1),
    }
    theirs = float(RLOOTrainer._compute_loss(trainer, None, inputs))
    ours, metrics = sequence_policy_loss(logps, old, advantages, mask, 0.2, 0.28)
    assert float(ours) == pytest.approx(theirs, rel=1e-6)
    assert float(metrics["clip_ratio/low_mean"]) == pytest.approx(
        trainer._metrics["train"]["clip_ratio/low_mean"][0]
    )


def test_rloo_charges_the_kl_in_the_reward() -> None:
    """TRL's RLOO: reward − β·Σ_t(log π_old − log π_ref) over the completion's tokens, before the baseline."""
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, -1.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor(
        [[1, 1, 0], [1, 1, 1]], dtype=torch.float64
    )  # the first completion ended after 2 tokens
    torch.testing.assert_close(sequence_kl(old, ref, mask), torch.tensor([0.5, 0.0], dtype=torch.float64))
