"""Evaluation settings (the recipe's `eval:` section)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

DEFAULT_PROMPTS = ("def ", "import os\n", "class ", '    """Return ')


class EvalConfig(BaseModel):
    """What `run_eval` measures: held-out text, downstream tasks, optional lm-eval tasks, samples, gates."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_documents: PositiveInt = 200  # held-out documents scored for loss / perplexity / bits per byte
    batch_size: PositiveInt = 16
    tasks: list[str] = Field(default_factory=lambda: ["builtin"])  # JSONL task files, or "builtin"
    builtin_questions: PositiveInt = 100  # per built-in task
    lm_eval_tasks: list[str] = Field(default_factory=list)  # harness task names (offline)
    lm_eval_include: str | None = None  # directory of local harness task YAMLs
    lm_eval_limit: PositiveInt | None = None
    prompts: list[str] = Field(default_factory=lambda: list(DEFAULT_PROMPTS))
    max_new_tokens: PositiveInt = 32
    temperature: float = Field(0.8, ge=0)
    seed: NonNegativeInt = 0
    spectra: bool = True  # singular-value spectra / effective rank of weights and LoRA updates
    # registry gates: the candidate alias is set only when every gate passes
    register_name: str | None = None  # default "lmforge-<recipe name>"
    alias: str = "candidate"
    gate_below_base: bool = True  # the fine-tuned model's held-out response loss must beat the base's
