"""RL on the fine-tuned smoke model. The toy verifiable task (`data.prompts.source=digits`: requests for a number,
scored by the `regex` reward, the share of digits in the completion): GRPO lifts the mean reward from its random
level (~0.01) to above 0.5 within 40 steps, while the same run at a learning rate of ~0 stays flat; a run stopped
at its step-10 checkpoint and resumed samples and trains exactly what the uninterrupted run did. Through the
registry: the reward model trains first and RL optimises against its score. Bad input ends in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipeline.sources import DataError
from flows.registry import resolve
from flows.stages.rl import prompt_data
from tests.pretrain_helpers import SMOKE_SETTINGS, cli, quiet_runner, smoke_overrides, stopped_copy, with_sets
from training.config import RLSpec
from training.stages.lifecycle import read_metrics
from training.stages.rl import run_rl

pytestmark = [pytest.mark.integration, pytest.mark.slow]
DIGITS = [
    "data.prompts.source=digits",
    "rl.rewards=[{function: regex}]",
    "rl.optim.lr=7e-3",  # seeds 0-3: held-out reward 0.94-0.99 (1e-2 collapsed at its last steps on seed 0: 0.24)
    "rl.train.max_steps=40",
    "rl.max_new_tokens=8",
    "rl.train.keep_checkpoints=4",  # the step-10 checkpoint stays, for the resume test
]


@pytest.fixture(scope="module")
def digits(smoke_base, smoke_lora, tmp_path_factory):
    """(recipe, fine-tuned base, prompts, spec, learned run, run at lr ~0)."""
    recipe, _ = smoke_base
    _, tuned = smoke_lora
    recipe = recipe.override(f"output_dir={tmp_path_factory.mktemp('rl')}", *DIGITS)
    prompts = prompt_data(recipe, tuned)
    spec = recipe.section_spec("rl", RLSpec)
    learned = run_rl(spec, tuned, prompts)
    frozen = spec.model_copy(update={"optim": spec.optim.model_copy(update={"lr": 1e-12})})  # lr 0 is refused
    return recipe, tuned, prompts, spec, learned, run_rl(frozen, tuned, prompts)


def rewards(run_dir: str | Path) -> list[float]:
    return [m["rewards/mean"] for m in read_metrics(run_dir) if "rewards/mean" in m]


def test_grpo_learns_the_digits_task_and_lr_zero_stays_flat(digits) -> None:
    _, tuned, _, _, learned, frozen = digits
    assert learned.kind == "rl-full" and learned.export_valid and learned.base_run_dir == tuned.path
    curve, flat = rewards(learned.path), rewards(frozen.path)
    assert len(curve) == len(flat) == 40
    assert sum(curve[:5]) / 5 < 0.05 and sum(curve[-5:]) / 5 > 0.5, curve  # random level ~0.01
    assert max(flat) < 0.1 and abs(sum(flat[-5:]) - sum(flat[:5])) / 5 < 0.05, flat
    s, f = learned.summary, frozen.summary
    assert s["rl/heldout_reward_before"] < 0.05 < 0.5 < s["rl/heldout_reward_after"], s
    assert s["rl/heldout_kl"] > 0.5 and f["rl/heldout_kl"] < 1e-3, (s, f)  # reward was bought with KL
    # the gain's paired interval (eight completions a held-out prompt): clear of 0 for the run that learned
    assert (
        0.3 < s["rl/heldout_reward_gain_low"] < s["rl/heldout_reward_gain"] < s["rl/heldout_reward_gain_high"]
    )
    assert f["rl/heldout_reward_gain_low"] <= 0.0 <= f["rl/heldout_reward_gain_high"], f
    record = next(m for m in read_metrics(learned.path) if "rewards/mean" in m)
    for key in (
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "rewards/regex/std",
        "rewards/regex/failures",
        "completions/mean_length",
        "completions/clipped_ratio",
        "perf/sampling_s",
        "perf/scoring_s",
        "perf/step_s",
    ):
        assert key in record, key
    shown = json.loads((Path(learned.path) / "samples.json").read_text())
    assert len(shown) == 4 and all(set(x) == {"prompt", "base", "trained"} for x in shown)
    assert len({x["prompt"] for x in shown}) == 4  # four prompts, each its first completion
    assert (Path(learned.path) / "reward_kl.png").stat().st_size > 10_000


def test_a_stopped_run_resumes_with_the_same_samples(digits, tmp_path: Path) -> None:
    """The learned run's directory as a kill after its step-10 checkpoint leaves it (later checkpoints, the
    manifest and the export gone, metrics cut at step 10), resumed: every later step's reward (so every sampled
    completion's score) and loss equal the uninterrupted run's."""
    recipe, tuned, prompts, spec, learned, _ = digits
    source = Path(learned.path)
    stopped = stopped_copy(source, tmp_path / "rl", 10)
    resumed = run_rl(spec.model_copy(update={"output_dir": str(tmp_path)}), tuned, prompts)
    assert Path(resumed.path) == stopped
    later = [
        (m["step"], m["rewards/mean"], m["train/loss"]) for m in read_metrics(stopped) if "train/loss" in m
    ]
    straight = [
        (m["step"], m["rewards/mean"], m["train/loss"]) for m in read_metrics(source) if "train/loss" in m
    ]
    assert [s for s, _, _ in later] == list(range(1, 41))  # steps 1-10 logged once: a resume, not a restart
    assert later == straight


def test_rl_against_the_reward_model_through_the_registry(smoke_base, smoke_lora, tmp_path: Path) -> None:
    """`rl` brings the prompts (the SFT conversations') and the reward model, and optimises the policy against
    the reward model's score, here with RLOO (the KL to the base charged in the reward)."""
    recipe, _ = smoke_base
    _, tuned = smoke_lora
    settings = ["rl.train.max_steps=6", "rl.train.checkpoint_every=6", "rl.baseline=rloo"]
    recipe = recipe.override(f"output_dir={tmp_path}", *settings)
    made = resolve("rl", recipe, quiet_runner(), {"base": tuned})
    model, reward_model = made.done["rl"], made.done["reward_model"]
    assert reward_model.kind == "reward" and model.kind == "rl-full"
    records = [m for m in read_metrics(model.path) if "rewards/reward_model/mean" in m]
    assert len(records) == 6 and Path(model.run_dir).name.startswith("smoke-rloo-full-")
    assert (
        records[0]["kl"] == 0.0 and records[-1]["kl"] != 0
    )  # the policy starts at the reference, then moves
    assert "rl/heldout_reward_model_after" in model.summary
    report = made.summary()["reports"][
        "rl"
    ]  # what the pipeline prints: two held-out completions, base and RL
    assert report.count("\n    base  ") == report.count("\n    RL    ") == 2 and "reward_kl.png" in report


def test_bad_input_is_refused_in_one_line(digits, tmp_path: Path) -> None:
    recipe, tuned, prompts, spec, _, _ = digits
    wants_reward_model = recipe.override("rl.rewards=[{function: reward_model}]").section_spec("rl", RLSpec)
    with pytest.raises(DataError, match="uses the reward model, but none was given"):
        run_rl(wants_reward_model, tuned, prompts)
    zero3 = spec.model_copy(update={"parallel": spec.parallel.model_copy(update={"zero_stage": 3})})
    with pytest.raises(
        DataError, match="own copy of the policy: use parallel.ep_size=1 and parallel.zero_stage 0-2"
    ):
        run_rl(zero3, tuned, prompts)
    bad = tmp_path / "prompts.jsonl"
    bad.write_text('{"prompt": "Write a number."}\n{"question": "no prompt"}\n')
    sets = with_sets(smoke_overrides(tmp_path, *SMOKE_SETTINGS, f"data.prompts.source={bad}"))
    result = cli("rl", "smoke", "--base", tuned.path, *sets)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "prompts.jsonl:2" in result.stderr and "'prompt'" in result.stderr
