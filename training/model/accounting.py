"""Parameters, FLOPs and memory of a model from its config alone, before anything is allocated.

Parameter counts come from the model itself, built on the meta device (no memory) and classified by parameter
name, so they cannot drift from the module; they are tested against `transformers` and published counts. FLOPs follow Kaplan et al. 2020
(6 FLOPs per matmul parameter per trained token) plus the attention term of Chowdhery et al. 2022 (PaLM,
App. B): 12·L·H·D·T per token, counting the full T×T score matrix (a causal-exact count would halve it);
linear attention's term does not grow with T (`attention_flops`).
Matmul parameters include the LM head (its matmul runs even when tied to the embedding) and exclude the
embedding lookup. MoE counts only the top-k experts a token visits (active parameters).

Memory follows Rajbhandari et al. 2020 (ZeRO): mixed precision keeps 16-bit weights and gradients, fp32 master
weights and the optimiser's fp32 state (`training.optim.STATE_BYTES`: 8 for Adam's two moments, so 2 + 2 + 12); ZeRO-1 shards the optimizer states,
ZeRO-2 also the gradients, ZeRO-3 also the weights, across the data-parallel ranks. Expert parameters are split
over `ep_size` ranks first. Activations are an estimate: the tensors autograd saves per layer (listed in
`activation_elements_per_token`), ignoring small statistics (RMS, softmax log-sum-exp) and allocator slack.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Literal

import torch

from training.model.config import ModelConfig
from training.model.linear_attention import CHUNK
from training.model.transformer import Transformer
from training.optim.master_weights import uses_master_weights
from training.optim.optimizers import STATE_BYTES

Precision = Literal["fp32", "bf16", "fp16"]
BYTES_PER_ELEMENT: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts by component; `active` is what one token uses (top-k experts only)."""

    embedding: int
    attention: int
    mlp: int  # dense feed-forward layers
    experts: int  # all experts of all MoE layers
    router: int
    norms: int
    lm_head: int  # 0 when tied to the embedding
    total: int
    active: int
    active_experts: int  # experts a token visits, summed over MoE layers

    @property
    def matmul_active(self) -> int:
        """Parameters in matrix multiplies per token: everything active but the embedding lookup and the norms."""
        return self.active - self.embedding - self.norms + (self.embedding if self.lm_head == 0 else 0)


def component(name: str) -> str:
    """Which part of the model a parameter (by its Hugging Face-style name) belongs to."""
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if "norm" in name:
        return "norms"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "experts"
    if name.endswith(".mlp.gate.weight"):
        return "router"
    if ".mlp." in name:
        return "mlp"
    raise ValueError(
        f"parameter {name!r} belongs to no known component; teach training/model/accounting.py its name"
    )


def count_parameters(cfg: ModelConfig) -> ParamCounts:
    """Exact parameter counts of `training.model.Transformer(cfg)`, counted on the meta device."""
    return _count(cfg.model_dump_json())


