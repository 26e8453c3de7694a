"""Reinforcement learning against rewards (GRPO, RLOO), as a stage over the one training lifecycle.

`run_rl(spec, base, prompts, reward_model) -> TrainedModel`. Each micro-batch is a batch of prompts: the current
policy samples `group_size` completions of each with the KV-cache sampler (on the global RNG, which checkpoints
save, so a resumed run samples what the uninterrupted one would), the weighted reward functions
(`training/rewards.py`) score them, advantages are formed within each prompt's group (a group never spans ranks),
and the loss is the clipped policy-gradient loss with a KL penalty to the frozen base (`training/policy_gradient.py`,
TRL's definitions: GRPO's per-token loss with the KL in it, or RLOO's per-completion loss with the KL in the reward). One optimiser step per generation, so the old policy is the current one (TRL's default).
Logged per step: reward mean/std per function, KL, clip fractions, entropy, completion lengths, seconds spent
sampling and scoring (of the step's `perf/step_s`). Afterwards, on held-out prompts: the reward of the base and of the trained policy, the KL
between them, a few completions of each (`samples.json`) and reward against KL over the steps (`reward_kl.png`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from data_pipeline.loader import IGNORE_INDEX, Batch, SampledLoader
from data_pipeline.prompts import Prompt, PromptBatch, PromptLoader, PromptManifest
from data_pipeline.sft import padded_rows
from data_pipeline.sources import DataError
from infra.steps import Artifact
from infra.storage import atomic_write_json
from infra.tracking import Tracker
from training.bootstrap import mean_interval
from training.config import RLSpec
from training.engine import Engine
from training.loop import Batches
from training.model.hf_interop import load_export, load_hf_config
from training.model.sampling import generate, left_padded
from training.objective import Outcome
from training.policy_gradient import (
    clipped_policy_loss,
    group_advantages,
    sequence_kl,
    sequence_policy_loss,
    token_entropy,
    token_logps,
)
from training.rewards import Rewards, Sample, check_terms
from training.stages.dpo import policy_model
from training.stages.lifecycle import (
    Progress,
    TrainedModel,
    TrainingJob,
    read_metrics,
    run_training_stage,
)
from training.stages.tuning import TunedFromBase, check_tokenizer, export_tuned

SHOWN = 4  # held-out prompts whose first completion, the base's and the trained model's, samples.json keeps


@dataclass(frozen=True)
class Rollout:
    """Sampled completions and the rows that score them: prompt + completion, targets on the completion only."""

    samples: list[Sample]
    batch: Batch
    clipped: torch.Tensor  # (B,) 1 where a completion reached max_new_tokens without ending its turn


@torch.no_grad()
def rollout(
    policy: nn.Module,
    batch: PromptBatch,
    group: int,
    spec: RLSpec,
    tokenizer: Tokenizer,
    end_of_turn: int,
    pad_id: int,
    generator: torch.Generator | None = None,
) -> Rollout:
    """`group` completions of each prompt of `batch`, sampled from `policy` (the global RNG unless `generator`):
    all prompts' groups in one left-padded batch (`left_padded`), one prompt's group at a time for models without
    softmax attention (no padding there)."""
    device = next(policy.parameters()).device
    # each prompt's text as the policy sees it, decoded once for its group (what `module:function` rewards read)
    texts = [tokenizer.decode(list(ids), skip_special_tokens=False) for ids in batch.ids]
    completions = [
        (ids, p, text)
        for ids, p, text in zip(batch.ids, batch.prompts, texts, strict=True)
        for _ in range(group)
    ]
    per_call = len(completions) if policy.cfg.attention == "softmax" else group
    samples, clipped = [], []
    for start in range(0, len(completions), per_call):
        chunk = completions[start : start + per_call]
        prompts, padding = left_padded([ids for ids, _, _ in chunk], device)
        tokens = generate(
            policy,
            prompts,
            spec.max_new_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            eos_id=end_of_turn,
            generator=generator,
            padding=padding,
        )
        for (ids, prompt, prompt_text), row in zip(
            chunk, tokens[:, prompts.shape[1] :].tolist(), strict=True
        ):
            ended = end_of_turn in row
            completion = row[: row.index(end_of_turn) + 1] if ended else row
            text = tokenizer.decode(completion, skip_special_tokens=True)
            samples.append(Sample(prompt, list(ids), completion, text, prompt_text))
            clipped.append(float(not ended))
    rows = [
        (
            np.array(s.prompt_ids + s.completion_ids),
            np.array([0] * len(s.prompt_ids) + [1] * len(s.completion_ids)),
        )
        for s in samples
    ]
    inputs, targets = padded_rows(rows, max(len(ids) for ids, _ in rows) - 1, pad_id)
    return Rollout(samples, Batch(inputs, targets), torch.tensor(clipped))


class RLObjective:
    """The loop's objective for prompt batches: sample, score, group-relative advantages, clipped loss + KL."""

    def __init__(
        self,
        spec: RLSpec,
        rewards: Rewards,
        reference: nn.Module | None,
        tokenizer: Tokenizer,
        end_of_turn: int,
        pad_id: int,
    ) -> None:
        self.spec, self.rewards, self.reference = spec, rewards, reference
        self.tokenizer, self.end_of_turn, self.pad_id = tokenizer, end_of_turn, pad_id

    def units(self, batch: PromptBatch) -> int:
        return len(batch.ids) * self.spec.group_size

    def __call__(self, engine: Engine, batch: PromptBatch) -> Outcome:
        spec = self.spec
        started = time.perf_counter()
        engine.train(False)
        sampled = rollout(
            engine.module, batch, spec.group_size, spec, self.tokenizer, self.end_of_turn, self.pad_id
        )
        engine.train(True)
        scoring = time.perf_counter()
        scores = self.rewards.score(sampled.samples)
        scored = time.perf_counter()
        out = engine.forward(sampled.batch, with_loss=False)
        targets = sampled.batch.targets.to(engine.device)
        mask = targets != IGNORE_INDEX
        logps = token_logps(out.logits, targets)
        reference = None
        if spec.beta:
            with torch.no_grad():
                inputs = sampled.batch.inputs.to(engine.device)
                reference = token_logps(self.reference_of(engine)(inputs).logits, targets)
        rewards = scores.total.float().to(engine.device)
        metrics: dict[str, torch.Tensor] = {}
        if (
            spec.baseline == "rloo"
        ):  # TRL's RLOO: the KL is charged in the reward, the ratio is the completion's
            if reference is not None:
                kl = sequence_kl(logps.detach(), reference, mask)
                rewards = rewards - spec.beta * kl
                metrics["kl"] = kl.sum() / mask.sum().clamp(min=1)
            advantages = group_advantages(rewards, spec.group_size, "rloo", spec.scale_rewards)
            loss, clip = sequence_policy_loss(
                logps, logps.detach(), advantages, mask, spec.epsilon, spec.epsilon
            )
        else:
            advantages = group_advantages(rewards, spec.group_size, "grpo", spec.scale_rewards)
            loss, clip = clipped_policy_loss(
                logps,
                logps.detach(),
                reference,
                advantages,
                mask,
                spec.beta,
                spec.epsilon,
                spec.epsilon,
                spec.loss_type,
                spec.max_new_tokens,
            )
        with torch.no_grad():
            entropy = (token_entropy(out.logits) * mask).sum() / mask.sum().clamp(min=1)
        metrics |= clip | {name: value.float() for name, value in scores.metrics().items()}
        metrics |= {
            "entropy": entropy,
            "completions/mean_length": mask.sum(-1).float().mean(),
            "completions/clipped_ratio": sampled.clipped.mean(),
            "perf/sampling_s": torch.tensor(scoring - started),
            "perf/scoring_s": torch.tensor(scored - scoring),
        }
        return Outcome(loss, out.aux_loss, out.router_stats, metrics)

    def reference_of(self, engine: Engine) -> nn.Module:
        """The frozen base, on the policy's device and in its dtype (so the KL measures weights, not rounding)."""
        assert self.reference is not None, "a KL penalty needs the reference model"
        weight = next(engine.module.parameters())
        return self.reference.to(device=weight.device, dtype=weight.dtype)


