"""Configuration slices for training: optimiser and schedule, parallelism, and the run itself.

Each slice is a frozen pydantic model with unknown keys forbidden; the recipe (`flows/recipe.py`) composes them
into per-stage specs (a `TrainingSpec` per training stage), and components receive only their own slice.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from infra.tracking import TrackingConfig
from training.model.config import ModelConfig

# Optimisers that precondition whole matrices: they take the blocks' 2-D weights (AdamW the rest) and need to see
# them as matrices, so neither ZeRO's flat partitions nor μP's per-group rates apply (training/optim/matrix.py).
MATRIX_OPTIMIZERS = ("soap", "shampoo", "kron", "kfac")
MATRIX_SETTINGS = ("matrix_lr", "precondition_every", "damping")


class OptimConfig(BaseModel):
    """Optimiser and learning-rate schedule: AdamW; Muon on 2-D hidden matrices with AdamW for the rest; or a
    matrix preconditioner (SOAP, Shampoo, PSGD-Kron from pytorch-optimizer, or lmforge's K-FAC) on the blocks'
    matrices with AdamW for the rest, at `matrix_lr` (default `lr`), refreshing its preconditioner every
    `precondition_every` steps; `damping` is K-FAC's λ and Shampoo's matrix ε."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Literal["adamw", "muon", "soap", "shampoo", "kron", "kfac"] = "adamw"
    lr: PositiveFloat = 3e-3
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    weight_decay: NonNegativeFloat = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: PositiveFloat = 1e-8
    grad_clip: NonNegativeFloat = 1.0  # 0 disables clipping
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: NonNegativeInt = 10
    decay_fraction: float = Field(default=0.2, gt=0.0, le=1.0)  # WSD: share of steps spent decaying
    matrix_lr: PositiveFloat | None = None  # matrix optimisers: peak learning rate of the matrices (None: lr)
    precondition_every: PositiveInt = 10  # matrix optimisers: steps between preconditioner refreshes
    damping: PositiveFloat = 1e-3  # K-FAC's Tikhonov λ; Shampoo's ε added to its statistics

    @model_validator(mode="after")
    def _check_betas(self) -> OptimConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas={self.betas} must both lie in [0, 1)")
        stray = [k for k in MATRIX_SETTINGS if getattr(self, k) != OptimConfig.model_fields[k].default]
        if stray and self.name not in MATRIX_OPTIMIZERS:
            raise ValueError(
                f"{', '.join(stray)}: a setting of the matrix optimisers ({', '.join(MATRIX_OPTIMIZERS)}) only, "
                f"not of name={self.name}; remove it or pick one of those optimisers"
            )
        return self

    def matrix_lr_mult(self) -> float:
        """The matrices' learning rate relative to `lr` (matrix optimisers)."""
        return (self.matrix_lr or self.lr) / self.lr


# the parallel settings an attempt may change when it resumes a run (ParallelConfig.layout)
LAYOUT = ("world_size", "ep_size")


def describe_layout(layout: dict[str, int]) -> str:
    return f"{layout['world_size']} worker(s) with ep_size {layout.get('ep_size', 1)}"


class ParallelConfig(BaseModel):
    """How a run is spread over workers: data parallel width, ZeRO stage, precision, expert parallelism."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    world_size: PositiveInt = 1
    zero_stage: Literal[0, 1, 2, 3] = 0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    ep_size: PositiveInt = 1
    activation_checkpointing: bool = False
    compile: Literal["auto"] | bool = (
        "auto"  # torch.compile of the blocks; auto: on CUDA, and on a CPU for dense models >= 256 wide (training/compile.py)
    )
    threads_per_worker: PositiveInt | None = None  # None: cores // workers, at least 1
    max_failures: NonNegativeInt = 0  # Ray Train restarts all workers from the last checkpoint this often
    # elastic: a restart after a failure goes on with as many workers as the cluster has free, down to this many
    # (among the counts the global batch splits evenly over) instead of waiting for world_size; None: it waits
    min_workers: PositiveInt | None = None
    placement: Literal["pack", "spread", "strict_spread"] = "pack"  # strict_spread: one worker per node
    deepspeed: dict[str, Any] = Field(
        default_factory=dict
    )  # extra keys merged into the generated DeepSpeed config

    def what(self) -> dict[str, Any]:
        """The settings that make the run what it is. Not threads, restarts or placement, and not the layout of
        an attempt (`layout()`): a run saved on one number of workers or experts per rank continues on another
        (the global batch, which the run key holds, stays)."""
        return self.model_dump(
            mode="json",
            exclude={"threads_per_worker", "max_failures", "min_workers", "placement", "compile", *LAYOUT},
        )

    def layout(self) -> dict[str, int]:
        """How this attempt spreads the run over workers (recorded in every checkpoint it writes)."""
        return {name: getattr(self, name) for name in LAYOUT}

    @model_validator(mode="after")
    def _check_ep(self) -> ParallelConfig:
        if self.world_size % self.ep_size:
            raise ValueError(
                f"ep_size={self.ep_size} must divide world_size={self.world_size}; "
                f"pick ep_size among the divisors of {self.world_size}"
            )
        if self.min_workers is not None and self.min_workers > self.world_size:
            raise ValueError(
                f"parallel.min_workers={self.min_workers} exceeds parallel.world_size={self.world_size}; lower it"
            )
        if self.min_workers is not None and self.ep_size > 1 and self.zero_stage not in (1, 2):
            raise ValueError(
                f"parallel.min_workers with ep_size={self.ep_size} needs parallel.zero_stage 1 or 2: experts move "
                f"to fewer workers from ZeRO's partitions (training/parallel/reshard.py), not with ZeRO-{self.zero_stage}"
            )
        if self.ep_size > 1 and self.compile is True:
            raise ValueError(
                f"parallel.compile=true with ep_size={self.ep_size}: DeepSpeed's expert-parallel layer (all-to-all) "
                "runs eager; set parallel.compile=auto or parallel.ep_size=1"
            )
        return self


class TrainConfig(BaseModel):
    """The run: batch arithmetic, horizon, evaluation and checkpoint cadence, seed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    seq_len: PositiveInt = 256
    micro_batch_size: PositiveInt = 8
    # sequences per optimiser step over all ranks and accumulation steps; None: micro_batch_size x world size
    global_batch_size: PositiveInt | None = None
    max_steps: PositiveInt = 100
    # shorter horizons a WSD run also decays to, each in a branch from its stable phase (multi-horizon runs)
    horizons: tuple[PositiveInt, ...] = ()
    eval_every: PositiveInt = 50
    eval_batches: PositiveInt = 8
    checkpoint_every: PositiveInt = 50
    keep_checkpoints: PositiveInt = 2
    # write checkpoint files on a background thread (DeepSpeed engine): a save blocks training only while the
    # state is copied to CPU memory; the checkpoint is marked complete at the next save or at the end of the run
    async_checkpoint: bool = False
    # consecutive skipped steps (non-finite losses, spikes) before the run stops
    max_bad_steps: PositiveInt = 5
    # loss spikes: a micro-batch whose loss exceeds the mean of the last `spike_window` accepted steps by
    # `spike_sigmas` of their standard deviations and by `spike_min_rise` of the mean is not applied (0 disables)
    spike_window: NonNegativeInt = 50
    spike_sigmas: PositiveFloat = 6.0
    spike_min_rise: NonNegativeFloat = 0.25
    # roll-back: after `rollback_spikes` spikes within `rollback_window` steps the run reloads its newest checkpoint
    # from before the first of them and goes on with the data after the last (the batches between are skipped), as
    # PaLM and OPT did by hand; 0 disables
    rollback_spikes: NonNegativeInt = 3
    rollback_window: PositiveInt = 100
    # stragglers: every `straggler_window` steps the ranks compare their local work per step (drawing micro-batches
    # and forward passes, where no collective waits); a rank `straggler_factor` times slower than the median rank is
    # named in a warning (0 disables; `perf/straggler_ratio` and `perf/slowest_rank` are logged either way)
    straggler_window: NonNegativeInt = 100
    straggler_factor: float = Field(default=1.25, gt=1.0)
    # hangs: a step running longer than max(hang_min_seconds, hang_factor x the median step) ends the attempt with
    # every thread's stack in <run>/hang-rank<r>.txt (training/watchdog.py); hang_factor 0 turns it off
    hang_factor: NonNegativeFloat = 20.0
    hang_min_seconds: PositiveFloat = 600.0
    peak_flops: PositiveFloat | None = (
        None  # per device, for perf/mfu; None: published GPU peak or measured GEMM
    )
    seed: NonNegativeInt = 0

    def eval_batches_per_rank(self, world_size: int) -> int:
        """Validation micro-batches each rank draws: together the first `eval_batches` x `micro_batch_size`
        sequences of the split on any number of ranks (all of them when the ranks divide `eval_batches`), so a
        run's validation curve goes on unchanged when the run continues on another layout."""
        return -(-self.eval_batches // world_size)

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches each rank accumulates per step; the recipe checks this divides evenly."""
        return self.global_batch(world_size) // (self.micro_batch_size * world_size)

    def global_batch(self, world_size: int) -> int:
        return self.global_batch_size or self.micro_batch_size * world_size


class LoraSettings(BaseModel):
    """Low-rank adapters (Hu et al. 2021) on the named linear layers (and, optionally, the stacked experts)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    r: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    experts: bool = False  # also adapt MoE experts' stacked weights (PEFT target_parameters)
    # also train the embedding (and output) rows of the chat format's special tokens (role markers, end-of-turn) as
    # PEFT trainable token rows: a model pretrained on plain text never saw them, and LoRA alone cannot end a turn
    train_chat_tokens: bool = True


class PretrainConfig(BaseModel):
    """Pretraining's own settings (the recipe's `pretrain:` section; the model, optimiser and run are the recipe's
    `model:`, `optim:` and `train:`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # continued pretraining: a Hugging Face model directory (or a finished run) whose architecture, weights and
    # tokenizer the run starts from, with a new optimiser state and the schedule from step 0 (the recipe's `model:`
    # is then not used, and the corpus is tokenized with that model's tokenizer unless data.tokenizer.path names one)
    init_from: str | None = None


class SFTConfig(BaseModel):
    """Supervised fine-tuning (the recipe's `sft:` section) of a pretrained checkpoint, full or LoRA, with its own optimiser and run."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["full", "lora"] = "lora"
    lora: LoraSettings = LoraSettings()
    optim: OptimConfig = OptimConfig(lr=2e-3, warmup_steps=10, weight_decay=0.0, schedule="cosine")
    train: TrainConfig = TrainConfig(
        global_batch_size=None, max_steps=200, eval_every=50, checkpoint_every=100
    )
    eval_examples: PositiveInt = 64  # held-out prompts for exact match before and after
    # pretraining windows (train.seq_len tokens of the base's own token shards) stacked under every micro-batch, their
    # tokens in the loss beside the responses': replay, so fine-tuning does not forget the pretraining text
    replay_rows: NonNegativeInt = 0


class PreferenceLoss(BaseModel):
    """The DPO family, named as TRL names them: `sigmoid` (DPO), `ipo`, `hinge`, and `sigmoid_norm` (DPO on
    per-token mean log-probabilities, so long answers do not dominate); β scales the implicit reward."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    type: Literal["sigmoid", "ipo", "hinge", "sigmoid_norm"] = "sigmoid"
    beta: PositiveFloat = 0.1


class DPOConfig(BaseModel):
    """Preference tuning (the recipe's `dpo:` section): full or LoRA, from the fine-tuned (or pretrained) model,
    which is also the frozen reference."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["full", "lora"] = "lora"
    lora: LoraSettings = LoraSettings()
    loss: PreferenceLoss = PreferenceLoss()
    optim: OptimConfig = OptimConfig(lr=5e-4, warmup_steps=5, weight_decay=0.0, schedule="cosine")
    train: TrainConfig = TrainConfig(seq_len=128, max_steps=100, eval_every=50, checkpoint_every=50)
    eval_pairs: PositiveInt = 256  # held-out pairs scored before and after


class RewardModelConfig(BaseModel):
    """The reward model (the recipe's `reward_model:` section): the fine-tuned (or pretrained) model's decoder with
    a scalar head, trained on the preference pairs with the Bradley–Terry loss; `centring` adds TRL's
    `center_rewards_coefficient`·mean((r_chosen + r_rejected)²), which keeps the rewards near zero."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    centring: float = Field(0.0, ge=0.0)
    optim: OptimConfig = OptimConfig(lr=1e-4, warmup_steps=5, weight_decay=0.0, schedule="cosine")
    train: TrainConfig = TrainConfig(seq_len=128, max_steps=100, eval_every=50, checkpoint_every=50)
    eval_pairs: PositiveInt = 256  # held-out pairs scored after training


class RewardTerm(BaseModel):
    """One reward function of RL and its weight in the sum: `reward_model` (the reward model's score of prompt and
    completion), `length` (−|tokens − target_tokens| / target_tokens), `regex` (the share of the completion's
    characters inside matches of `pattern`; `[0-9]` by default, the toy task's), `unit_tests` (1 when the
    completion passes the prompt's tests in a sandboxed interpreter, else 0), or `module:function`, a function
    of your own called as `function(prompt: str, completion: str) -> float`. A function that raises or returns
    NaN scores that completion 0 and is counted (`rewards/<name>/failures`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    function: str
    weight: float = 1.0
    target_tokens: PositiveInt = 16  # `length`
    pattern: str = "[0-9]"  # `regex`
    timeout_s: PositiveFloat = 5.0  # `unit_tests`: wall-clock limit per completion

    @property
    def name(self) -> str:
        return self.function.rsplit(":", 1)[-1]


class RLConfig(BaseModel):
    """Reinforcement learning with group-relative advantages (the recipe's `rl:` section), from the fine-tuned
    model: per prompt `group_size` completions sampled from the current policy (`temperature`, `top_p`, at most
    `max_new_tokens`, stopping at the end-of-turn marker), scored by the weighted `rewards`, with advantages within
    the group. `baseline: grpo` (TRL's GRPOTrainer): the group's mean and standard deviation, the per-token clipped
    loss plus `beta`·KL to the frozen base, normalised as `loss_type` says (`grpo`, `bnpo`, `dr_grpo`);
    `baseline: rloo` (TRL's RLOOTrainer): the leave-one-out mean, `beta`·KL charged in the reward, the clipped
    loss on whole completions. `train.micro_batch_size` counts prompts."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: Literal["full", "lora"] = "full"
    lora: LoraSettings = LoraSettings()
    rewards: tuple[RewardTerm, ...] = (RewardTerm(function="reward_model"),)
    group_size: int = Field(4, ge=2)
    max_new_tokens: PositiveInt = 24
    temperature: PositiveFloat = 1.0
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    baseline: Literal["grpo", "rloo"] = "grpo"
    scale_rewards: bool = True
    loss_type: Literal["grpo", "bnpo", "dr_grpo"] = "grpo"
    beta: NonNegativeFloat = 0.04
    epsilon: PositiveFloat = 0.2
    optim: OptimConfig = OptimConfig(lr=1e-5, warmup_steps=0, weight_decay=0.0, schedule="constant")
    # a policy-gradient loss is no stationary positive quantity: the loss-spike detector is off
    train: TrainConfig = TrainConfig(
        seq_len=128, micro_batch_size=2, max_steps=100, eval_every=1000, checkpoint_every=50, spike_window=0
    )
    eval_prompts: PositiveInt = 32  # held-out prompts sampled before and after
    # completions per held-out prompt: the reward's gain is judged against its draws' noise (on the demo one each
    # gave +0.006 [-0.046, +0.057], eight +0.037 [+0.018, +0.057])
    eval_samples: PositiveInt = 8

    @model_validator(mode="after")
    def _checked(self) -> RLConfig:
        if self.max_new_tokens >= self.train.seq_len:
            raise ValueError(
                f"rl.max_new_tokens={self.max_new_tokens} leaves no room for a prompt in rl.train.seq_len="
                f"{self.train.seq_len}; lower max_new_tokens or raise the sequence length"
            )
        names = [term.name for term in self.rewards]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"rl.rewards must name at least one reward function, each once (got {names})")
        return self


class DistillConfig(BaseModel):
    """Knowledge distillation (the recipe's `distill:` section): a student, given as changes to the recipe's
    model (typically a smaller depth), learns from a frozen teacher with α·CE + (1-α)·T²·KL(teacher‖student) on
    temperature-softened distributions (`kl`), or the generalised Jensen-Shannon divergence (`jsd`, `jsd_beta`
    from 0 = forward KL to 1 = reverse KL), over all tokens of the token shards (`data: tokens`) or the response
    tokens of the SFT examples (`data: sft`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    student: dict[str, Any] = Field(default_factory=lambda: {"n_layers": 1})
    loss: Literal["kl", "jsd"] = "kl"
    alpha: float = Field(0.5, ge=0.0, le=1.0)  # weight of the hard-label cross-entropy
    temperature: PositiveFloat = 2.0
    jsd_beta: float = Field(0.5, ge=0.0, le=1.0)
    data: Literal["tokens", "sft"] = "tokens"
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig(seq_len=128)
    baseline: bool = True  # also train the same student from scratch on the same tokens, for the report


class SweepSize(BaseModel):
    """One model size of a sweep: a depth and, optionally, a width (d_model) other than depth × aspect ratio and
    seeds other than the sweep's (replicas where they pay: the shapes the rung may get)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    depth: PositiveInt
    width: PositiveInt | None = None
    seeds: list[NonNegativeInt] | None = Field(None, min_length=1)  # None: the sweep's `seeds`


# which scaling-law form sizes the rung (evaluation/law_form.py)
LawForm = Literal["auto", "chinchilla", "kaplan"]


class SweepConfig(BaseModel):
    """A scaling sweep: for each compute budget C and model size, D = C / (6·N) tokens.

    N counts the parameters in matrix multiplies per token (active parameters for MoE; `param_count:
    non_embedding` leaves out the embedding and the head), so C matches the 6·N·D FLOPs the run performs. With
    `multi_horizon` each size is one WSD run to the largest budget that also decays a branch at every smaller
    budget's token count, so one run gives one point per budget. The global batch can grow with the run's tokens
    (B ∝ D^batch_exponent, rounded to a power of two), the learning rate with it (lr ∝ B^lr_batch_exponent, the
    grid's rates being those at the recipe's batch) and warmup is a share of the shortest horizon, with a floor
    in steps (a horizon the floor would make mostly warmup is not trained). An optional learning-rate grid
    multiplies the trials; `scheduler: asha` stops poor rates early (kept out of the fits).
    `seeds` replicates every run with other initialisations and data orders: on the demo sweep a run's offset from
    the law did not carry over to another seed, so replicas are what narrows the law's intervals.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    budgets: list[PositiveFloat] = Field(default_factory=list)  # training FLOPs per point
    depths: list[PositiveInt] = Field(default_factory=list)  # model.depth values (size dial, recipe's aspect)
    sizes: list[SweepSize] = Field(default_factory=list)  # explicit (depth, width) sizes, after `depths`
    lrs: list[PositiveFloat] = Field(default_factory=list)  # empty: the recipe's optim.lr
    seeds: list[NonNegativeInt] = Field(default_factory=list)  # replicas (train.seed); empty: the recipe's
    multi_horizon: bool = False
    batch_exponent: float = Field(0.0, ge=0.0, le=1.0)  # 0: the recipe's global batch for every run
    # the learning rate follows the batch, lr ∝ batch^lr_batch_exponent (1: linear, Goyal et al. 2017; 0.5: Adam's
    # square-root rule, Malladi et al. 2022); 0: the same rate at every batch
    lr_batch_exponent: float = Field(0.0, ge=0.0, le=1.0)
    reference_tokens: PositiveFloat | None = None  # the D at which the recipe's global batch applies
    warmup_fraction: float | None = Field(None, gt=0.0, lt=0.5)  # None: recipe's warmup, at most steps/10
    # warmup lasts at least this many steps (at most half the shortest horizon): a share of a short horizon can
    # be fewer steps than Adam's second moments need (Ma & Yarats 2021: about 2 / (1 − β2))
    min_warmup_steps: NonNegativeInt = 0
    param_count: Literal["matmul", "non_embedding"] = "matmul"
    max_epochs: PositiveFloat = 4.0  # a run repeating its data more often is flagged (data-constrained)
    min_steps: PositiveInt = 10  # horizons with fewer optimizer steps are left out
    # so are horizons that a run's warmup would take more than this share of: their loss measures the schedule
    # more than N and D, and (being the largest sizes at the smallest budgets) biases N* low. On the demo the
    # 60-step floor made it 26-40% of the four shortest; with them the fit's N*(2.4e12) 95% interval was
    # [7.9e4, 1.05e5], where seven shapes trained at that budget put the optimum at ~1.25e5 (README)
    max_warmup_share: float = Field(0.25, gt=0.0, le=0.5)
    # trials at once; auto: as many as this machine's cores run side by side at full pace (`infra/cores.py`: 2 on an
    # AMD EPYC whose 2 vCPUs are 2 cores; 1 expected where they are one core's 2 hyperthreads), on a local Ray instance
    max_concurrent: PositiveInt | Literal["auto"] = 1
    cpus_per_trial: PositiveFloat = 1.0
    gpus_per_trial: float = Field(0.0, ge=0)
    scheduler: Literal["fifo", "asha"] = "fifo"
    grace_steps: PositiveInt = 20  # ASHA: steps before a trial can be stopped
    reduction_factor: float = Field(3.0, gt=1)
    report_every: PositiveInt = 10  # steps between reports to Tune
    target_budget: PositiveFloat | None = None  # the fit's compute-optimal size is chosen for this budget
    rung_multiple: PositiveFloat = 3.0  # without target_budget: the rung's budget over the largest swept one
    # the law form that sizes the rung and predicts it: auto, the one closer on the held-out budget
    # (evaluation/law_form.py); on the demo's d3w48 rung Chinchilla's predicted 4.7% high, Kaplan's 1.2% high
    law_form: LawForm = "auto"
    # the fit's resampled laws (Chinchilla's bootstrap; Kaplan's form refits a quarter as many): more, steadier
    # interval ends for more of the fit's time
    bootstrap_resamples: int = Field(2000, ge=100)
    probe: Literal["humaneval"] | None = None  # a downstream task loss measured at every point
    curve_points: PositiveInt = 8  # validation losses along each run and the rung: the loss-curve law's data

    @model_validator(mode="after")
    def _check_warmup_share(self) -> SweepConfig:
        if self.warmup_fraction and self.warmup_fraction > self.max_warmup_share:
            raise ValueError(
                f"sweep.warmup_fraction={self.warmup_fraction:g} is over sweep.max_warmup_share="
                f"{self.max_warmup_share:g}, which would leave out every horizon: lower the one or raise the other"
            )
        return self

    def all_sizes(self) -> list[SweepSize]:
        return [SweepSize(depth=d) for d in self.depths] + list(self.sizes)


def check_batch(train: TrainConfig, parallel: ParallelConfig, prefix: str = "train") -> None:
    """The global batch must split evenly into micro-batches over the workers."""
    per_step = train.micro_batch_size * parallel.world_size
    if train.global_batch(parallel.world_size) % per_step:
        raise ValueError(
            f"{prefix}.global_batch_size={train.global_batch_size} must be a multiple of "
            f"{prefix}.micro_batch_size={train.micro_batch_size} x parallel.world_size={parallel.world_size} = {per_step}"
        )


def worker_counts(train: TrainConfig, parallel: ParallelConfig) -> list[int]:
    """The worker counts a run may go on with, largest first: world_size, and with `min_workers` every smaller
    count down to it over which the global batch splits evenly into micro-batches (and the experts split evenly
    into groups of ep_size). Only world_size when the global batch is not set: it follows the worker count, and
    another count would be another run."""
    smallest = parallel.min_workers if train.global_batch_size else None
    smallest = smallest or parallel.world_size
    batches = train.global_batch(parallel.world_size) // train.micro_batch_size
    return [
        n
        for n in range(parallel.world_size, smallest - 1, -1)
        if batches % n == 0 and n % parallel.ep_size == 0
    ]


def check_horizons(train: TrainConfig, optim: OptimConfig) -> None:
    """Multi-horizon runs decay WSD branches: every horizon is shorter than the run."""
    if not train.horizons:
        return
    if optim.schedule != "wsd":
        raise ValueError(
            f"train.horizons needs optim.schedule=wsd (decay branches from a stable phase), not {optim.schedule}"
        )
    if max(train.horizons) >= train.max_steps:
        raise ValueError(
            f"train.horizons={list(train.horizons)} must all be below train.max_steps={train.max_steps}"
        )


def check_context(train: TrainConfig, max_seq_len: int, prefix: str = "train") -> None:
    """Training windows must fit the model's context."""
    if train.seq_len > max_seq_len:
        raise ValueError(
            f"{prefix}.seq_len={train.seq_len} exceeds model.max_seq_len={max_seq_len}; "
            f"lower {prefix}.seq_len or raise model.max_seq_len"
        )


def check_matrix_optimizer(prefix: str, optim: OptimConfig, par: ParallelConfig, mup: bool) -> None:
    """Matrix optimisers need whole matrices (ZeRO-0), one learning rate per group (no μP) and, for K-FAC, gradients
    free of fp16's dynamic loss scale (its output-gradient factor would carry it)."""
    if optim.name not in MATRIX_OPTIMIZERS:
        return
    if par.zero_stage >= 1:
        raise ValueError(
            f"{prefix}.name={optim.name} preconditions whole matrices, but under ZeRO-{par.zero_stage} DeepSpeed hands "
            f"the optimiser flat 1-D partitions (it would silently become a diagonal method); set "
            f"parallel.zero_stage=0 or {prefix}.name=adamw"
        )
    if mup:
        raise ValueError(
            f"{prefix}.name={optim.name} with model.mup: μP's per-width learning rates need {prefix}.name=adamw"
        )
    if optim.name == "kfac" and par.precision == "fp16":
        raise ValueError(
            f"{prefix}.name=kfac with parallel.precision=fp16: K-FAC's gradient factor would carry fp16's dynamic "
            "loss scale; use parallel.precision=bf16 or fp32"
        )
    if optim.name == "kfac" and par.compile is True:
        raise ValueError(
            f"{prefix}.name=kfac with parallel.compile=true: K-FAC reads each layer's inputs and output gradients "
            "through module hooks, which compiled blocks do not run; set parallel.compile=auto (eager for K-FAC)"
        )


class TrainingSpec(BaseModel):
    """What one training stage receives: its name, where outputs go, its optimiser, run and parallel slices and
    tracking. Subclasses add their own slices and list in `KEY` the fields that determine the trained weights
    (opt-in: a new recipe section can never re-key a run)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    KEY: ClassVar[set[str]] = {"optim", "train"}

    name: str
    output_dir: str
    optim: OptimConfig
    train: TrainConfig
    parallel: ParallelConfig = ParallelConfig()
    tracking: TrackingConfig = TrackingConfig()

    def key(self) -> dict[str, Any]:
        """What the run key hashes: the `KEY` slices, with the global batch resolved (it is the run's; the number
        of workers that makes it up is the attempt's)."""
        key = self.model_dump(mode="json", include=self.KEY) | {"parallel": self.parallel.what()}
        key["train"]["global_batch_size"] = self.train.global_batch(self.parallel.world_size)
        return key

    @model_validator(mode="after")
    def _check_batch(self) -> TrainingSpec:
        check_batch(self.train, self.parallel)
        check_horizons(self.train, self.optim)
        # pretraining's and the student's spec hold their model; the tuning stages' base is checked by the recipe
        mup = getattr(self, "model", None) is not None and self.model.mup is not None  # type: ignore[attr-defined]
        check_matrix_optimizer("optim", self.optim, self.parallel, mup)
        return self


class PretrainSpec(TrainingSpec):
    """What pretraining receives: the model to build plus the common training slices."""

    KEY: ClassVar[set[str]] = {"model", "optim", "train", "probe"}

    model: ModelConfig
    probe: Literal["humaneval"] | None = None  # a downstream task loss at every final evaluation

    @model_validator(mode="after")
    def _fits_context(self) -> PretrainSpec:
        check_context(self.train, self.model.max_seq_len)
        return self


class SFTSpec(SFTConfig, TrainingSpec):
    """What fine-tuning receives: the recipe's `sft:` section plus the run's name, outputs, parallelism, tracking."""

    KEY: ClassVar[set[str]] = {"method", "lora", "optim", "train", "eval_examples", "replay_rows"}


class DPOSpec(DPOConfig, TrainingSpec):
    """What preference tuning receives: the recipe's `dpo:` section plus the run's context."""

    KEY: ClassVar[set[str]] = {"method", "lora", "loss", "optim", "train", "eval_pairs"}


class RewardModelSpec(RewardModelConfig, TrainingSpec):
    """What reward modelling receives: the recipe's `reward_model:` section plus the run's context."""

    KEY: ClassVar[set[str]] = {"centring", "optim", "train", "eval_pairs"}


class RLSpec(RLConfig, TrainingSpec):
    """What RL receives: the recipe's `rl:` section plus the run's context."""

    KEY: ClassVar[set[str]] = {
        "method",
        "lora",
        "rewards",
        "group_size",
        "max_new_tokens",
        "temperature",
        "top_p",
        "baseline",
        "scale_rewards",
        "loss_type",
        "beta",
        "epsilon",
        "optim",
        "train",
        "eval_prompts",
        "eval_samples",
    }


class DistillSpec(DistillConfig, TrainingSpec):
    """What distillation receives: the recipe's `distill:` section, the student's model it derives, the run's
    context."""

    KEY: ClassVar[set[str]] = {"model", "loss", "alpha", "temperature", "jsd_beta", "optim", "train"}

    model: ModelConfig

    @model_validator(mode="after")
    def _fits_context(self) -> DistillSpec:
        check_context(self.train, self.model.max_seq_len, "distill.train")
        return self


class SweepSpec(BaseModel):
    """What the sweep receives: the grid and the pretraining spec every trial derives from."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    output_dir: str
    sweep: SweepConfig
    base: PretrainSpec  # each trial overrides its size, horizon and learning rate
    tracking: TrackingConfig = TrackingConfig()
