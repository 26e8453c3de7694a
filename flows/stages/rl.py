"""`rl`: reinforcement learning (GRPO / RLOO) of the fine-tuned model against the recipe's reward functions (the
reward model's score by default; `rl:`); its helper step encodes the prompts (`rl_prompts`, the recipe's
`data.prompts:`) with the base's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from flows.stage_def import Inputs, StageDef, Toggle
from flows.stages.dpo import BASE, GIVEN_BASE
from flows.stages.runs import describe_tuned, exported
from training.config import RLConfig

if TYPE_CHECKING:
    from data_pipeline.prompts import PromptManifest
    from flows.recipe import Recipe
    from flows.runner import StepProgress
    from training.stages.lifecycle import TrainedModel


def prompt_data(recipe: Recipe, base: TrainedModel) -> PromptManifest:
    """The RL prompts encoded with the base's tokenizer, each short enough to leave room for a completion."""
    from data_pipeline.prompts import prompts_of, run_prompt_data
    from data_pipeline.sft import sft_examples
    from data_pipeline.tokenizer import describe

    cfg = recipe.data.prompts
    conversations = sft_examples(recipe.data.sft) if cfg.source == "sft" else []
    tokenizer = describe(Path(exported(base)))
    room = recipe.rl.train.seq_len - recipe.rl.max_new_tokens
    return run_prompt_data(cfg, prompts_of(cfg, conversations), tokenizer, room, recipe.output_dir)


def check_prompts(recipe: Recipe) -> None:
    """A user's prompts file and the reward functions are checked before anything in the plan trains."""
    from data_pipeline.prompts import read_prompts
    from training.rewards import check_terms

    if recipe.data.prompts.source not in ("sft", "digits"):
        read_prompts(Path(recipe.data.prompts.source))
    check_terms(recipe.rl.rewards, reward_model="(trained in this plan)")


def run(recipe: Recipe, inputs: Inputs, progress: StepProgress | None) -> TrainedModel:
    from training.config import RLSpec
    from training.stages.rl import run_rl

    spec = recipe.section_spec("rl", RLSpec)
    uses_reward_model = any(term.function == "reward_model" for term in spec.rewards)
    reward_model = inputs.get("reward_model") if uses_reward_model else None
    return run_rl(spec, inputs["base"], inputs["prompts"], reward_model, progress=progress)


def report(recipe: Recipe, inputs: Inputs, model: TrainedModel) -> str:
    """The run, the held-out reward and KL, and two held-out completions of the base and the RL model side by
    side (where reward hacking shows first; the rest in samples.json, reward against KL in reward_kl.png)."""
    s, run = model.summary, Path(model.path)
    lines = [
        f"prompts     {inputs['prompts'].path}",
        describe_tuned(model),
        f"held-out    reward {s['rl/heldout_reward_before']:.3f} -> {s['rl/heldout_reward_after']:.3f} (gain "
        f"{s['rl/heldout_reward_gain']:+.3f}, 95% [{s['rl/heldout_reward_gain_low']:+.3f}, "
        f"{s['rl/heldout_reward_gain_high']:+.3f}] over the prompts), "
        f"KL to the base {s['rl/heldout_kl']:.4f} nats/token ({run / 'reward_kl.png'})",
    ]
    for shown in json.loads((run / "samples.json").read_text())[:2]:
        lines += [
            f"  prompt  {shown['prompt']!r}",
            f"    base  {shown['base']!r}",
            f"    RL    {shown['trained']!r}",
        ]
    return "\n".join(lines)


RL_PROMPTS: StageDef[PromptManifest] = StageDef(
    name="rl_prompts",
    help="RL prompts encoded with the base model's tokenizer",
    run=lambda recipe, inputs, progress: prompt_data(recipe, inputs["base"]),
    needs={"base": BASE},
    section="data",
    command=False,
    flow=False,
)

RL: StageDef[TrainedModel] = StageDef(
    name="rl",
    help="reinforcement learning (GRPO, RLOO) of the fine-tuned model against the reward model and verifiable rewards",
    run=run,
    needs={"base": BASE, "prompts": "rl_prompts", "reward_model": "reward_model"},
    section="rl",
    config=RLConfig,
    progress="steps",
    total=lambda recipe, inputs: recipe.rl.train.max_steps,
    headline=lambda model: dict(model.summary),
    report=report,
    outputs=lambda recipe, inputs, model: {
        "RL model": model.hf_export,
        "RL samples": f"{model.path}/samples.json",
    },
    models=lambda model: {model.kind: model},
    toggle=Toggle(
        "rl",
        False,
        "Reinforcement learning (GRPO)",
        "after fine-tuning, a reward model, then RL against it (rl.rewards: reward_model, length, regex, unit_tests "
        "or module:function); the registry then gates the RL model against the fine-tuned one",
    ),
    given=GIVEN_BASE,
    tags=("gpu",),
    preflight=check_prompts,
)