@lru_cache(maxsize=256)
def _count(cfg_json: str) -> ParamCounts:
    cfg = ModelConfig.model_validate_json(cfg_json)
    with torch.device("meta"):
        model = Transformer(cfg, seed=None)
    parts = dict.fromkeys(("embedding", "attention", "mlp", "experts", "router", "norms", "lm_head"), 0)
    for name, param in model.named_parameters():  # a tied head is the embedding's parameter: counted once
        parts[component(name)] += param.numel()
    active_experts = parts["experts"] * cfg.moe.top_k // cfg.moe.n_experts if cfg.moe is not None else 0
    total = sum(parts.values())
    return ParamCounts(
        **parts, total=total, active=total - parts["experts"] + active_experts, active_experts=active_experts
    )


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token: 6·N_matmul_active + 12·L·H·D·T; forward alone is a third of each term."""

    matmul: int
    attention: int

    @property
    def training(self) -> int:
        return self.matmul + self.attention

    @property
    def forward(self) -> int:
        return self.training // 3


def flops_per_token(cfg: ModelConfig, seq_len: int) -> FlopsPerToken:
    params = count_parameters(cfg)
    return FlopsPerToken(matmul=6 * params.matmul_active, attention=attention_flops(cfg, seq_len))


def attention_flops(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token of attention beyond its projections (3× the forward). Softmax: scores and mixing,
    4·D·T per head. Linear attention as `causal_linear_attention` runs it, per head and token with M features
    and chunks of c = min(64, T): the within-chunk scores and mixing 2cM + 2cD, the state readout and update
    4MD, and for FAVOR+ the projection of q and k, 4MD more: constant in T."""
    L, H, D = cfg.n_layers, cfg.n_heads, cfg.head_dim
    if cfg.attention == "softmax":
        return 12 * L * H * D * seq_len
    M, c = cfg.feature_dim, min(CHUNK, seq_len)
    forward = 2 * c * M + 2 * c * D + 4 * M * D + (4 * M * D if cfg.attention == "favor" else 0)
    return 3 * L * H * forward


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device for training one micro-batch."""

    weights: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


def state_bytes_per_param(precision: Precision, optimizer: str = "adamw") -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes per parameter: with Adam 2+2+12 mixed precision (the state
    includes the fp32 master weights), 4+4+8 fp32."""
    state = STATE_BYTES[optimizer]
    return (4, 4, state) if precision == "fp32" else (2, 2, 4 + state)


# fp32 (m × m and n × n)-sized matrices a matrix optimiser keeps per m × n block matrix: SOAP its two statistics
# and their eigenbases, Shampoo its statistics and inverse roots, Kron its two factors, K-FAC A, G and inverses.
FACTORS_PER_SIDE: dict[str, int] = {"soap": 2, "shampoo": 2, "kron": 1, "kfac": 2}


def preconditioner_bytes(cfg: ModelConfig, optimizer: str) -> int:
    """Bytes of a matrix optimiser's per-matrix factors over the blocks' 2-D weights (0 for elementwise ones)."""
    if optimizer not in FACTORS_PER_SIDE:
        return 0
    with torch.device("meta"):
        model = Transformer(cfg, seed=None)
    sides = sum(
        p.shape[0] ** 2 + p.shape[1] ** 2
        for name, p in model.named_parameters()
        if p.ndim == 2 and name.startswith("model.layers.")
    )
    return 4 * FACTORS_PER_SIDE[optimizer] * sides


def activation_elements_per_token(cfg: ModelConfig, activation_checkpointing: bool) -> tuple[int, int]:
    """(elements saved for backward per token in the training dtype, elements kept in fp32 whatever it is).

    Dense layer: per RMSNorm its input cast to fp32 (C, fp32), normalised and scaled outputs (2C, twice); q, k, v
    and the attention output (2HD + 2GD); gate, up, silu(gate) and their product (4F). A MoE layer replaces 4F with,
    per top-k assignment, the gathered input, gate/up, silu(gate), product and the expert output back in token order
    (2C + 4I), plus router logits and probabilities (2E, fp32). The head keeps the final norm's tensors and the
    loss its logits (V; fp32 log-probabilities in fp32, the logits themselves in bf16: `cross_entropy.py`). With
    activation checkpointing only block inputs are kept, plus one block's working set while it is recomputed.
    Checked against autograd's saved tensors in tests/unit/test_accounting.py (fp32, and bf16 with SDPA attention;
    a CPU's bf16 MoE pads each expert's rows, to 32 or to the largest expert's, and its short bf16 attention keeps
    the T×T scores: not counted).
    """
    C, HD, GD = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer, fp32_per_layer = [], []
    for i in range(cfg.n_layers):
        ffn, router = 4 * cfg.d_ff, 0
        if cfg.moe is not None and cfg.is_moe_layer(i):
            ffn = cfg.moe.top_k * (2 * C + 4 * cfg.moe.d_ff_expert)
            router = 2 * cfg.moe.n_experts
        per_layer.append(4 * C + 2 * HD + 2 * GD + ffn)
        fp32_per_layer.append(2 * C + router)
        if cfg.attention != "softmax":  # q and k features and a chunk's scores (an estimate, not checked)
            per_layer[-1] += 2 * cfg.n_heads * cfg.feature_dim + cfg.n_heads * min(CHUNK, cfg.max_seq_len)
    if activation_checkpointing:
        layers, fp32 = cfg.n_layers * C + max(per_layer), max(fp32_per_layer)
    else:
        layers, fp32 = sum(per_layer), sum(fp32_per_layer)
    return layers + 2 * C + cfg.vocab_size, fp32 + C


