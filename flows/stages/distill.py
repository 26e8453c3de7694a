"""`distill`: the pretrained model (or any Hugging Face export) distilled into a smaller student (the recipe's
`distill:`), beside `student_baseline`, the same student trained from scratch on the same tokens in the same order
(for the report's distilled-vs-scratch comparison)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flows.stage_def import Given, Inputs, StageDef, Toggle
from flows.stages.runs import describe_tuned, load_teacher
from flows.stages.sft import sft_examples
from training.config import DistillConfig

if TYPE_CHECKING:
    from flows.recipe import Recipe
    from flows.runner import StepProgress
    from training.stages.lifecycle import TrainedModel

DISTILLING = Toggle(
    "distill",
    False,
    "Distil a student",
    "distil the pretrained model into a smaller student (distill.student) and train the same student from scratch "
    "on the same tokens, side by side in the report",
)


def run(recipe: Recipe, inputs: Inputs, progress: StepProgress | None) -> TrainedModel:
    from training.stages.distill import Teacher, run_distill, teacher_from_run

    teacher = inputs["teacher"]
    teacher = teacher if isinstance(teacher, Teacher) else teacher_from_run(teacher)
    data = inputs["data"]
    if recipe.distill.data == "sft":  # the conversations in the teacher's tokenizer, at the student's length
        data = sft_examples(recipe, teacher.path, recipe.distill.train.seq_len)
    return run_distill(recipe.distill_spec(), teacher, data, progress=progress)


DISTILL: StageDef[TrainedModel] = StageDef(
    name="distill",
    help="knowledge distillation of a teacher into a smaller student",
    run=run,
    needs={"teacher": "pretrain", "data": "tokenize"},
    section="distill",
    config=DistillConfig,
    progress="steps",
    total=lambda recipe, inputs: recipe.distill.train.max_steps,
    headline=lambda model: dict(model.summary),
    report=lambda recipe, inputs, model: describe_tuned(model),
    outputs=lambda recipe, inputs, model: {"distilled student": model.hf_export},
    models=lambda model: {"student-distilled": model},
    toggle=DISTILLING,
    given=Given(
        "teacher",
        "teacher",
        load_teacher,
        "an lmforge run directory or a Hugging Face export (default: this recipe's pretrained model)",
    ),
    tags=("gpu",),
)


def run_baseline(recipe: Recipe, inputs: Inputs, progress: StepProgress | None) -> TrainedModel:
    """The distillation student trained from scratch on the same tokens in the same order (same seed)."""
    from training.config import PretrainSpec
    from training.stages.pretrain import run_pretrain

    changes: dict[str, Any] = {"name": f"{recipe.name}-student", "model": recipe.student(), "probe": None}
    spec = recipe.spec(PretrainSpec, **changes, optim=recipe.distill.optim, train=recipe.distill.train)
    return run_pretrain(spec, inputs["data"], progress=progress)


STUDENT_BASELINE: StageDef[TrainedModel] = StageDef(
    name="student_baseline",
    help="the distillation student trained from scratch on the same tokens",
    run=run_baseline,
    needs={"data": "tokenize"},
    section="distill",
    progress="steps",
    total=lambda recipe, inputs: recipe.distill.train.max_steps,
    report=lambda recipe, inputs, model: (
        f"baseline   {model.path} (the same student from scratch): val loss {model.final_val_loss:.4f}"
    ),
    models=lambda model: {"student-scratch": model},
    toggle=DISTILLING,
    when=lambda recipe: recipe.distill.baseline and recipe.distill.data == "tokens",
    command=False,
    flow=False,
    tags=("gpu",),
)