@torch.no_grad()
def heldout_rollout(
    policy: nn.Module,
    records: Sequence[tuple[Prompt, list[int]]],
    spec: RLSpec,
    tokenizer: Tokenizer,
    end_of_turn: int,
    pad_id: int,
) -> Rollout:
    """`rl.eval_samples` completions per held-out prompt from `policy` (each prompt's together), on a fixed seed
    (the same draws for any model)."""
    policy.eval()
    generator = torch.Generator().manual_seed(spec.train.seed)
    batch = PromptBatch([ids for _, ids in records], [prompt for prompt, _ in records])
    return rollout(policy, batch, spec.eval_samples, spec, tokenizer, end_of_turn, pad_id, generator)


def reward_gain(before: np.ndarray, after: np.ndarray, samples: int) -> dict[str, float]:
    """The held-out reward's gain (after minus before; each prompt's `samples` completions together, in order)
    and its 95% interval over the prompts resampled: paired, so what a prompt's difficulty adds to both cancels."""
    diff = np.asarray(after, dtype=float) - np.asarray(before, dtype=float)
    low, high = mean_interval(diff, np.arange(diff.size) // samples)
    return {
        "rl/heldout_reward_gain": float(diff.mean()),
        "rl/heldout_reward_gain_low": low,
        "rl/heldout_reward_gain_high": high,
    }


@torch.no_grad()
def kl_on_samples(policy: nn.Module, reference: nn.Module, sampled: Rollout) -> float:
    """KL(policy ‖ reference) per completion token: the mean log-ratio on the policy's own samples."""
    inputs, targets = sampled.batch
    mask = targets != IGNORE_INDEX
    log_ratio = token_logps(policy(inputs).logits, targets) - token_logps(reference(inputs).logits, targets)
    return float((log_ratio * mask).sum() / mask.sum().clamp(min=1))


def plot_reward_and_kl(run_dir: Path) -> Path:
    """Reward and KL over the steps (two axes), from the run's metrics: where reward hacking shows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [m for m in read_metrics(run_dir) if "rewards/mean" in m]
    steps = [m["step"] for m in records]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(steps, [m["rewards/mean"] for m in records], color="tab:blue", label="mean reward")
    left.set_xlabel("optimiser step")
    left.set_ylabel("mean reward (weighted sum)")
    right = left.twinx()
    right.plot(steps, [m.get("kl", float("nan")) for m in records], color="tab:red", label="KL to the base")
    right.set_ylabel("KL(policy ‖ base) per token (nats)")
    lines = left.get_lines() + right.get_lines()
    left.legend(lines, [line.get_label() for line in lines], loc="upper left")
    left.set_title("RL: reward against KL to the base")
    fig.tight_layout()
    path = run_dir / "reward_kl.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class ReinforcementLearning(TunedFromBase):
    name = "rl"
    # 2: every prompt's group sampled in one left-padded batch (other draws); 3: `eval_samples` a held-out prompt
    version = 3

    def check(self, spec: RLSpec, inputs: Mapping[str, Artifact]) -> None:
        base, prompts = inputs["base"], inputs["data"]
        assert isinstance(base, TrainedModel) and isinstance(prompts, PromptManifest)
        check_tokenizer(base, prompts, "prompts")
        if prompts.max_prompt_tokens + spec.max_new_tokens > spec.train.seq_len:
            raise DataError(
                f"prompts of up to {prompts.max_prompt_tokens} tokens plus rl.max_new_tokens={spec.max_new_tokens} "
                f"exceed rl.train.seq_len={spec.train.seq_len}; encode the prompts for this length"
            )
        context = load_hf_config(base.hf_export).max_seq_len
        if spec.train.seq_len > context:
            raise DataError(
                f"rl.train.seq_len={spec.train.seq_len} exceeds the base model's context ({context}); lower it"
            )
        if spec.parallel.ep_size > 1 or spec.parallel.zero_stage > 2:
            raise DataError(
                "rl samples from each rank's own copy of the policy: use parallel.ep_size=1 and parallel.zero_stage "
                f"0-2 (got ep_size={spec.parallel.ep_size}, zero_stage={spec.parallel.zero_stage})"
            )
        reward_model = inputs.get("reward_model")
        check_terms(spec.rewards, reward_model.hf_export if isinstance(reward_model, TrainedModel) else None)

    def run_name(self, spec: RLSpec) -> str:
        return f"{spec.name}-{spec.baseline}-{spec.method}"

    def tags(self, spec: RLSpec, inputs: Mapping[str, Artifact]) -> dict[str, str]:
        tags = {**super().tags(spec, inputs), "lmforge.method": spec.method}
        reward_model = inputs.get("reward_model")
        if isinstance(reward_model, TrainedModel):
            tags["lmforge.reward_model_run_id"] = str(reward_model.mlflow_run_id)
        return tags

    def build_model(self, job: TrainingJob) -> nn.Module:
        return policy_model(job.inputs["base"], job.spec)

    def loaders(self, job: TrainingJob, rank: int, world: int) -> tuple[Batches, SampledLoader | None]:
        spec = job.spec
        train = PromptLoader(
            job.inputs["data"],
            "train",
            batch_size=spec.train.micro_batch_size,
            seed=spec.train.seed,
            rank=rank,
            world_size=world,
            accumulation=spec.train.grad_accum_steps(world),
        )
        return train, None

    def rewards(self, job: TrainingJob) -> Rewards:
        reward_model = job.inputs.get("reward_model")
        export = reward_model.hf_export if isinstance(reward_model, TrainedModel) else None
        return Rewards(job.spec.rewards, export, job.spec.train.seq_len)

    def objective(self, job: TrainingJob) -> RLObjective:
        base, prompts = job.inputs["base"], job.inputs["data"]
        reference = load_export(base.hf_export).eval().requires_grad_(False) if job.spec.beta else None
        tokenizer = Tokenizer.from_file(str(Path(base.hf_export) / "tokenizer.json"))
        return RLObjective(
            job.spec, self.rewards(job), reference, tokenizer, prompts.end_of_turn_id, prompts.pad_id
        )

    def finalize(self, job: TrainingJob, final: Path, tracker: Tracker) -> TrainedModel:
        """The verified export; held-out reward before and after, the KL between them, samples and a plot."""
        spec: RLSpec = job.spec
        base: TrainedModel = job.inputs["base"]
        prompts: PromptManifest = job.inputs["data"]
        reference = load_export(base.hf_export)
        tuned = export_tuned(job, final, load_export(base.hf_export), spec.method, spec.lora, base.hf_export)
        records = prompts.records("heldout")[: spec.eval_prompts]
        tokenizer = Tokenizer.from_file(str(Path(base.hf_export) / "tokenizer.json"))
        rewards, common = self.rewards(job), (tokenizer, prompts.end_of_turn_id, prompts.pad_id)
        base_sampled = heldout_rollout(reference, records, spec, *common)
        sampled = heldout_rollout(tuned.model, records, spec, *common)
        before, after = rewards.score(base_sampled.samples), rewards.score(sampled.samples)
        trained = [m for m in read_metrics(job.run_dir) if "rewards/mean" in m]
        summary = {
            **tuned.counts("rl"),
            "rl/heldout_reward_before": float(before.total.mean()),
            "rl/heldout_reward_after": float(after.total.mean()),
            **reward_gain(before.total, after.total, spec.eval_samples),
            **{f"rl/heldout_{name}_before": float(v.mean()) for name, v in before.by_function.items()},
            **{f"rl/heldout_{name}_after": float(v.mean()) for name, v in after.by_function.items()},
            "rl/heldout_kl": kl_on_samples(tuned.model, reference, sampled),
            "rl/train_reward_first": trained[0]["rewards/mean"],
            "rl/train_reward_last": trained[-1]["rewards/mean"],
            "export/max_abs_logit_diff": tuned.verification["max_abs_logit_diff"],
        }
        shown = [
            {"prompt": s.prompt.messages[-1]["content"], "base": b.text, "trained": s.text}
            for b, s in zip(
                base_sampled.samples[:: spec.eval_samples][:SHOWN],
                sampled.samples[:: spec.eval_samples][:SHOWN],
                strict=True,
            )
        ]
        atomic_write_json(job.run_dir / "samples.json", shown)
        atomic_write_json(job.run_dir / "rl_summary.json", summary)
        tracker.log_artifact(job.run_dir / "samples.json", "report")
        tracker.log_artifact(plot_reward_and_kl(job.run_dir), "report")
        kind = "rl-lora" if spec.method == "lora" else "rl-full"
        return tuned.trained_model(
            job,
            final,
            tracker,
            kind,
            summary,
            final_val_loss=None,
            tokenizer_digest=base.tokenizer_digest,
            base_run_dir=base.path,
        )


REINFORCEMENT_LEARNING = ReinforcementLearning()


def run_rl(
    spec: RLSpec,
    base: TrainedModel,
    prompts: PromptManifest,
    reward_model: TrainedModel | None = None,
    progress: Progress | None = None,
) -> TrainedModel:
    """RL of `base` on `prompts` against `spec.rewards` (the reward model's when they use it)."""
    inputs: dict[str, Artifact] = {"base": base, "data": prompts}
    if reward_model is not None:
        inputs["reward_model"] = reward_model
    return run_training_stage(REINFORCEMENT_LEARNING, spec, inputs, progress)
