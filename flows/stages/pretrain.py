"""Stage 2, `pretrain`: DeepSpeed pretraining of the recipe's model (its `model:`, `optim:`, `train:` and
`parallel:`), at the size the scaling fit chose when the fit runs first; resumes from its newest checkpoint."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from flows.stage_def import Inputs, StageDef
from training.config import PretrainConfig

if TYPE_CHECKING:
    from flows.recipe import Recipe
    from flows.runner import StepProgress
    from training.stages.lifecycle import TrainedModel

log = logging.getLogger(__name__)


def run(recipe: Recipe, inputs: Inputs, progress: StepProgress | None) -> TrainedModel:
    from flows.stages.runs import init_model
    from training.stages.pretrain import run_pretrain

    init = init_model(recipe)
    if init is not None and "law" in inputs:
        log.warning("pretrain.init_from fixes the model's size: the scaling fit's choice of size is not used")
    return run_pretrain(recipe.pretrain_spec(), inputs["data"], progress=progress, init=init)


def report(recipe: Recipe, inputs: Inputs, model: TrainedModel) -> str:
    from infra.tracking import tracking_uri

    loss, diff = model.final_val_loss, model.max_abs_logit_diff
    lines = [
        f"run        {model.path}",
        f"checkpoint {model.checkpoint} (step {model.step})",
        f"val loss   {'none' if loss is None else f'{loss:.4f}'}",
        f"hf export  {model.hf_export} (verified: {model.export_valid}, max |Δlogit| "
        f"{'none' if diff is None else f'{diff:.2g}'})",
        f"mlflow run {model.mlflow_run_id}",
    ]
    if recipe.tracking.enabled:
        uri = tracking_uri(recipe.tracking, recipe.output_dir)
        server = uri.startswith(("http://", "https://"))
        lines.append(
            f"browse it: {uri}"
            if server
            else f"browse it: .venv/bin/mlflow ui --backend-store-uri {uri} --port 5000"
        )
    return "\n".join(lines)


PRETRAIN: StageDef[TrainedModel] = StageDef(
    name="pretrain",
    help="stage 2: DeepSpeed pretraining (resumes automatically)",
    run=run,
    needs={"data": "tokenize"},
    wants={"law": "fit"},  # the fit sizes the model (Plan.recipe) before it trains
    section="pretrain",
    config=PretrainConfig,
    progress="steps",
    total=lambda recipe, inputs: recipe.train.max_steps,
    headline=lambda m: {"val loss": m.final_val_loss, "steps": m.step, "export verified": m.export_valid},
    report=report,
    outputs=lambda recipe, inputs, m: {"pretrained model": m.hf_export},
    models=lambda m: {"pretrain": m},
    tags=("gpu",),
)
