"""Stage 2: pretraining, as a stage over the one training lifecycle (`training/stages/lifecycle.py`).

`run_pretrain(spec, data) -> TrainedModel`: a freshly initialised model (or, continued pretraining, a given model's
weights: `init`) trained on the token shards (one
in-process worker or N Ray Train workers, each running DeepSpeed), resumable, tracked in MLflow, ending with a
verified Hugging Face export. The run is keyed by the spec's model, optimiser, run and weight-relevant
parallel settings plus the dataset's content digest.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from torch import nn

from data_pipeline.humaneval import humaneval_pairs
from data_pipeline.loader import PackedLoader, SampledLoader
from data_pipeline.shards import DatasetManifest
from data_pipeline.sources import DataError
from data_pipeline.tokenizer import describe
from infra.steps import Artifact
from infra.storage import MANIFEST
from infra.tracking import Tracker
from training import checkpoint as ckpt
from training.config import PretrainSpec
from training.loop import Batches
from training.model.config import ModelConfig
from training.model.export import ENGINE_TOLERANCE, EngineCheck, export_hf
from training.model.hf_interop import load_export
from training.model.transformer import Transformer
from training.probe import TaskProbe
from training.stages.lifecycle import (
    Progress,
    TrainedModel,
    TrainingJob,
    TrainingStage,
    run_training_stage,
    trained_model,
    val_losses,
)


class Pretrain(TrainingStage):
    name = "pretrain"
    version = 2

    def check(self, spec: PretrainSpec, inputs: Mapping[str, Artifact]) -> None:
        data, init = inputs["data"], inputs.get("init")
        assert isinstance(data, DatasetManifest)
        if isinstance(init, TrainedModel) and init.tokenizer_digest != data.tokenizer.digest:
            raise DataError(
                f"pretrain.init_from={init.source_model or init.path} was trained with another tokenizer than the "
                f"corpus's ({data.tokenizer.path}); leave data.tokenizer.path unset (the corpus is then tokenized "
                "with the model's own) or point it at the model's directory"
            )
        if data.tokenizer.vocab_size > spec.model.vocab_size:
            raise DataError(
                f"the dataset's tokenizer has {data.tokenizer.vocab_size} tokens but model.vocab_size="
                f"{spec.model.vocab_size}; raise model.vocab_size or re-tokenize with a smaller vocabulary"
            )

    def tags(self, spec: PretrainSpec, inputs: Mapping[str, Artifact]) -> dict[str, str]:
        return {"lmforge.data_digest": inputs["data"].digest()}

    def log_inputs(self, inputs: Mapping[str, Artifact], tracker: Tracker) -> None:
        tracker.log_artifact(Path(inputs["data"].path) / MANIFEST, "data")

    def model_config(self, job: TrainingJob) -> ModelConfig:
        return job.spec.model

    def build_model(self, job: TrainingJob) -> nn.Module:
        init = job.inputs.get("init")
        if isinstance(init, TrainedModel):  # continued pretraining: the model's own weights, in fp32
            return load_export(init.hf_export).train()
        return Transformer(job.spec.model, seed=job.spec.train.seed)

    def loaders(self, job: TrainingJob, rank: int, world: int) -> tuple[Batches, SampledLoader | None]:
        data: DatasetManifest = job.inputs["data"]
        train = job.spec.train
        common = {
            "seq_len": train.seq_len,
            "batch_size": train.micro_batch_size,
            "tokenizer_digest": data.tokenizer.digest,
            "rank": rank,
            "world_size": world,
        }
        loader = PackedLoader(
            data, "train", seed=train.seed, accumulation=train.grad_accum_steps(world), **common
        )
        val = PackedLoader(data, "val", shuffle=False, **common) if data.splits["val"].n_docs else None
        return loader, val

    def probe(self, job: TrainingJob) -> TaskProbe | None:
        if job.spec.probe is None:
            return None
        tokenizer = describe(Path(job.inputs["data"].tokenizer.path)).load()
        return TaskProbe(humaneval_pairs(tokenizer), job.spec.train.seq_len)

    def engine_check(self, job: TrainingJob, val: list[float], world: int) -> EngineCheck | None:
        """The engine's final validation loss and the validation batches its `world` ranks measured it on."""
        if not val or not job.inputs["data"].splits["val"].n_docs:
            return None
        n = job.spec.train.eval_batches_per_rank(world)
        batches = [b for rank in range(world) for b in self.loaders(job, rank, world)[1].epoch_batches(n)]
        return EngineCheck(val[-1], batches, ENGINE_TOLERANCE[job.spec.parallel.precision])

    def finalize(self, job: TrainingJob, final: Path, tracker: Tracker) -> TrainedModel:
        from training.parallel import fp32_state_dict

        data: DatasetManifest = job.inputs["data"]
        init = job.inputs.get("init")
        cfg: ModelConfig = job.spec.model
        state = fp32_state_dict(final, cfg.tie_embeddings)
        val = val_losses(job.run_dir)
        verification = export_hf(
            state,
            cfg.trained_at(job.spec.train.seq_len),
            init.hf_export
            if isinstance(init, TrainedModel)
            else data.tokenizer.path,  # its generation settings
            job.run_dir / "hf",
            self.engine_check(job, val, ckpt.read_meta(final)["layout"]["world_size"]),  # the last attempt's
        )
        tracker.log_artifact(job.run_dir / "metrics.jsonl")
        return trained_model(
            job,
            final,
            tracker,
            "pretrain",
            verification,
            {"export/max_abs_logit_diff": verification["max_abs_logit_diff"]},
            final_val_loss=val[-1] if val else None,
            tokenizer_digest=data.tokenizer.digest,
            model=cfg.model_dump(mode="json"),
        )


PRETRAIN = Pretrain()


def run_pretrain(
    spec: PretrainSpec,
    data: DatasetManifest,
    progress: Progress | None = None,
    init: TrainedModel | None = None,
) -> TrainedModel:
    """Train (or resume, or return) `spec`'s model on `data`; from `init`'s weights (continued pretraining: its
    architecture, a new optimiser, the schedule from step 0) when given, keyed by it."""
    if init is not None:
        spec = PretrainSpec.model_validate({**spec.model_dump(), "model": init.model})
    return run_training_stage(PRETRAIN, spec, {"data": data, **({"init": init} if init else {})}, progress)
