"""RL's reward functions and prompts: each built-in function's value on hand-made completions, the weighted sum,
a function that raises or returns NaN (that completion scores 0 and is counted, the others keep theirs), a user's
`module:function`, and prompt files refused in one line naming the record."""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from data_pipeline.chat import ChatFormat
from data_pipeline.config import PromptsConfig
from data_pipeline.prompts import Prompt, digit_prompts, prompts_of, read_prompts
from data_pipeline.sources import DataError
from training.config import RewardTerm
from training.rewards import Rewards, Sample, check_terms, code_of

OWN = ChatFormat("", None, "<|end|>")  # lmforge's own layout
ASK = Prompt([{"role": "user", "content": "Write a number."}])
ADD = Prompt([{"role": "user", "content": "Write add(a, b)."}], tests="assert add(2, 3) == 5")


def sample(text: str, prompt: Prompt = ASK, n_tokens: int = 4) -> Sample:
    return Sample(prompt, [1, 2, 3], list(range(n_tokens)), text, OWN.prompt(prompt.messages))


def test_builtin_functions_and_the_weighted_sum() -> None:
    terms = [
        RewardTerm(function="regex", weight=2.0),
        RewardTerm(function="length", weight=0.5, target_tokens=4),
    ]
    scores = Rewards(terms, None, 128).score(
        [sample("1234"), sample("ab12", n_tokens=8), sample("", n_tokens=2)]
    )
    torch.testing.assert_close(
        scores.by_function["regex"], torch.tensor([1.0, 0.5, 0.0], dtype=torch.float64)
    )
    torch.testing.assert_close(
        scores.by_function["length"], torch.tensor([0.0, -1.0, -0.5], dtype=torch.float64)
    )
    torch.testing.assert_close(scores.total, torch.tensor([2.0, 0.5, -0.25], dtype=torch.float64))
    assert scores.failures == {"regex": 0, "length": 0}


def test_unit_tests_run_the_completions_code_in_the_sandbox() -> None:
    fenced = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert code_of(fenced) == "def add(a, b):\n    return a + b\n"
    rewards = Rewards([RewardTerm(function="unit_tests", timeout_s=2.0)], None, 128)
    scores = rewards.score(
        [
            sample(fenced, ADD),
            sample("def add(a, b):\n    return a - b", ADD),
            sample("while True: pass", ADD),
        ]
    )
    assert scores.by_function["unit_tests"].tolist() == [1.0, 0.0, 0.0]
    no_tests = rewards.score([sample("def add(a, b): return a + b", ASK)])  # a prompt without tests
    assert no_tests.failures == {"unit_tests": 1} and no_tests.total.tolist() == [0.0]


def test_a_failing_user_function_costs_only_its_completions(caplog: pytest.LogCaptureFixture) -> None:
    def score(prompt: str, completion: str) -> float:
        if completion == "boom":
            raise ValueError("cannot score this")
        return math.nan if completion == "nan" else float(len(completion))

    module = types.ModuleType("lmforge_test_rewards")
    module.score = score  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        rewards = Rewards([RewardTerm(function="lmforge_test_rewards:score")], None, 128)
        scores = rewards.score([sample("abc"), sample("boom"), sample("nan"), sample("de")])
    finally:
        del sys.modules[module.__name__]
    assert scores.by_function["score"].tolist() == [3.0, 0.0, 0.0, 2.0]
    assert scores.failures == {"score": 2} and scores.metrics()["rewards/score/failures"] == 2
    assert "'score' failed on 2 of 4 completions" in caplog.text and "cannot score this" in caplog.text


def test_reward_functions_that_cannot_be_built_are_refused() -> None:
    with pytest.raises(DataError, match="cannot import 'nosuch.module:score'"):
        check_terms([RewardTerm(function="nosuch.module:score")], None)
    with pytest.raises(DataError, match="unknown reward function 'bleu'"):
        check_terms([RewardTerm(function="bleu")], None)
    with pytest.raises(DataError, match="regex pattern '\\[0-9' is invalid"):
        check_terms([RewardTerm(function="regex", pattern="[0-9")], None)
    with pytest.raises(DataError, match="uses the reward model, but none was given"):
        check_terms([RewardTerm(function="reward_model")], None)


def test_prompt_sources_and_bad_records(tmp_path) -> None:
    assert OWN.prompt(ASK.messages) == "<|user|>\nWrite a number.<|end|>\n<|assistant|>\n"
    assert len(digit_prompts()) == 400 and len({p.messages[0]["content"] for p in digit_prompts()}) == 400
    conversations = [[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]]
    assert prompts_of(PromptsConfig(), conversations) == [Prompt([{"role": "user", "content": "q"}])]
    good = tmp_path / "good.jsonl"
    good.write_text(
        '{"prompt": "Write add.", "tests": "assert add(1, 1) == 2"}\n\n{"prompt": [{"role": "user", "content": "hi"}]}\n'
    )
    assert read_prompts(good) == [
        Prompt([{"role": "user", "content": "Write add."}], "assert add(1, 1) == 2"),
        Prompt([{"role": "user", "content": "hi"}]),
    ]
    cases = {
        '{"question": "x"}': "bad.jsonl:1: expected a record",
        '{"prompt": "x", "tests": 3}': "bad.jsonl:1: the prompt's contents and 'tests' must be strings",
        '{"prompt": [{"role": "robot", "content": "x"}]}': "bad.jsonl:1: unknown role",
        '{"prompt": "a <|end|> b"}': "bad.jsonl:1: the prompt contains the reserved marker <|end|>",
        "{not json": "bad.jsonl:1: not valid JSON",
        "": "bad.jsonl: no prompts",
    }
    bad = tmp_path / "bad.jsonl"
    for text, message in cases.items():
        bad.write_text(text)
        with pytest.raises(DataError, match=message.replace("|", "\\|")):
            read_prompts(bad)
    with pytest.raises(DataError, match="does not exist"):
        read_prompts(tmp_path / "none.jsonl")


