"""Preference tuning (DPO and its variants) as a stage over the one training lifecycle.

`run_dpo(spec, base, data, reference) -> TrainedModel`: the policy starts from `base` (a fine-tuned or pretrained
run; full or LoRA) and learns from preference pairs, each step running the chosen and rejected sides through
the policy only: the frozen reference model's log-probabilities were computed once (`run_reference_logps`) and
ride along with the data, so training holds one model. Losses and logged metrics follow TRL's `DPOTrainer`
(`rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies`, `logps/chosen`,
`logps/rejected`), so numbers compare across tools. Before and after training it scores the held-out pairs.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data_pipeline.chat import chat_token_ids
from data_pipeline.loader import IGNORE_INDEX, SampledLoader
from data_pipeline.preference import PairBatch, PreferenceLoader, PreferenceManifest, preference_loaders
from data_pipeline.sources import DataError
from data_pipeline.tokenizer import describe
from infra.steps import Artifact, Step, run_step
from infra.storage import atomic_write_bytes, atomic_write_json
from infra.tracking import Tracker
from training.config import DPOSpec, PreferenceLoss
from training.engine import Engine
from training.loop import Batches
from training.model.hf_interop import load_export
from training.model.lora import apply_lora
from training.model.transformer import Transformer
from training.objective import Outcome
from training.policy_gradient import token_logps
from training.stages.lifecycle import (
    Progress,
    TrainedModel,
    TrainingJob,
    run_training_stage,
    val_losses,
)
from training.stages.tuning import TunedFromBase, check_examples, export_tuned

REFERENCE_VERSION = 1

# ---- the math (TRL's definitions) ---------------------------------------------------------------------------


def sequence_logps(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Per row: the sum of the targets' log-probabilities over the positions that carry loss, and their count."""
    return token_logps(logits, targets).sum(-1), (targets != IGNORE_INDEX).sum(-1)


def pair_losses(
    loss: PreferenceLoss, logps: Tensor, reference: Tensor, lengths: Tensor
) -> tuple[Tensor, Tensor]:
    """Per-pair losses and the implicit rewards β·(log π − log π_ref), (B, 2), of (chosen, rejected).

    `logps` and `lengths` are (2B,) with the chosen rows first; `reference` is (B, 2)."""
    chosen, rejected = logps.chunk(2)
    n_chosen, n_rejected = lengths.chunk(2)
    scores = torch.stack([chosen, rejected], dim=1) - reference.to(logps)  # log-ratios against the reference
    delta = scores[:, 0] - scores[:, 1]
    if loss.type == "sigmoid":
        per_pair = -F.logsigmoid(loss.beta * delta)
    elif loss.type == "hinge":
        per_pair = torch.relu(1 - loss.beta * delta)
    else:  # ipo and sigmoid_norm compare per-token means of the log-ratios
        mean_delta = scores[:, 0] / n_chosen.clamp(min=1) - scores[:, 1] / n_rejected.clamp(min=1)
        if loss.type == "ipo":
            per_pair = (mean_delta - 1 / (2 * loss.beta)) ** 2
        else:
            per_pair = -F.logsigmoid(loss.beta * mean_delta)
    return per_pair, loss.beta * scores.detach()


@dataclass(frozen=True)
class PreferenceObjective:
    """The loop's objective for pair batches: the mean per-pair loss, TRL's metrics alongside."""

    loss: PreferenceLoss

    def units(self, batch: PairBatch) -> int:
        return batch.n_pairs

    def __call__(self, engine: Engine, batch: PairBatch) -> Outcome:
        out = engine.forward(batch, with_loss=False)  # the log-probabilities below are the only loss
        logps, lengths = sequence_logps(out.logits, batch.targets.to(out.logits.device))
        per_pair, rewards = pair_losses(self.loss, logps, batch.reference, lengths)
        chosen, rejected = logps.detach().chunk(2)
        metrics = {
            "rewards/chosen": rewards[:, 0].mean(),
            "rewards/rejected": rewards[:, 1].mean(),
            "rewards/margins": (rewards[:, 0] - rewards[:, 1]).mean(),
            "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).float().mean(),
            "logps/chosen": chosen.mean(),
            "logps/rejected": rejected.mean(),
        }
        return Outcome(per_pair.mean(), out.aux_loss, out.router_stats, metrics)


