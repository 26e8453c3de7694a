"""Reward modelling as a stage over the one training lifecycle.

`run_reward_model(spec, base, data) -> TrainedModel`: the base's decoder (by default the fine-tuned model's)
with a scalar head learns from the preference pairs the DPO stage derives, with the Bradley–Terry loss
(`training/model/reward.py`). Logged per step like TRL's `RewardTrainer` (`rewards/chosen`, `rewards/rejected`,
`rewards/margins`, `rewards/accuracies`); afterwards, on the held-out pairs: pairwise accuracy, the mean reward
margin, and the correlation of each response's reward with its loss under the base language model. The run's
export is a Hugging Face sequence-classification model (`kind` "reward").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from data_pipeline.loader import SampledLoader
from data_pipeline.preference import PairBatch, PreferenceLoader, PreferenceManifest, preference_loaders
from infra.steps import Artifact
from infra.storage import atomic_write_json
from infra.tracking import Tracker
from training.config import RewardModelSpec
from training.engine import Engine
from training.loop import Batches
from training.model.hf_interop import load_export
from training.model.reward import RewardModel, bradley_terry, export_reward_model
from training.model.transformer import Transformer
from training.objective import Outcome
from training.stages.dpo import sequence_logps
from training.stages.lifecycle import (
    Progress,
    TrainedModel,
    TrainingJob,
    run_training_stage,
    trained_model,
    val_losses,
)
from training.stages.tuning import TunedFromBase, check_examples


@dataclass(frozen=True)
class RewardObjective:
    """The loop's objective for pair batches: Bradley–Terry over (chosen, rejected) rewards, TRL's metrics."""

    centring: float

    def units(self, batch: PairBatch) -> int:
        return batch.n_pairs

    def __call__(self, engine: Engine, batch: PairBatch) -> Outcome:
        out = engine.forward(batch, with_loss=False)
        chosen, rejected = out.logits.float().squeeze(-1).chunk(2)
        loss = bradley_terry(chosen, rejected, centring=self.centring)
        chosen, rejected = chosen.detach(), rejected.detach()
        metrics = {
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/margins": (chosen - rejected).mean(),
            "rewards/accuracies": (chosen > rejected).float().mean(),
        }
        return Outcome(loss, out.aux_loss, out.router_stats, metrics)


def reward_model(base: TrainedModel, pad_id: int) -> RewardModel:
    """The base's verified export (its decoder) with a fresh scalar head, in fp32."""
    return RewardModel(load_export(base.hf_export), pad_id).train()


@torch.no_grad()
def heldout_scores(
    model: RewardModel, lm: nn.Module, data: PreferenceManifest, limit: int, batch_size: int = 16
) -> dict[str, float]:
    """Held-out pairs under the trained reward model: pairwise accuracy, mean reward margin, and the Pearson
    correlation of each response's reward with its mean token loss under the base language model `lm`."""
    loader = PreferenceLoader(data, "heldout", batch_size=1, shuffle=False)
    scored = PreferenceLoader(data, "heldout", batch_size=1, shuffle=False, whole=True)
    rewards, losses = [], []
    model.eval()
    for start in range(0, min(limit, len(loader)), batch_size):
        indices = np.arange(start, min(start + batch_size, limit, len(loader)))
        batch = loader.batch_of(indices)
        rewards.append(torch.stack(model(scored.batch_of(indices).inputs).logits.squeeze(-1).chunk(2), dim=1))
        logps, counts = sequence_logps(lm(batch.inputs).logits, batch.targets)
        losses.append(torch.stack((-logps / counts.clamp(min=1)).chunk(2), dim=1))
    r, loss = torch.cat(rewards).double(), torch.cat(losses).double()
    correlation = float(np.corrcoef(r.flatten().numpy(), loss.flatten().numpy())[0, 1])
    return {
        "accuracy": float((r[:, 0] > r[:, 1]).float().mean()),
        "margin": float((r[:, 0] - r[:, 1]).mean()),
        "reward_loss_correlation": correlation,
    }


class RewardModelling(TunedFromBase):
    name = "reward_model"
    version = 1

    def check(self, spec: RewardModelSpec, inputs: Mapping[str, Artifact]) -> None:
        check_examples(inputs["base"], inputs["data"], spec.train.seq_len, "preference pairs", "reward_model")

    def run_name(self, spec: RewardModelSpec) -> str:
        return f"{spec.name}-reward"

    def build_model(self, job: TrainingJob) -> nn.Module:
        return reward_model(job.inputs["base"], job.inputs["data"].pad_id)

    def loaders(self, job: TrainingJob, rank: int, world: int) -> tuple[Batches, SampledLoader | None]:
        train = job.spec.train
        return preference_loaders(
            job.inputs["data"],
            batch_size=train.micro_batch_size,
            rank=rank,
            world_size=world,
            seed=train.seed,
            accumulation=train.grad_accum_steps(world),
            whole=True,
        )

    def objective(self, job: TrainingJob) -> RewardObjective:
        return RewardObjective(job.spec.centring)

    def finalize(self, job: TrainingJob, final: Path, tracker: Tracker) -> TrainedModel:
        """The verified sequence-classification export and the held-out numbers."""
        from training.parallel import fp32_state_dict

        spec: RewardModelSpec = job.spec
        base: TrainedModel = job.inputs["base"]
        data: PreferenceManifest = job.inputs["data"]
        # a decoder of its own: RewardModel wraps (shares) the decoder it is given, and the held-out response losses
        # below need the base language model's weights, not the trained reward model's
        model = RewardModel(Transformer(self.model_config(job), seed=None), data.pad_id)
        model.load_state_dict(fp32_state_dict(final, tie_embeddings=False), strict=True)
        export = job.run_dir / "hf"  # with the base export's tokenizer files
        verification = export_reward_model(model, Path(base.hf_export), export)
        scores = heldout_scores(model, load_export(base.hf_export).eval(), data, spec.eval_pairs)
        val = val_losses(job.run_dir)
        summary = {
            "reward/heldout_loss": val[-1],
            **{f"reward/heldout_{k}": v for k, v in scores.items()},
            "export/max_abs_logit_diff": verification["max_abs_logit_diff"],
        }
        atomic_write_json(job.run_dir / "reward_summary.json", summary)
        return trained_model(
            job,
            final,
            tracker,
            "reward",
            verification,
            summary,
            final_val_loss=val[-1],
            tokenizer_digest=base.tokenizer_digest,
            model=model.cfg.model_dump(mode="json"),
            base_run_dir=base.path,
            summary=summary,
        )


REWARD_MODELLING = RewardModelling()


def run_reward_model(
    spec: RewardModelSpec, base: TrainedModel, data: PreferenceManifest, progress: Progress | None = None
) -> TrainedModel:
    """Train (or resume, or return) the reward model on `base` from the preference pairs `data`."""
    return run_training_stage(REWARD_MODELLING, spec, {"base": base, "data": data}, progress)
