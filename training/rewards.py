"""The rewards of RL: each completion's weighted sum of reward functions (`RewardTerm`s of the recipe).

Built in: `reward_model` (a trained reward model's score of prompt + completion), `length` (the distance from a
target length, negated), `regex` (the share of the completion's characters inside the pattern's matches) and
`unit_tests` (the completion run against the prompt's tests in the sandbox of `training/verifiable.py`); any
`module:function` called as `function(prompt, completion) -> float`. A function that raises or returns a
non-finite value scores that completion 0, is counted, and is logged once per batch: a bad reward never costs
the run.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from data_pipeline.chat import chat_format
from data_pipeline.prompts import Prompt
from data_pipeline.sources import DataError
from data_pipeline.tokenizer import describe
from training.config import RewardTerm
from training.model.reward import RewardModel, load_reward_model
from training.verifiable import SandboxLimits, run_python_tests

log = logging.getLogger(__name__)
BUILTIN = ("reward_model", "length", "regex", "unit_tests")
CODE_BLOCK = re.compile(r"```(?:python)?\n(.*?)(?:```|$)", re.DOTALL)


@dataclass(frozen=True)
class Sample:
    """One completion of one prompt: the prompt, its ids, the completion's ids (with the end-of-turn marker
    when it stopped), its text (without it) and the prompt's text as the policy saw it (in its chat format)."""

    prompt: Prompt
    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    prompt_text: str


@dataclass(frozen=True)
class Scores:
    """Rewards of B samples: the weighted sum (B,), each function's (B,) with failures as 0, failure counts."""

    total: Tensor
    by_function: dict[str, Tensor]
    failures: dict[str, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, Tensor]:
        out = {"rewards/mean": self.total.mean(), "rewards/std": self.total.std(correction=0)}
        for name, values in self.by_function.items():
            out[f"rewards/{name}/mean"] = values.mean()
            out[f"rewards/{name}/std"] = values.std(correction=0)
            out[f"rewards/{name}/failures"] = torch.tensor(float(self.failures.get(name, 0)))
        return out


ScoreFn = Callable[[Sequence[Sample]], list[float]]


def length_reward(target: int) -> ScoreFn:
    return lambda samples: [-abs(len(s.completion_ids) - target) / target for s in samples]


def regex_reward(pattern: str) -> ScoreFn:
    compiled = re.compile(pattern)

    def score(samples: Sequence[Sample]) -> list[float]:
        return [sum(len(m.group()) for m in compiled.finditer(s.text)) / max(1, len(s.text)) for s in samples]

    return score


def code_of(text: str) -> str:
    """The completion's Python code: the first fenced block when there is one, else the whole text."""
    match = CODE_BLOCK.search(text)
    return match.group(1) if match else text


def unit_tests_reward(timeout_s: float) -> ScoreFn:
    limits = SandboxLimits(wall_seconds=timeout_s)

    def score(samples: Sequence[Sample]) -> list[float]:
        rewards = []
        for s in samples:
            if s.prompt.tests is None:
                raise ValueError("the prompt has no tests; give each prompt a 'tests' field for unit_tests")
            rewards.append(run_python_tests(code_of(s.text), s.prompt.tests, limits).reward)
        return rewards

    return score


def reward_model_reward(
    model: RewardModel, reading: ReadingPosition, max_len: int, batch_size: int = 16
) -> ScoreFn:
    """The reward model's score of each completion, read where it was trained to read: a completion that ended its
    turn is followed by what the chat format writes after the end-of-turn token, as in the reward model's data."""

    @torch.no_grad()
    def score(samples: Sequence[Sample]) -> list[float]:
        rewards: list[float] = []
        for start in range(0, len(samples), batch_size):
            rows = [
                reading.row(s.prompt_ids, s.completion_ids)[:max_len]
                for s in samples[start : start + batch_size]
            ]
            tokens = torch.full((len(rows), max(map(len, rows))), model.pad_id, dtype=torch.int64)
            for i, row in enumerate(rows):
                tokens[i, : len(row)] = torch.tensor(row)
            rewards += model(tokens).logits.float().squeeze(-1).tolist()
        return rewards

    return score