def training_memory(
    cfg: ModelConfig,
    *,
    precision: Precision,
    zero_stage: int,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: bool = False,
    ep_size: int = 1,
    optimizer: str = "adamw",
) -> MemoryEstimate:
    """Per-device bytes for weights, gradients, optimizer state (ZeRO-sharded) and one micro-batch's activations."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage} must be 0, 1, 2 or 3")
    params = count_parameters(cfg)
    w, g, o = state_bytes_per_param(precision, optimizer)
    if uses_master_weights(precision, zero_stage, ep_size, optimizer):
        g += 4  # `MasterWeights` keeps an fp32 copy of the gradients (eager; compiled it does not: a bound there)
    dense_params = params.total - params.experts
    expert_params = params.experts / ep_size  # each rank holds n_experts / ep_size experts
    dense_dp, expert_dp = world_size, max(1, world_size // ep_size)

    def per_device(bytes_per_param: int, sharded: bool) -> int:
        if not sharded:
            return int(bytes_per_param * (dense_params + expert_params))
        return int(bytes_per_param * (dense_params / dense_dp + expert_params / expert_dp))

    elements, fp32_elements = activation_elements_per_token(cfg, activation_checkpointing)
    tokens = micro_batch * seq_len
    return MemoryEstimate(
        weights=per_device(w, zero_stage >= 3),
        gradients=per_device(g, zero_stage >= 2),
        optimizer=per_device(o, zero_stage >= 1) + preconditioner_bytes(cfg, optimizer),
        activations=tokens * (elements * BYTES_PER_ELEMENT[precision] + fp32_elements * 4),
    )


def kv_cache_bytes(cfg: ModelConfig, batch: int, seq_len: int, precision: Precision = "bf16") -> int:
    """Inference KV cache: keys and values of every layer, kv heads only (GQA shrinks it by n_heads/n_kv_heads);
    linear attention keeps fp32 running sums instead, S (M × D) and z (M) per head, whatever the length."""
    if cfg.attention != "softmax":
        return 4 * cfg.n_layers * cfg.n_heads * (cfg.feature_dim * cfg.head_dim + cfg.feature_dim) * batch
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * seq_len * batch * BYTES_PER_ELEMENT[precision]


def summarize(
    cfg: ModelConfig,
    *,
    precision: Precision,
    zero_stage: int,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    activation_checkpointing: bool = False,
    ep_size: int = 1,
    optimizer: str = "adamw",
) -> dict[str, dict[str, int | float | str]]:
    """Everything above as one JSON-ready dict (what `lmforge model summary --json` prints)."""
    params = count_parameters(cfg)
    flops = flops_per_token(cfg, seq_len)
    memory = training_memory(
        cfg,
        precision=precision,
        zero_stage=zero_stage,
        world_size=world_size,
        micro_batch=micro_batch,
        seq_len=seq_len,
        activation_checkpointing=activation_checkpointing,
        ep_size=ep_size,
        optimizer=optimizer,
    )
    return {
        "parameters": {**asdict(params), "matmul_active": params.matmul_active},
        "flops_per_token": {
            "matmul_6n": flops.matmul,
            "attention": flops.attention,
            "training": flops.training,
        },
        "memory_per_device_bytes": {**asdict(memory), "total": memory.total},
        "kv_cache_bytes": {"batch_1_max_seq_len": kv_cache_bytes(cfg, 1, cfg.max_seq_len, precision)},
        "setting": {
            "precision": precision,
            "zero_stage": zero_stage,
            "world_size": world_size,
            "ep_size": ep_size,
            "optimizer": optimizer,
            "micro_batch": micro_batch,
            "seq_len": seq_len,
            "activation_checkpointing": str(activation_checkpointing).lower(),
        },
    }
