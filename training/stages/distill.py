"""Knowledge distillation as a stage over the one training lifecycle.

`run_distill(spec, teacher, data) -> TrainedModel`: a freshly initialised student (the spec's model) learns from
a frozen teacher (an lmforge run or any Hugging Face export our model can load, with the data's tokenizer) on
the token shards (every token) or the SFT examples (response tokens). The loss per token is
α·CE(student, label) + (1-α)·D(teacher, student), with D either T²·KL(teacher_T ‖ student_T) on
temperature-softened distributions (Hinton et al. 2015) or the generalised Jensen-Shannon divergence of GKD
(Agarwal et al. 2024; β = 0 forward KL, β = 1 reverse KL), defined exactly as TRL's
`GKDTrainer.generalized_jsd_loss`. The student's init and data order depend only on the seed, so the same
student trained from scratch (`pretrain` with the student's model) sees the same tokens: the baseline.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data_pipeline.loader import IGNORE_INDEX, Batch, SampledLoader
from data_pipeline.sft import SFTLoader, SFTManifest
from data_pipeline.shards import DatasetManifest
from data_pipeline.sources import DataError
from data_pipeline.tokenizer import describe
from infra.steps import Artifact
from infra.storage import MANIFEST, digest_of, sha256_file
from infra.tracking import Tracker
from training.config import DistillSpec
from training.engine import Engine
from training.loop import Batches
from training.model.config import ModelConfig
from training.model.export import export_hf
from training.model.hf_interop import load_export, load_hf_config
from training.model.transformer import Transformer
from training.objective import Outcome
from training.stages.lifecycle import (
    Progress,
    TrainedModel,
    TrainingJob,
    TrainingStage,
    run_training_stage,
    trained_model,
    val_losses,
)

# ---- the math ----------------------------------------------------------------------------------------------


def generalized_jsd(student: Tensor, teacher: Tensor, beta: float, temperature: float = 1.0) -> Tensor:
    """Per position (all leading dimensions kept): β·KL(teacher ‖ M) + (1-β)·KL(student ‖ M) with
    M = β·teacher + (1-β)·student on temperature-softened distributions; β = 0 is KL(teacher ‖ student), β = 1
    KL(student ‖ teacher). The same terms as TRL's `generalized_jsd_loss`, before its reduction."""
    s = F.log_softmax(student.float() / temperature, dim=-1)
    t = F.log_softmax(teacher.float() / temperature, dim=-1)
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    b = torch.tensor(beta, dtype=s.dtype, device=s.device)
    mixture = torch.logsumexp(torch.stack([s + torch.log1p(-b), t + torch.log(b)]), dim=0)
    kl_teacher = F.kl_div(mixture, t, reduction="none", log_target=True).sum(-1)
    kl_student = F.kl_div(mixture, s, reduction="none", log_target=True).sum(-1)
    return b * kl_teacher + (1 - b) * kl_student


@dataclass(frozen=True)
class DistillObjective:
    """α·CE + (1-α)·divergence, each the mean over the loss-carrying tokens; the teacher runs without gradients."""

    teacher: Transformer
    loss: Literal["kl", "jsd"]
    alpha: float
    temperature: float
    jsd_beta: float

    def units(self, batch: Batch) -> int:
        return batch.n_targets()

    def divergence(self, student: Tensor, teacher: Tensor) -> Tensor:
        if self.loss == "kl":
            return self.temperature**2 * generalized_jsd(student, teacher, 0.0, self.temperature)
        return generalized_jsd(student, teacher, self.jsd_beta, self.temperature)

    def __call__(self, engine: Engine, batch: Batch) -> Outcome:
        if self.teacher.lm_head.weight.device != engine.device:
            self.teacher.to(engine.device)
        out = engine.forward(batch)
        with torch.no_grad():
            teacher_logits = self.teacher(batch.inputs.to(engine.device)).logits
        mask = batch.targets.to(engine.device) != IGNORE_INDEX
        divergence = self.divergence(out.logits[mask], teacher_logits[mask]).mean()
        loss = self.alpha * out.ce_loss + (1 - self.alpha) * divergence
        metrics = {"distill/ce": out.ce_loss.detach(), f"distill/{self.loss}": divergence.detach()}
        return Outcome(loss, out.aux_loss, out.router_stats, metrics)


# ---- the teacher -----------------------------------------------------------------------------------------------


class Teacher(Artifact):
    """A frozen model to learn from: a Hugging Face export (`path`) with its tokenizer; keyed by its content."""

    tokenizer_digest: str
    model: dict[str, Any]
    run_dir: str | None = None  # when it is an lmforge run
    mlflow_run_id: str | None = None


def teacher_from_run(ref: TrainedModel) -> Teacher:
    return Teacher(
        path=ref.hf_export,
        key=ref.digest(),
        tokenizer_digest=ref.tokenizer_digest,
        model=load_hf_config(ref.hf_export).model_dump(mode="json"),
        run_dir=ref.path,
        mlflow_run_id=ref.mlflow_run_id,
    )


