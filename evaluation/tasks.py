"""Downstream tasks from local JSONL files, and the built-in suite that the demo data makes meaningful.

Task file format (one JSON object per line; the file name is the task name):

    {"prompt": "from os.path import", "choices": [" join", " loads", " sleep"], "answer": 0}   # multiple choice
    {"prompt": "Q: 2+2=\\nA:", "target": " 4", "stop": ["\\n"]}                                  # generation

Multiple choice is scored by log-likelihood: accuracy, and accuracy with each choice's log-likelihood divided by
its length in characters (lm-eval's acc_norm, `api/task.py`, exactly). Generation is greedy and scored by exact match after trimming whitespace; its
log-likelihood of the target (response loss, nats per token) is reported too.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import random
import sys
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from data_pipeline.chat import ChatFormat, Messages, chat_format
from data_pipeline.config import END_OF_TURN
from data_pipeline.sources import DataError, stdlib_files, stdlib_root
from evaluation.model_io import EvalModel
from evaluation.scoring import generate_greedy, score_continuations
from infra.mirror import cache_root
from infra.storage import atomic_write_json


@dataclass(frozen=True)
class Item:
    prompt: str
    choices: tuple[str, ...] = ()
    answer: int = 0
    target: str = ""
    stop: tuple[str, ...] = ("\n",)
    turns: Messages | None = None  # a chat item's conversation: each model reads it in its own chat format


def in_chat_format(item: Item, em: EvalModel) -> Item:
    """A chat item's prompt and stop in the model's chat format (its template's, or lmforge's layout)."""
    if item.turns is None:
        return item
    fmt = chat_format(em.tokenizer_ref)
    return replace(item, prompt=fmt.prompt(item.turns), stop=(fmt.end_of_turn,))


@dataclass(frozen=True)
class Task:
    name: str
    kind: Literal["mc", "gen"]
    items: list[Item] = field(default_factory=list)


def load_task(path: str | Path) -> Task:
    """Read a task file; a malformed line is an error naming the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"task file {path} does not exist")
    items, kind = [], None
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{where}: not valid JSON ({error.msg})") from None
        item, line_kind = _parse_item(record, where)
        if kind is not None and line_kind != kind:
            raise DataError(f"{where}: a {line_kind} item in a {kind} task; keep one kind per file")
        kind = line_kind
        items.append(item)
    if not items:
        raise DataError(
            f"task file {path} has no items; add JSON lines with prompt + choices/answer or prompt + target"
        )
    return Task(path.stem, kind, items)


def _parse_item(record: Any, where: str) -> tuple[Item, Literal["mc", "gen"]]:
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise DataError(f'{where}: each line needs a string "prompt"')
    if "choices" in record:
        choices, answer = record["choices"], record.get("answer")
        if (
            not isinstance(choices, list)
            or len(choices) < 2
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise DataError(f'{where}: "choices" must be a list of at least two non-empty strings')
        if not isinstance(answer, int) or not 0 <= answer < len(choices):
            raise DataError(
                f'{where}: "answer" must be the index of the right choice (0..{len(choices) - 1})'
            )
        return Item(record["prompt"], tuple(choices), answer), "mc"
    if isinstance(record.get("target"), str) and record["target"].strip():
        stop = record.get("stop", ["\n"])
        return Item(record["prompt"], target=record["target"], stop=tuple(stop)), "gen"
    raise DataError(
        f'{where}: give "choices" and "answer" (multiple choice) or a non-empty "target" (generation)'
    )


@lru_cache(maxsize=1)
def stdlib_public_names() -> dict[str, tuple[str, ...]]:
    """Public top-level functions and classes of each standard-library module. Parsing the standard library takes
    ~2 s, so each Python installation's answer is kept in the cache directory (`$LMFORGE_CACHE`) for every later
    process (each `lmforge eval` or pipeline launch paid it again)."""
    kept = _kept_names()
    with contextlib.suppress(OSError, ValueError, AttributeError):  # missing or unreadable: parse again
        return {module: tuple(names) for module, names in json.loads(kept.read_text()).items()}
    names = _parse_public_names()
    with contextlib.suppress(OSError):  # a read-only cache only costs the next process the parse
        atomic_write_json(kept, names)
    return names


def _kept_names() -> Path:
    """Where this Python installation's standard-library names are kept."""
    key = hashlib.sha256(f"{sys.version}|{stdlib_root()}".encode()).hexdigest()[:16]
    return cache_root() / "stdlib-names" / f"{key}.json"


def _parse_public_names() -> dict[str, tuple[str, ...]]:
    root, names = stdlib_root(), {}
    for path in stdlib_files():
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if not parts or any(p.startswith("_") or p in ("test", "tests", "idlelib") for p in parts):
            continue
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):
            continue
        public = tuple(
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.ClassDef) and not n.name.startswith("_")
        )
        if public:
            names[".".join(parts)] = public
    return names


