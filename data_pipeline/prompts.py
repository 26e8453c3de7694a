"""Prompts for reinforcement learning: the turns before an answer, rendered in the tokenizer's chat format
(`data_pipeline/chat.py`) up to the assistant's header (where the policy starts writing), with what a verifiable reward needs.

Sources: `sft` (the SFT conversations' prompts), `digits` (the built-in toy task: requests for numbers, which a
tiny model learns to answer in digits against the `regex` reward within a few hundred CPU steps), or a JSONL
file of `{"prompt", "tests"}` records (`prompt` a string or a list of chat turns; `tests`, optional, Python
code a completion must pass under the `unit_tests` reward). A prompt longer than `max_prompt_tokens` is dropped
and counted. Stored as JSONL per split with a manifest holding the tokenizer digest.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from data_pipeline.chat import Messages, chat_format
from data_pipeline.config import ROLES, SPECIAL_TOKENS, PromptsConfig
from data_pipeline.loader import EpochSampler, SampledLoader
from data_pipeline.sources import DataError, split_of
from data_pipeline.tokenizer import TokenizerRef
from infra.steps import Artifact, Step, run_step
from infra.storage import MANIFEST, atomic_write_bytes, digest_of

log = logging.getLogger(__name__)
PROMPTS_FORMAT_VERSION = 1


class Prompt(NamedTuple):
    messages: Messages  # the turns before the answer
    tests: str | None = None  # Python code a completion must pass (the `unit_tests` reward)

    def as_json(self) -> dict[str, Any]:
        return {"messages": self.messages, "tests": self.tests}


class PromptBatch(NamedTuple):
    """B prompts: their token ids (chat template up to the assistant header) and records."""

    ids: list[list[int]]
    prompts: list[Prompt]

    def n_targets(self) -> int:
        return len(self.ids)


# ---- sources ----------------------------------------------------------------------------------------------

DIGIT_REQUESTS = (
    "Write a number.",
    "Give me a number.",
    "Reply with a number.",
    "Name a number.",
    "Pick a number.",
    "Say a number.",
    "Write down a number.",
    "Tell me a number.",
)


def digit_prompts(n: int = 400) -> list[Prompt]:
    """The toy task: `n` requests for a number of some length (the `regex` reward scores the digits' share)."""
    sizes = ("", "small ", "large ", "long ", "short ", "big ", "random ", "lucky ")
    return [
        Prompt(
            [
                {
                    "role": "user",
                    "content": f"{DIGIT_REQUESTS[i % 8].replace('a number', f'a {size}number')} #{i}",
                }
            ]
        )
        for i, size in ((i, sizes[(i // 8) % 8]) for i in range(n))
    ]


def _prompt(record: Any, where: str) -> Prompt:
    """A `{"prompt", "tests"}` record, checked."""
    if not isinstance(record, dict) or "prompt" not in record:
        raise DataError(f"{where}: expected a record {{'prompt': ..., 'tests': ...}} with at least 'prompt'")
    prompt, tests = record["prompt"], record.get("tests")
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        raise DataError(
            f"{where}: 'prompt' must be a string or a non-empty list of {{'role', 'content'}} turns"
        )
    if not all(isinstance(t.get("content"), str) for t in turns) or not (
        tests is None or isinstance(tests, str)
    ):
        raise DataError(f"{where}: the prompt's contents and 'tests' must be strings")
    if any(t.get("role") not in ROLES for t in turns):
        raise DataError(f"{where}: unknown role in the prompt; roles are {', '.join(ROLES)}")
    if reserved := [m for m in SPECIAL_TOKENS for t in turns if m in t["content"]]:
        raise DataError(f"{where}: the prompt contains the reserved marker {reserved[0]}; remove it")
    return Prompt([{"role": t["role"], "content": t["content"]} for t in turns], tests)


def read_prompts(path: Path) -> list[Prompt]:
    """User-supplied prompts from JSONL, one record per line."""
    if not path.is_file():
        raise DataError(f"data.prompts.source: {path} does not exist; give a JSONL file, 'sft' or 'digits'")
    prompts = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{lineno}: not valid JSON ({error.msg})") from None
            prompts.append(_prompt(record, f"{path}:{lineno}"))
    if not prompts:
        raise DataError(f"{path}: no prompts")
    return prompts


def prompts_of(cfg: PromptsConfig, conversations: list[Messages]) -> list[Prompt]:
    """The configured prompts (`conversations`: the SFT conversations, for `sft`), at most `max_prompts`."""
    if cfg.source == "sft":
        prompts = [Prompt(c[:-1]) for c in conversations]
    elif cfg.source == "digits":
        prompts = digit_prompts()
    else:
        prompts = read_prompts(Path(cfg.source))
    return prompts[: cfg.max_prompts]


# ---- encoding ---------------------------------------------------------------------------------------------


class PromptManifest(Artifact):
    """Encoded prompts (train.jsonl and heldout.jsonl: messages, tests, ids)."""

    version: int
    tokenizer_digest: str
    pad_id: int
    end_of_turn_id: int  # where a completion stops
    max_prompt_tokens: int
    counts: dict[str, int]  # prompts per split, plus dropped_too_long
    config: dict[str, Any]

    @classmethod
    def load(cls, directory: str | Path) -> PromptManifest:
        if not (Path(directory) / MANIFEST).is_file():
            raise DataError(f"{directory}: no {MANIFEST}; run `lmforge rl` to build the prompts")
        return cls.from_file(Path(directory) / MANIFEST)

    def records(self, split: str) -> list[tuple[Prompt, list[int]]]:
        lines = (Path(self.path) / f"{split}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines if line]
        return [(Prompt(r["messages"], r["tests"]), r["ids"]) for r in records]


def run_prompt_data(
    cfg: PromptsConfig, prompts: list[Prompt], tok: TokenizerRef, max_prompt_tokens: int, root: str | Path
) -> PromptManifest:
    """Stage: encode `prompts` into `<root>/rl_prompts/prompts-<hash>/{train,heldout}.jsonl`."""
    config = {
        "config": cfg.model_dump(mode="json", exclude={"source"}),
        "prompts": digest_of([p.as_json() for p in prompts]),
        "tokenizer": tok.digest,
        "max_prompt_tokens": max_prompt_tokens,
        **chat_format(tok).key,
    }
    step = Step("rl_prompts", "prompts", PROMPTS_FORMAT_VERSION, config, PromptManifest)
    return run_step(root, step, lambda out, _key: _encode(cfg, prompts, tok, max_prompt_tokens, out))


def _encode(
    cfg: PromptsConfig, prompts: list[Prompt], tok: TokenizerRef, max_prompt_tokens: int, out: Path
) -> PromptManifest:
    tokenizer, fmt = tok.load(), chat_format(tok)
    splits: dict[str, list[str]] = {"train": [], "heldout": []}
    too_long = 0
    for prompt in prompts:
        ids = tokenizer.encode(fmt.prompt(prompt.messages), add_special_tokens=False).ids
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        record = json.dumps({**prompt.as_json(), "ids": ids})
        split = (
            "heldout"
            if split_of(json.dumps(prompt.as_json(), sort_keys=True), cfg.heldout_fraction) == "val"
            else "train"
        )
        splits[split].append(record)
    if too_long:
        log.warning("RL prompts: dropped_too_long %d (longer than %d tokens)", too_long, max_prompt_tokens)
    if not splits["train"] or not splits["heldout"]:
        raise DataError(
            f"prompt source {cfg.source!r}: too few usable prompts for a train and a held-out split ({len(prompts)} "
            f"read, {too_long} longer than {max_prompt_tokens} tokens); add prompts, shorten them or lower "
            "rl.max_new_tokens, or change data.prompts.heldout_fraction"
        )
    for split, lines in splits.items():
        atomic_write_bytes(out / f"{split}.jsonl", "".join(line + "\n" for line in lines).encode())
    return PromptManifest(
        version=PROMPTS_FORMAT_VERSION,
        path=str(out.resolve()),
        tokenizer_digest=tok.digest,
        pad_id=tok.pad_id,
        end_of_turn_id=tokenizer.token_to_id(fmt.end_of_turn),
        max_prompt_tokens=max_prompt_tokens,
        counts={"dropped_too_long": too_long, **{split: len(lines) for split, lines in splits.items()}},
        config=cfg.model_dump(mode="json"),
    )


# ---- loading ----------------------------------------------------------------------------------------------


class PromptLoader(SampledLoader):
    """Prompt batches in the same deterministic, rank-sharded, resumable order as the other loaders."""

    def __init__(
        self,
        manifest: PromptManifest,
        split: str = "train",
        *,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        accumulation: int = 1,
    ) -> None:
        self.records = manifest.records(split)
        self.sampler = EpochSampler(
            len(self.records), batch_size, rank, world_size, seed, shuffle, accumulation
        )

    def __len__(self) -> int:
        return self.sampler.n_items

    def batch_of(self, indices: np.ndarray) -> PromptBatch:
        chosen = [self.records[int(i)] for i in indices]
        return PromptBatch([ids for _, ids in chosen], [prompt for prompt, _ in chosen])