def teacher_from_export(directory: str | Path) -> Teacher:
    """Any Hugging Face Llama/Mixtral export with tokenizer files (keyed by the sha256 of its files)."""
    directory = Path(directory)
    if not (directory / "config.json").is_file():
        raise DataError(
            f"{directory}: no config.json; give an lmforge run directory or a Hugging Face export"
        )
    files = sorted(p for p in directory.iterdir() if p.is_file())
    return Teacher(
        path=str(directory.resolve()),
        key=digest_of({p.name: sha256_file(p) for p in files}),
        tokenizer_digest=describe(directory).digest,
        model=load_hf_config(directory).model_dump(mode="json"),
    )


# ---- the stage ---------------------------------------------------------------------------------------------------


def data_tokenizer(data: Artifact) -> str:
    return data.tokenizer.digest if isinstance(data, DatasetManifest) else data.tokenizer_digest


class Distill(TrainingStage):
    name = "distill"
    version = 1

    def check(self, spec: DistillSpec, inputs: Mapping[str, Artifact]) -> None:
        teacher, data = inputs["teacher"], inputs["data"]
        assert isinstance(teacher, Teacher) and isinstance(data, DatasetManifest | SFTManifest)
        if teacher.tokenizer_digest != data_tokenizer(data):
            raise DataError(
                f"the teacher {teacher.path} uses tokenizer {teacher.tokenizer_digest[:16]}... but the data {data.path} "
                f"was made with {data_tokenizer(data)[:16]}...; distil with a teacher and data of one tokenizer"
            )
        vocab = teacher.model["vocab_size"]
        if vocab != spec.model.vocab_size:
            raise DataError(
                f"the teacher {teacher.path} has vocab_size={vocab}, the student model.vocab_size="
                f"{spec.model.vocab_size}; distillation compares distributions over one vocabulary, so make them equal"
            )
        if isinstance(data, SFTManifest) and data.seq_len != spec.train.seq_len:
            raise DataError(
                f"SFT data has seq_len={data.seq_len}, distill.train.seq_len={spec.train.seq_len}; rebuild it with "
                "the distillation sequence length"
            )

    def tags(self, spec: DistillSpec, inputs: Mapping[str, Artifact]) -> dict[str, str]:
        teacher = inputs["teacher"]
        return {
            "lmforge.teacher": teacher.path,
            "lmforge.teacher_run_id": str(teacher.mlflow_run_id),
            "lmforge.data_digest": inputs["data"].digest(),
        }

    def log_inputs(self, inputs: Mapping[str, Artifact], tracker: Tracker) -> None:
        tracker.log_artifact(Path(inputs["data"].path) / MANIFEST, "data")

    def model_config(self, job: TrainingJob) -> ModelConfig:
        return job.spec.model

    def build_model(self, job: TrainingJob) -> nn.Module:
        return Transformer(job.spec.model, seed=job.spec.train.seed)

    def loaders(self, job: TrainingJob, rank: int, world: int) -> tuple[Batches, SampledLoader | None]:
        data, train = job.inputs["data"], job.spec.train
        if isinstance(data, SFTManifest):
            common = {"batch_size": train.micro_batch_size, "rank": rank, "world_size": world}
            accumulation = train.grad_accum_steps(world)
            return SFTLoader(data, "train", seed=train.seed, accumulation=accumulation, **common), SFTLoader(
                data, "heldout", shuffle=False, **common
            )
        from training.stages.pretrain import PRETRAIN

        return PRETRAIN.loaders(job, rank, world)  # the same windows in the same order as pretraining's

    def objective(self, job: TrainingJob) -> DistillObjective:
        spec: DistillSpec = job.spec
        teacher = load_export(job.inputs["teacher"].path).requires_grad_(False)
        return DistillObjective(teacher, spec.loss, spec.alpha, spec.temperature, spec.jsd_beta)

    def finalize(self, job: TrainingJob, final: Path, tracker: Tracker) -> TrainedModel:
        from training.parallel import fp32_state_dict

        spec: DistillSpec = job.spec
        teacher: Teacher = job.inputs["teacher"]
        state = fp32_state_dict(final, spec.model.tie_embeddings)
        verification = export_hf(
            state, spec.model.trained_at(spec.train.seq_len), teacher.path, job.run_dir / "hf"
        )
        val = val_losses(job.run_dir)
        summary = {
            "distill/heldout_objective_before": val[0],
            "distill/heldout_objective_after": val[-1],
            "distill/student_params": float(
                sum(p.numel() for p in Transformer(spec.model, seed=None).parameters())
            ),
            "export/max_abs_logit_diff": verification["max_abs_logit_diff"],
        }
        return trained_model(
            job,
            final,
            tracker,
            "distill",
            verification,
            summary,
            final_val_loss=val[-1],
            tokenizer_digest=teacher.tokenizer_digest,
            model=spec.model.model_dump(mode="json"),
            base_run_dir=teacher.run_dir,
            summary=summary,
        )


DISTILL = Distill()


def run_distill(
    spec: DistillSpec, teacher: Teacher, data: DatasetManifest | SFTManifest, progress: Progress | None = None
) -> TrainedModel:
    """Distil `teacher` into `spec`'s student on `data`."""
    return run_training_stage(DISTILL, spec, {"teacher": teacher, "data": data}, progress)