def stdlib_import_task(n_items: int, seed: int = 0, n_choices: int = 4) -> Task:
    """ "from <module> import" + which name: one defined in the module, the others defined elsewhere."""
    rng = random.Random(seed)
    names = stdlib_public_names()
    modules = sorted(names)
    every = sorted({n for v in names.values() for n in v})
    items = []
    for module in rng.sample(modules, min(n_items, len(modules))):
        own = set(names[module])
        right = rng.choice(names[module])
        wrong = []
        while len(wrong) < n_choices - 1:
            candidate = rng.choice(every)
            if candidate not in own and candidate not in wrong:
                wrong.append(candidate)
        choices = [right, *wrong]
        rng.shuffle(choices)
        items.append(Item(f"from {module} import", tuple(f" {c}" for c in choices), choices.index(right)))
    return Task("stdlib-import-mc", "mc", items)


def sft_heldout_task(heldout_jsonl: str | Path, n_items: int) -> Task:
    """The held-out SFT conversations: the chat prompt, the reference answer as the exact-match target."""
    items, own = [], ChatFormat("", None, END_OF_TURN)
    for line in Path(heldout_jsonl).read_text().splitlines()[:n_items]:
        messages = json.loads(line)["messages"]
        prompt, turns = own.prompt(messages[:-1]), messages[:-1]
        items.append(Item(prompt, target=messages[-1]["content"], stop=(END_OF_TURN,), turns=turns))
    return Task("sft-heldout-em", "gen", items)


def answer_budget(
    em: EvalModel, item: Item, request: tuple[list[int], list[int]], max_new_tokens: int
) -> int:
    """Tokens a greedy answer may take: `max_new_tokens`; for a chat item, its reference's length plus
    `max_new_tokens` (a model that ends its turn has room to, however long the answer), within what the context
    leaves beside the prompt (never less than 1)."""
    if item.turns is None:
        return max_new_tokens
    context, continuation = request
    return max(1, min(len(continuation) + max_new_tokens, em.max_len - len(context)))


def _split_encode(em: EvalModel, prompt: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids such that together they are the tokenization of the whole string."""
    whole = em.tokenizer.encode(prompt + continuation).ids
    context = em.tokenizer.encode(prompt).ids
    if whole[: len(context)] == context and len(whole) > len(context):
        return context or [em.tokenizer_ref.eos_id], whole[len(context) :]
    return context or [em.tokenizer_ref.eos_id], em.tokenizer.encode(continuation).ids


def run_task(em: EvalModel, task: Task, batch_size: int, max_new_tokens: int) -> dict[str, float]:
    """The task's metrics for one model (plus `n` items and `truncated` prompts)."""
    if task.kind == "mc":
        requests, spans = [], []
        for item in task.items:
            spans.append((len(requests), len(item.choices)))
            requests += [_split_encode(em, item.prompt, c) for c in item.choices]
        scored = score_continuations(em.model, requests, batch_size)
        acc = acc_norm = 0
        for item, (start, count) in zip(task.items, spans, strict=True):
            lp = [s.logprob for s in scored[start : start + count]]
            norm = [v / len(c) for v, c in zip(lp, item.choices, strict=True)]  # characters, as lm-eval
            acc += max(range(count), key=lp.__getitem__) == item.answer
            acc_norm += max(range(count), key=norm.__getitem__) == item.answer
        n = len(task.items)
        truncated = len(
            {
                i
                for i, (start, count) in enumerate(spans)
                if any(s.truncated for s in scored[start : start + count])
            }
        )
        return {"acc": acc / n, "acc_norm": acc_norm / n, "n": n, "truncated": truncated}
    hits = truncated = 0
    items = [in_chat_format(item, em) for item in task.items]
    requests = [_split_encode(em, item.prompt, item.target + item.stop[0]) for item in items]
    # a special token (e.g. end of turn) ends generation; the items that share one are generated in batches
    stops = [em.tokenizer.token_to_id(item.stop[0]) for item in items]
    stops = [em.tokenizer_ref.eos_id if stop is None else stop for stop in stops]
    budgets = [
        answer_budget(em, item, request, max_new_tokens)
        for item, request in zip(items, requests, strict=True)
    ]
    generated: list[tuple[list[int], bool]] = [([], False)] * len(task.items)
    for stop in dict.fromkeys(stops):
        rows = [i for i, s in enumerate(stops) if s == stop]
        prompts, limits = [requests[i][0] for i in rows], [budgets[i] for i in rows]
        for i, out in zip(rows, generate_greedy(em.model, prompts, limits, stop, batch_size), strict=True):
            generated[i] = out
    stopped = 0
    for item, (ids, cut), budget in zip(items, generated, budgets, strict=True):
        text = em.tokenizer.decode(ids)
        for stop in item.stop:
            text = text.split(stop)[0]
        hits += text.strip() == item.target.strip()
        truncated += cut
        stopped += len(ids) < budget  # the stop token came within the budget (it is cut off the ids)
    scored = score_continuations(em.model, requests, batch_size)
    response_loss = -sum(s.logprob for s in scored) / sum(s.n_tokens for s in scored)
    n = len(task.items)
    metrics = {"exact_match": hits / n, "response_loss": response_loss, "n": n, "truncated": truncated}
    if all(item.turns is not None for item in task.items):  # a chat task: does the model end its turn?
        metrics["stop_rate"] = stopped / n
    return metrics
