"""Evaluation settings (the recipe's `eval:` section)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt

from data_pipeline.config import DataConfig
from infra.tracking import TrackingConfig
from training.compress.config import CompressConfig

DEFAULT_PROMPTS = ("def ", "import os\n", "class ", '    """Return ')
LOWER_IS_BETTER = ("loss", "bits_per_byte", "perplexity", "response_loss")


LOSS = "heldout/all/loss"  # the held-out metrics the frontier and the gates compare
BPB = "heldout/all/bits_per_byte"
GAIN_LOW = "rl/heldout_reward_gain_low"  # an RL model's held-out reward gain over its base, 95% lower end


class Gate(BaseModel):
    """A registry gate: the candidate may be worse than its base on `metric` by at most `tolerance` (relative to
    the base's value); with `improve`, it must be strictly better; with `at_least`, it must reach that value
    whatever its base's (a stop rate). Lower is better for losses, bits per byte and perplexity, higher for
    everything else (accuracies, exact match, stop rates)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    metric: str
    tolerance: float = Field(0.0, ge=0)
    improve: bool = False
    at_least: float | None = None

    @property
    def lower_is_better(self) -> bool:
        return self.metric.rsplit("/", 1)[-1] in LOWER_IS_BETTER

    def passes(self, candidate: float, base: float | None) -> bool:
        if self.at_least is not None:
            return candidate >= self.at_least
        assert base is not None, "a relative gate needs the base's value"
        sign = 1.0 if self.lower_is_better else -1.0  # sign * value: lower is better
        ours, theirs = sign * candidate, sign * base
        if self.improve:
            return ours < theirs
        return ours <= theirs + self.tolerance * abs(base)


# a tuned model ends its turn (greedy, on held-out prompts)
STOPS = Gate(metric="sft-heldout-em/stop_rate", at_least=0.9)
DEFAULT_GATES = (
    Gate(metric="sft-heldout-em/response_loss", improve=True),  # fine-tuning did what it was for
    STOPS,
    Gate(metric="heldout/all/bits_per_byte", tolerance=0.02),  # without forgetting the pretraining text
    Gate(metric="stdlib-import-mc/acc", tolerance=0.10),  # or the downstream task
)
DEFAULT_DPO_GATES = (  # a preference-tuned model against the model it started from
    Gate(
        metric="preference-heldout/logp_margin", improve=True
    ),  # it prefers the chosen answers more strongly
    Gate(metric="preference-heldout/accuracy"),  # and no less often
    STOPS,
    Gate(metric="sft-heldout-em/response_loss", tolerance=0.05),  # without unlearning the answers
    Gate(metric="heldout/all/bits_per_byte", tolerance=0.02),  # or the pretraining text
)
DEFAULT_RL_GATES = (  # an RL model against the model it started from
    # the reward rose on held-out prompts beyond its draws' noise: the lower end of the gain's 95% interval
    Gate(metric=GAIN_LOW, improve=True),  # (paired over the prompts) above the base's 0
    STOPS,
    Gate(metric="sft-heldout-em/response_loss", tolerance=0.05),  # the tax: the answers are not unlearned
    Gate(metric="heldout/all/bits_per_byte", tolerance=0.02),  # nor the pretraining text
)


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
    # FAVOR+ feature counts at which a softmax model's attention is approximated per layer (empty: skipped)
    favor_features: list[PositiveInt] = Field(default_factory=lambda: [16, 32, 64, 128, 256])
    # registry gates: the candidate alias is set only when every gate passes
    register_name: str | None = None  # default "lmforge-<recipe name>"
    alias: str = "candidate"
    gates: list[Gate] = Field(default_factory=lambda: list(DEFAULT_GATES))  # candidate vs its base
    dpo_gates: list[Gate] = Field(
        default_factory=lambda: list(DEFAULT_DPO_GATES)
    )  # a DPO candidate vs its base
    rl_gates: list[Gate] = Field(
        default_factory=lambda: list(DEFAULT_RL_GATES)
    )  # an RL candidate vs its base

    def gates_for(self, kind: str) -> list[Gate]:
        if kind.startswith("rl"):
            return self.rl_gates
        return self.dpo_gates if kind.startswith("dpo") else self.gates


class EvalSpec(BaseModel):
    """What evaluation receives: its settings, the data config (held-out documents are re-read from it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    output_dir: str
    eval: EvalConfig = EvalConfig()
    data: DataConfig = DataConfig()
    tracking: TrackingConfig = TrackingConfig()


class FrontierSpec(BaseModel):
    """What the frontier receives: the evaluation settings, the corpus (held-out text) and the compress section
    (tolerance, alias, generation length)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    output_dir: str
    eval: EvalConfig = EvalConfig()
    data: DataConfig = DataConfig()
    compress: CompressConfig = CompressConfig()
    tracking: TrackingConfig = TrackingConfig()
