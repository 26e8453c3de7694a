"""`reward_model`: a reward model on the fine-tuned (or pretrained) model, trained with the Bradley–Terry loss on
the preference pairs the DPO stage uses (the recipe's `reward_model:`); what an RL stage optimises against."""

from __future__ import annotations

from typing import TYPE_CHECKING

from flows.stage_def import Inputs, StageDef, Toggle
from flows.stages.dpo import BASE, GIVEN_BASE, check_pairs
from training.config import RewardModelConfig, RewardModelSpec

if TYPE_CHECKING:
    from flows.recipe import Recipe
    from flows.runner import StepProgress
    from training.stages.lifecycle import TrainedModel


def run(recipe: Recipe, inputs: Inputs, progress: StepProgress | None) -> TrainedModel:
    from training.stages.reward_model import run_reward_model

    spec = recipe.section_spec("reward_model", RewardModelSpec)
    return run_reward_model(spec, inputs["base"], inputs["pairs"], progress=progress)


def report(recipe: Recipe, inputs: Inputs, model: TrainedModel) -> str:
    s = model.summary
    return (
        f"reward model {model.hf_export} (AutoModelForSequenceClassification)\n"
        f"held-out    accuracy {s['reward/heldout_accuracy']:.3f}, margin {s['reward/heldout_margin']:.3f}, "
        f"reward/loss correlation {s['reward/heldout_reward_loss_correlation']:.3f}"
    )


REWARD_MODEL: StageDef[TrainedModel] = StageDef(
    name="reward_model",
    help="a reward model (Bradley-Terry on preference pairs) on the fine-tuned model",
    run=run,
    needs={"base": BASE, "pairs": "preference_data"},
    section="reward_model",
    config=RewardModelConfig,
    progress="steps",
    total=lambda recipe, inputs: recipe.reward_model.train.max_steps,
    headline=lambda model: dict(model.summary),
    report=report,
    outputs=lambda recipe, inputs, model: {"reward model": model.hf_export},
    toggle=Toggle(
        "reward_model",
        False,
        "Train a reward model",
        "a scalar-head model trained with the Bradley-Terry loss on the preference pairs (the one an RL stage "
        "optimises against), exported as a Hugging Face sequence-classification model",
    ),
    given=GIVEN_BASE,
    tags=("gpu",),
    preflight=check_pairs,
)
