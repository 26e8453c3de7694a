"""How a conversation becomes text, and which characters of it carry the loss.

Two formats, one interface (`render`, `prompt`, `end_of_turn`): lmforge's own layout, `<|role|>\\n{content}<|end|>\\n`
per turn (`CHAT_TEMPLATE` writes the same text), and the chat template a model's tokenizer ships with (a Hugging Face
directory's `tokenizer_config.json` or `chat_template.jinja`), rendered by transformers exactly as the model is
served. The loss spans of a template are found the way TRL's and open-instruct's prefix masks find them: an
assistant turn's span is what rendering the conversation through that turn adds to rendering the turns before it
with the generation prompt, up to and including the template's end-of-turn token (the first special token the
template writes after an answer). A template for which the earlier turns are not a prefix of the later ones (one that
rewrites history) is refused in one line, as is one that never closes an answer with a special token.

A tokenizer with no chat template gets lmforge's layout, its turns closed by `<|end|>` when the vocabulary has it and
by the tokenizer's end-of-text token otherwise.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from data_pipeline.config import END_OF_TURN
from data_pipeline.sources import DataError
from data_pipeline.tokenizer import CHAT_TEMPLATE, TokenizerRef

Messages = list[dict[str, str]]
Span = tuple[int, int]
PROBE = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]


@dataclass(frozen=True)
class ChatFormat:
    """A tokenizer's way of writing conversations: its chat template (None: lmforge's own layout) and the token that
    ends an assistant turn (where generation stops and the answer's loss ends)."""

    tokenizer_dir: str
    template: str | None
    end_of_turn: str

    @property
    def key(self) -> dict[str, str]:
        """What a cached step's key gains from the format: nothing for lmforge's layout (keys stay as they were),
        the template's digest otherwise."""
        if self.template is None:
            return {}
        return {"chat_template_sha256": hashlib.sha256(self.template.encode()).hexdigest()}

    def render(self, messages: Messages) -> tuple[str, list[Span]]:
        """The conversation's text and the character spans that carry loss: each assistant answer and the
        end-of-turn token after it."""
        if self.template is None:
            return own_layout(messages, self.end_of_turn)
        self._check_contents(messages)
        text = self._apply(messages, False)
        spans = []
        for i, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            before, through = self._apply(messages[:i], True), self._apply(messages[: i + 1], False)
            if not (through.startswith(before) and text.startswith(through)):
                raise DataError(
                    f"{self.tokenizer_dir}: its chat template rewrites earlier turns when a conversation goes on "
                    "(a turn's text is not a prefix of the longer conversation's), so answers cannot be masked "
                    "exactly; give the model a template whose turns only append"
                )
            end = through.find(self.end_of_turn, len(before))
            if end < 0:
                raise DataError(
                    f"{self.tokenizer_dir}: its chat template does not close an answer with {self.end_of_turn!r}; "
                    "give the model a template that ends each assistant turn with an end-of-turn token"
                )
            spans.append((len(before), end + len(self.end_of_turn)))
        return text, spans

    @property
    def after_turn(self) -> str:
        """What the format writes after an answer's end-of-turn token when the conversation ends there (lmforge's
        layout and ChatML: a newline; Llama 3: nothing): the end of a rendered conversation, where the reward model
        reads its score."""
        text, spans = self.render(PROBE)
        return text[spans[-1][1] :]

    def prompt(self, messages: Messages) -> str:
        """The conversation's text up to where the assistant's answer starts."""
        if self.template is None:
            return own_layout(messages, self.end_of_turn)[0] + "<|assistant|>\n"
        return self._apply(messages, True)

    def _check_contents(self, messages: Messages) -> None:
        """Refuse a turn whose text holds one of the tokenizer's special tokens (`<|im_end|>` in an answer would end
        the turn there, and could forge the next one): one line naming it."""
        specials = special_tokens(self.tokenizer_dir)
        for turn in messages:
            found = next((t for t in specials if t in turn["content"]), None)
            if found is not None:
                raise DataError(
                    f"an example's {turn['role']} turn contains the tokenizer's special token {found!r} "
                    f"({turn['content'][:60]!r}...); remove it from the text"
                )

    def _apply(self, messages: Messages, generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return renderer(self.tokenizer_dir).apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except TemplateError as error:
            raise DataError(
                f"{self.tokenizer_dir}: its chat template failed on a conversation ({error}); "
                "check the conversations' roles against what the template accepts"
            ) from None


def own_layout(messages: Messages, end_of_turn: str = END_OF_TURN) -> tuple[str, list[Span]]:
    """lmforge's layout (equal to `CHAT_TEMPLATE`'s output when `end_of_turn` is `<|end|>`) and its loss spans."""
    text, spans = "", []
    for turn in messages:
        text += f"<|{turn['role']}|>\n"
        start = len(text)
        text += turn["content"] + end_of_turn
        if turn["role"] == "assistant":
            spans.append((start, len(text)))
        text += "\n"
    return text, spans


@functools.lru_cache(maxsize=8)
def renderer(tokenizer_dir: str) -> Any:
    """transformers' fast tokenizer of the directory: what renders its chat template, special tokens included."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)


@functools.lru_cache(maxsize=8)
def special_tokens(tokenizer_dir: str) -> tuple[str, ...]:
    """The tokenizer's special tokens (added tokens marked special)."""
    decoder = renderer(tokenizer_dir).backend_tokenizer.get_added_tokens_decoder()
    return tuple(t.content for t in decoder.values() if t.special)


def saved_template(directory: Path) -> str | None:
    """The chat template a tokenizer directory ships (`chat_template.jinja`, else `tokenizer_config.json`'s
    `chat_template`, its `default` entry when it names several)."""
    if (directory / "chat_template.jinja").is_file():
        return (directory / "chat_template.jinja").read_text()
    settings = directory / "tokenizer_config.json"
    template = json.loads(settings.read_text()).get("chat_template") if settings.is_file() else None
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        template = named.get("default")
    return template if isinstance(template, str) else None


def chat_token_ids(tok: TokenizerRef) -> list[int]:
    """The special tokens a conversation in this tokenizer's chat format is written with (role markers,
    end-of-turn; a template's begin-of-text too): the rows a tuned model must learn to read and write."""
    fmt, tokenizer = chat_format(tok), tok.load()
    specials = set(special_tokens(tok.path))
    try:
        text = fmt.render([{"role": "system", "content": "Be brief."}, *PROBE])[0]
    except DataError:  # a template without a system role
        text = fmt.render(PROBE)[0]
    text += fmt.prompt(PROBE)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return sorted({i for i in ids if tokenizer.id_to_token(i) in specials})


@functools.lru_cache(maxsize=32)
def chat_format(tok: TokenizerRef) -> ChatFormat:
    """The format conversations take with this tokenizer: its template's, or lmforge's own layout."""
    directory = Path(tok.path)
    template = saved_template(directory)
    tokenizer = tok.load()
    if template is None or template == CHAT_TEMPLATE:
        own_end = tokenizer.token_to_id(END_OF_TURN) is not None
        return ChatFormat(str(directory), None, END_OF_TURN if own_end else tokenizer.id_to_token(tok.eos_id))
    fmt = ChatFormat(str(directory), template, "")
    before, through = fmt._apply(PROBE[:1], True), fmt._apply(PROBE, False)
    answer_end = through.find(PROBE[1]["content"], len(before)) + len(PROBE[1]["content"])
    found = [(through.find(special, answer_end), special) for special in special_tokens(str(directory))]
    closing = [(at, special) for at, special in found if at >= 0]
    if not through.startswith(before) or not closing:
        raise DataError(
            f"{directory}: its chat template does not close an answer with a special token; give the model a "
            "template that ends each assistant turn with an end-of-turn token"
        )
    return ChatFormat(str(directory), template, min(closing)[1])