def test_prompts_are_encoded_up_to_the_assistant_header_and_long_ones_dropped(tokenized, tmp_path) -> None:
    from data_pipeline.prompts import PromptLoader, run_prompt_data
    from data_pipeline.tokenizer import describe

    tok = describe(Path(tokenized[0].tokenizer.path))
    long = Prompt([{"role": "user", "content": "word " * 200}])
    prompts = [*digit_prompts(60), long]
    manifest = run_prompt_data(
        PromptsConfig(source="digits", heldout_fraction=0.2), prompts, tok, 40, tmp_path
    )
    assert (
        manifest.counts["dropped_too_long"] == 1
        and manifest.counts["train"] + manifest.counts["heldout"] == 60
    )
    assert manifest.end_of_turn_id == tok.load().token_to_id("<|end|>")
    prompt, ids = manifest.records("train")[0]
    assert ids == tok.load().encode(OWN.prompt(prompt.messages)).ids and len(ids) <= 40
    loader = PromptLoader(manifest, batch_size=4, seed=1)
    first = loader.next_batch()
    state = loader.state_dict()
    second = loader.next_batch()
    again = PromptLoader(manifest, batch_size=4, seed=1)
    again.load_state_dict(state)
    assert again.next_batch() == second and first.n_targets() == 4  # resumable, deterministic
    with pytest.raises(DataError, match="too few usable prompts"):
        run_prompt_data(PromptsConfig(source="digits"), [long], tok, 40, tmp_path / "none")


@pytest.mark.parametrize("attention", ["softmax", "linear"])
def test_a_rollout_samples_every_prompts_group_in_one_padded_batch_as_each_alone(attention):
    """Prompts of 3, 9 and 5 tokens, two completions each, sampled with a nucleus so narrow it keeps the top token
    only: each sample holds its own prompt and the completion that prompt gets alone (greedy, cut after the
    end-of-turn marker), in prompt order, and the rows that score them are prompt + completion with targets on
    the completion only (softmax attention: one left-padded batch; linear: one prompt's group at a time)."""
    from tokenizers import Tokenizer, models

    from data_pipeline.prompts import Prompt, PromptBatch
    from training.config import RLConfig
    from training.model.config import ModelConfig
    from training.model.sampling import generate
    from training.model.transformer import Transformer
    from training.stages.rl import rollout

    cfg = ModelConfig(
        vocab_size=64, attention=attention, init_std=0.5, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        d_ff=64, max_seq_len=32,
    )  # fmt: skip
    policy = Transformer(cfg, seed=3).eval()
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 64, (n,), generator=g).tolist() for n in (3, 9, 5)]
    alone = [generate(policy, torch.tensor([p]), 6)[0, len(p) :].tolist() for p in ids]
    end = alone[1][3]  # a token the second prompt's completion reaches fourth (and first there)
    expected = [row[: row.index(end) + 1] if end in row else row for row in alone]
    prompts = [Prompt([{"role": "user", "content": str(i)}]) for i in range(3)]
    spec = RLConfig(max_new_tokens=6, temperature=1.0, top_p=1e-6)
    got = rollout(policy, PromptBatch(ids, prompts), 2, spec, tokenizer, end, pad_id=0)
    assert [s.prompt for s in got.samples] == [p for p in prompts for _ in range(2)]
    assert [s.prompt_ids for s in got.samples] == [p for p in ids for _ in range(2)]
    assert [s.completion_ids for s in got.samples] == [c for c in expected for _ in range(2)]
    assert [len(c) for c in expected] == [6, 4, 6] and got.clipped.tolist() == [
        float(end not in c) for c in expected for _ in range(2)
    ]
    for row, sample in enumerate(got.samples):
        n_prompt, n = len(sample.prompt_ids), len(sample.prompt_ids) + len(sample.completion_ids)
        assert got.batch.inputs[row, : n - 1].tolist() == (sample.prompt_ids + sample.completion_ids)[:-1]
        assert got.batch.targets[row, : n - 1].tolist() == [-100] * (n_prompt - 1) + sample.completion_ids


def test_the_reward_gain_is_paired_and_resamples_whole_prompts() -> None:
    """A prompt's difficulty moves its before and after alike and cancels; what a prompt adds to its own gain is
    shared by its completions, so the interval is as wide as the prompts' spread says (1.96·sd/√prompts each
    side), not √completions narrower."""
    from training.stages.rl import reward_gain

    rng = np.random.default_rng(0)
    prompts, samples = 400, 8
    difficulty = np.repeat(rng.normal(0.0, 1.0, prompts), samples)
    own_gain = np.repeat(rng.normal(0.03, 0.1, prompts), samples)
    before = difficulty + rng.normal(0.0, 0.01, prompts * samples)
    after = difficulty + own_gain + rng.normal(0.0, 0.01, prompts * samples)
    gain = reward_gain(before, after, samples)
    low, high = gain["rl/heldout_reward_gain_low"], gain["rl/heldout_reward_gain_high"]
    assert low < gain["rl/heldout_reward_gain"] < high and low > 0.0
    assert (high - low) / 2 == pytest.approx(1.96 * 0.1 / np.sqrt(prompts), rel=0.2)