# ---- the reference log-probabilities, computed once -----------------------------------------------------------


class ReferenceLogps(Artifact):
    """The frozen reference model's log-probabilities of every pair's sides: `<split>.npy`, (pairs, 2) float32,
    row-aligned with the data's splits, with the digests of the model and the data they were computed from."""

    model_digest: str
    model_run: str
    data_digest: str
    counts: dict[str, int]

    def array(self, split: str) -> np.ndarray:
        return np.load(Path(self.path) / f"{split}.npy")

    def damage(self) -> str | None:
        for split, rows in self.counts.items():
            path = Path(self.path) / f"{split}.npy"
            try:
                shape = np.load(path, mmap_mode="r").shape
            except (OSError, ValueError):
                return f"{path} is missing or unreadable"
            if shape != (rows, 2):
                return f"{path} holds {shape}, expected ({rows}, 2)"
        return None


@torch.no_grad()
def pair_logps(model: Transformer, loader: PreferenceLoader, batch_size: int = 16) -> np.ndarray:
    """Every pair's (chosen, rejected) summed log-probabilities under `model`, (pairs, 2), in the split's stored
    order (in the model's dtype, on its device)."""
    device = next(model.parameters()).device
    logps = []
    model.eval()
    for start in range(0, len(loader), batch_size):
        batch = loader.batch_of(np.arange(start, min(start + batch_size, len(loader))))
        lp, _ = sequence_logps(model(batch.inputs.to(device)).logits, batch.targets.to(device))
        logps.append(torch.stack(lp.chunk(2), dim=1).cpu())
    return torch.cat(logps).numpy()


def run_reference_logps(
    data: PreferenceManifest, reference: TrainedModel, root: str | Path
) -> ReferenceLogps:
    """Stage: the reference model's log-probabilities of every pair, cached by the data's and the model's digests."""
    step = Step(
        "preference_ref", "logps", REFERENCE_VERSION, {}, ReferenceLogps, {"data": data, "model": reference}
    )

    def build(out: Path, _key: str) -> ReferenceLogps:
        model = load_export(reference.hf_export).to("cuda" if torch.cuda.is_available() else "cpu")
        counts = {}
        for split in ("train", "heldout"):
            logps = pair_logps(model, PreferenceLoader(data, split, batch_size=1, shuffle=False))
            atomic_write_bytes(out / f"{split}.npy", _npy_bytes(logps.astype(np.float32)))
            counts[split] = len(logps)
        return ReferenceLogps(
            path=str(out.resolve()),
            model_digest=reference.digest(),
            model_run=reference.path,
            data_digest=data.digest(),
            counts=counts,
        )

    return run_step(root, step, build)


def _npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def heldout_scores(
    model: Transformer, data: PreferenceManifest, reference: np.ndarray, beta: float, limit: int
) -> dict[str, float]:
    """Held-out preference numbers of `model`: accuracy (log π(chosen) > log π(rejected)), the mean log-prob
    margin, and against the reference TRL's reward accuracy and margin β·(Δ log π − Δ log π_ref)."""
    loader = PreferenceLoader(data, "heldout", batch_size=1, shuffle=False)
    logps = pair_logps(model, loader)
    logps, reference = logps[:limit].astype(np.float64), reference[:limit].astype(np.float64)
    rewards = beta * (logps - reference)
    return {
        "accuracy": float((logps[:, 0] > logps[:, 1]).mean()),
        "logp_margin": float((logps[:, 0] - logps[:, 1]).mean()),
        "reward_accuracy": float((rewards[:, 0] > rewards[:, 1]).mean()),
        "reward_margin": float((rewards[:, 0] - rewards[:, 1]).mean()),
    }


# ---- the stage ----------------------------------------------------------------------------------------------------


def policy_model(base: TrainedModel, spec: DPOSpec) -> nn.Module:
    """The base's verified export (LoRA-merged when the base is an adapter) in fp32, with adapters if asked."""
    model = load_export(base.hf_export).train()
    if spec.method != "lora":
        return model
    return apply_lora(model, spec.lora, chat_token_ids(describe(Path(base.hf_export))))