@dataclass(frozen=True)
class ReadingPosition:
    """Where the reward model reads a conversation: its last token as the chat format renders it, i.e. after the
    answer's end-of-turn token and what the format writes after it (`ChatFormat.after_turn`), the same in its
    training and held-out scoring (`PreferenceLoader(whole=True)`), in RL and for a client that scores
    `apply_chat_template` text with the Hugging Face export."""

    end_of_turn: int
    after_turn: tuple[int, ...]

    @classmethod
    def of(cls, export_dir: Path) -> ReadingPosition:
        tok = describe(export_dir)
        fmt, tokenizer = chat_format(tok), tok.load()
        after = tokenizer.encode(fmt.after_turn, add_special_tokens=False).ids
        return cls(tokenizer.token_to_id(fmt.end_of_turn), tuple(after))

    def row(self, prompt_ids: list[int], completion_ids: list[int]) -> list[int]:
        """The tokens to score: a completion that ended its turn gets the format's ending after it."""
        ended = bool(completion_ids) and completion_ids[-1] == self.end_of_turn
        return [*prompt_ids, *completion_ids, *(self.after_turn if ended else ())]


def user_function(path: str) -> ScoreFn:
    """`module:function`, imported here, called per completion with the prompt's text and the completion's."""
    module, _, name = path.partition(":")
    try:
        function = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise DataError(
            f"rl.rewards: cannot import {path!r} ({type(error).__name__}: {error}); give module:function "
            f"importable from this environment, or one of {', '.join(BUILTIN)}"
        ) from None
    return lambda samples: [float(function(s.prompt_text, s.text)) for s in samples]


def check_terms(terms: Sequence[RewardTerm], reward_model: str | None) -> None:
    """Refuse, before training, a reward function that cannot be built (one line naming it and the fix)."""
    for term in terms:
        if term.function == "reward_model" and reward_model is None:
            raise DataError(
                "rl.rewards uses the reward model, but none was given; train one (`lmforge reward-model`, or the "
                "pipeline's --reward-model) or drop `reward_model` from rl.rewards"
            )
        if term.function == "regex":
            try:
                re.compile(term.pattern)
            except re.error as error:
                raise DataError(f"rl.rewards: regex pattern {term.pattern!r} is invalid ({error})") from None
        if term.function not in BUILTIN and ":" not in term.function:
            raise DataError(
                f"rl.rewards: unknown reward function {term.function!r}; use one of {', '.join(BUILTIN)} or "
                "module:function"
            )
        if ":" in term.function:
            user_function(term.function)


class Rewards:
    """The weighted reward functions of a run."""

    def __init__(self, terms: Sequence[RewardTerm], reward_model: str | None, max_len: int) -> None:
        check_terms(terms, reward_model)
        self.terms = list(terms)
        self.functions: dict[str, ScoreFn] = {}
        for term in terms:
            if term.function == "reward_model":
                export = Path(str(reward_model))
                self.functions[term.name] = reward_model_reward(
                    load_reward_model(export), ReadingPosition.of(export), max_len
                )
            elif term.function == "length":
                self.functions[term.name] = length_reward(term.target_tokens)
            elif term.function == "regex":
                self.functions[term.name] = regex_reward(term.pattern)
            elif term.function == "unit_tests":
                self.functions[term.name] = unit_tests_reward(term.timeout_s)
            else:
                self.functions[term.name] = user_function(term.function)

    def score(self, samples: Sequence[Sample]) -> Scores:
        by_function, failures = {}, {}
        total = torch.zeros(len(samples), dtype=torch.float64)
        for term in self.terms:
            values, failed = self._call(term.name, samples)
            by_function[term.name] = values
            failures[term.name] = failed
            total += term.weight * values
        return Scores(total, by_function, failures)

    def _call(self, name: str, samples: Sequence[Sample]) -> tuple[Tensor, int]:
        """The function's rewards, a failing or non-finite one as 0, and how many failed."""
        function, problem = self.functions[name], ""
        try:
            values = function(samples)
            if len(values) != len(samples):
                raise ValueError(f"returned {len(values)} rewards for {len(samples)} completions")
        except Exception as error:  # noqa: BLE001 - a user's reward function must not end the run
            values, problem = [], f"{type(error).__name__}: {error}"
            for sample in samples:  # one by one: only the completions it fails on score 0
                try:
                    values.append(float(function([sample])[0]))
                except Exception as single:  # noqa: BLE001
                    values.append(math.nan)
                    problem = f"{type(single).__name__}: {single}"
        rewards = torch.tensor(values, dtype=torch.float64)
        bad = ~torch.isfinite(rewards)
        failed = int(bad.sum())
        if failed:
            log.warning(
                "reward function %r failed on %d of %d completions (scored 0): %s",
                name,
                failed,
                len(samples),
                problem or "a non-finite reward",
            )
        return rewards.masked_fill(bad, 0.0), failed