class Preference(TunedFromBase):
    name = "dpo"
    version = 1

    def check(self, spec: DPOSpec, inputs: Mapping[str, Artifact]) -> None:
        base, data, reference = inputs["base"], inputs["data"], inputs["reference"]
        assert isinstance(data, PreferenceManifest) and isinstance(reference, ReferenceLogps)
        check_examples(base, data, spec.train.seq_len, "preference pairs", "dpo")
        if reference.model_digest != base.digest():
            raise DataError(
                f"the reference log-probabilities {reference.path} were computed with {reference.model_run}, not with "
                f"the policy's starting model {base.path}; recompute them with that model (run_reference_logps)"
            )
        if reference.data_digest != data.digest():
            raise DataError(
                f"the reference log-probabilities {reference.path} belong to other preference pairs than {data.path}; "
                "recompute them for these pairs"
            )
        if not Path(base.hf_export).is_dir():
            raise DataError(
                f"{base.path} has no Hugging Face export to start from; rerun its stage to export it"
            )

    def run_name(self, spec: DPOSpec) -> str:
        return f"{spec.name}-{spec.loss.type}-{spec.method}"

    def tags(self, spec: DPOSpec, inputs: Mapping[str, Artifact]) -> dict[str, str]:
        return {**super().tags(spec, inputs), "lmforge.method": spec.method, "lmforge.loss": spec.loss.type}

    def build_model(self, job: TrainingJob) -> nn.Module:
        return policy_model(job.inputs["base"], job.spec)

    def loaders(self, job: TrainingJob, rank: int, world: int) -> tuple[Batches, SampledLoader | None]:
        train = job.spec.train
        return preference_loaders(
            job.inputs["data"],
            batch_size=train.micro_batch_size,
            rank=rank,
            world_size=world,
            seed=train.seed,
            accumulation=train.grad_accum_steps(world),
            reference=job.inputs["reference"].array,
        )

    def objective(self, job: TrainingJob) -> PreferenceObjective:
        return PreferenceObjective(job.spec.loss)

    def finalize(self, job: TrainingJob, final: Path, tracker: Tracker) -> TrainedModel:
        """Adapter / merged export (verified); held-out preference accuracy and margins before and after."""
        spec: DPOSpec = job.spec
        base: TrainedModel = job.inputs["base"]
        data, reference = job.inputs["data"], job.inputs["reference"].array("heldout")
        model = load_export(base.hf_export)
        before = heldout_scores(model, data, reference, spec.loss.beta, spec.eval_pairs)
        tuned = export_tuned(job, final, model, spec.method, spec.lora, base.hf_export)
        after = heldout_scores(tuned.model, data, reference, spec.loss.beta, spec.eval_pairs)
        val = val_losses(job.run_dir)
        summary = {
            **tuned.counts("dpo"),
            "dpo/heldout_loss_before": val[0],
            "dpo/heldout_loss_after": val[-1],
            **{f"dpo/heldout_{k}_before": v for k, v in before.items() if not k.startswith("reward")},
            **{f"dpo/heldout_{k}_after": v for k, v in after.items()},
            "export/max_abs_logit_diff": tuned.verification["max_abs_logit_diff"],
        }
        atomic_write_json(job.run_dir / "dpo_summary.json", summary)
        kind = "dpo-lora" if spec.method == "lora" else "dpo-full"
        return tuned.trained_model(
            job,
            final,
            tracker,
            kind,
            summary,
            final_val_loss=val[-1],
            tokenizer_digest=base.tokenizer_digest,
            base_run_dir=base.path,
        )


PREFERENCE = Preference()


def run_dpo(
    spec: DPOSpec,
    base: TrainedModel,
    data: PreferenceManifest,
    reference: ReferenceLogps,
    progress: Progress | None = None,
) -> TrainedModel:
    """Preference-tune `base` on `data` against the cached `reference` log-probabilities."""
    return run_training_stage(
        PREFERENCE, spec, {"base": base, "data": data, "reference": reference}, progress
    )
