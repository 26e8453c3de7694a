"""Mixture-of-Experts feed-forward in plain PyTorch: top-k softmax router, SwiGLU experts, dropless dispatch.

References: Shazeer et al. 2017 (sparsely-gated MoE); Fedus et al. 2021 (Switch Transformer, load-balancing
loss); Zoph et al. 2022 (ST-MoE, router z-loss); Jiang et al. 2024 (Mixtral: softmax, top-k, renormalise).

Deviations, on purpose:
- The load-balancing loss divides the per-expert token fraction by top_k, so it equals 1.0 under uniform
  routing for any k (Hugging Face's Mixtral loss equals top_k there). Coefficients therefore do not depend on k.
- Losses are returned to the caller, never stored on the module, so activation checkpointing keeps their graph.
- Dispatch is dropless: every token reaches all of its top_k experts; there is no capacity factor. The
  assignments are sorted by expert and run as one grouped GEMM per projection (as torchtitan and OLMo-core do);
  on a CPU in bf16, where that is a loop of small GEMMs, as one batched GEMM when padding every expert to the
  largest one's rows costs little (`pays_to_batch`).

Parameter names follow Hugging Face transformers v5 Mixtral (`mlp.gate.weight`, `mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) so a checkpoint maps onto `MixtralForCausalLM` key for key.

Shape letters: N tokens (batch and time flattened), H d_model, E experts, K top_k, I d_ff_expert.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from training.model.config import MoEConfig
from training.model.feed_forward import FeedForward


@dataclass(frozen=True)
class RouterStats:
    """What one MoE layer reports per forward pass: two differentiable losses and the expert load."""

    aux_loss: Tensor  # () load-balancing loss, 1.0 when routing probabilities are uniform
    z_loss: Tensor  # () mean squared log-partition of the router logits
    tokens_per_expert: Tensor  # (E,) int64, token-assignments each expert received (sums to N*K)


class TopKRouter(nn.Module):
    """Linear router: softmax over experts in fp32, keep the top k, renormalise their weights to sum to one (unless
    `normalize` is off: Qwen2-MoE keeps the top-k probabilities as they are)."""

    def __init__(self, d_model: int, n_experts: int, top_k: int, normalize: bool = True) -> None:
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x (N, H) -> weights (N, K) in x's dtype, expert ids (N, K), probs (N, E) fp32, logits (N, E) fp32."""
        logits = F.linear(x, self.weight).float()
        probs = logits.softmax(dim=-1)
        top_probs, expert_ids = probs.topk(self.top_k, dim=-1)
        weights = top_probs / top_probs.sum(dim=-1, keepdim=True) if self.normalize else top_probs
        return weights.to(x.dtype), expert_ids, probs, logits


class Experts(nn.Module):
    """E SwiGLU feed-forwards stored as two stacked tensors; each token visits only its chosen experts."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(n_experts, 2 * d_ff, d_model)
        )  # (E, 2I, H), gate rows first
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, d_ff))  # (E, H, I)

    def forward(
        self, x: Tensor, weights: Tensor, expert_ids: Tensor, row_multiple: int | None = None
    ) -> Tensor:
        """x (N, H), weights and expert_ids (N, K) -> (N, H). Dropless: the N·K assignments sorted by expert, two
        grouped (or batched) GEMMs over all experts at once, then each token's K outputs mixed by its router weights.
        Each expert's rows are padded with zero rows to a multiple of `row_multiple` (`gemm_row_multiple` unless
        given), and to the largest expert's where that pays (`pays_to_batch`)."""
        n_experts = self.gate_up_proj.shape[0]
        n_tokens, top_k = expert_ids.shape
        flat_ids = expert_ids.reshape(-1)  # (N*K,)
        order = flat_ids.argsort(stable=True)
        counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # no host sync
        multiple = row_multiple or gemm_row_multiple(x)
        batched = multiple > 1 and pays_to_batch(counts, multiple)
        # each sorted assignment's GEMM row
        rows, ends = padded_rows(counts, flat_ids[order], multiple, batched)
        if multiple == 1:
            routed = x.index_select(0, order // top_k)  # (N*K, H): each sorted assignment's token
        else:  # padding rows read an appended zero row (a CPU: the host knows the total at no cost)
            source = torch.full((int(ends[-1]),), n_tokens, dtype=order.dtype, device=x.device)
            source[rows] = order // top_k
            routed = F.pad(x, (0, 0, 0, 1)).index_select(0, source)
        hidden = swiglu(grouped_linear(routed, self.gate_up_proj, ends, batched))  # (rows, I)
        y = grouped_linear(hidden, self.down_proj, ends, batched)  # (rows, H), grouped by expert
        # back in (token, choice) order
        inverse = torch.empty_like(order)  # the sorted order's inverse, without a second sort
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y = y.index_select(0, rows[inverse]).view(n_tokens, top_k, -1)
        return (y * weights.unsqueeze(-1)).sum(dim=1)


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) * up from a GEMM's (rows, 2I) output, gate columns first. On a CPU the gate is copied first where
    its rows are not a multiple of 128 bytes: PyTorch's CPU kernels vectorise two 64-byte registers at a time and
    finish each row of a strided tensor scalar (bf16 at I = 96, a third of every row: SiLU's forward and backward
    1.6x slower than copying first; at I = 512 the copy only costs)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if gate_up.device.type == "cpu" and gate.shape[-1] * gate.element_size() % 128:
        gate = gate.contiguous()
    return F.silu(gate) * up


def gemm_row_multiple(x: Tensor) -> int:
    """Rows per expert for a GEMM on x: on a CPU in bf16/fp16, oneDNN builds a kernel for every new row count
    (~0.6 ms each), and routing changes the counts every step: padded to multiples of 32 they take few values and
    the kernels are reused (6 -> 0.7 ms per grouped GEMM at the demo shape). 1 elsewhere (no padding)."""
    return 32 if x.device.type == "cpu" and compute_dtype(x) in (torch.bfloat16, torch.float16) else 1


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matrix multiply on x runs in: autocast's where it is on (it does not cover `grouped_mm`)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


def pays_to_batch(counts: Tensor, multiple: int) -> bool:
    """Whether the experts' GEMMs run as one batched GEMM, every expert padded to the largest one's rows: where
    that adds at most `BATCH_PADDING` more rows than padding each to `multiple`. A CPU runs `grouped_mm` as a loop
    of small GEMMs: on balanced routing one `bmm` was 2.5-3x faster at the demo's shape, 1.1-1.3x at d_model 384,
    but each padded row costs its share of every GEMM and of the gather, SiLU and scatter around them (a whole
    layer's forward and backward, `benchmarks/moe_layer.py`: 1.2x faster at the demo's shape with 16% more rows,
    1.02-1.05x at d_model 384 with 7.5% more; 1.7-2.4x slower with 3.9x the rows)."""
    return batch_padding(counts, multiple) <= BATCH_PADDING


def batch_padding(counts: Tensor, multiple: int) -> float:
    """Rows of the batched layout (every expert at the largest one's padded rows) over those of the grouped one."""
    padded = padded_counts(counts, multiple)
    return int(padded.max()) * counts.numel() / int(padded.sum())


def padded_counts(counts: Tensor, multiple: int) -> Tensor:
    """Each expert's rows rounded up to a multiple of `multiple`."""
    return (counts + multiple - 1) // multiple * multiple


def padded_rows(
    counts: Tensor, sorted_ids: Tensor, multiple: int, batched: bool = False
) -> tuple[Tensor, Tensor]:
    """Where each assignment (sorted by expert) sits when every expert's rows start at a multiple of `multiple`
    (`batched`: at a multiple of the largest expert's padded rows, so the groups are equal), and the experts' padded
    group ends (int32, as `grouped_mm` takes them)."""
    padded = padded_counts(counts, multiple)
    if batched:
        padded = padded.max().expand_as(padded)
    ends = padded.cumsum(0)
    shift = (ends - padded) - (counts.cumsum(0) - counts)  # padded start - packed start, per expert
    rows = torch.arange(sorted_ids.numel(), device=sorted_ids.device) + shift[sorted_ids]
    return rows, ends.to(torch.int32)


def grouped_linear(x: Tensor, weight: Tensor, ends: Tensor, batched: bool = False) -> Tensor:
    """Rows of x (M, in) grouped by expert (group e ends at row `ends[e]`) times their expert's weight (E, out, in)
    transposed: one `grouped_mm` call (CUTLASS on Hopper in bf16; a loop inside PyTorch elsewhere), or one `bmm`
    where every group has the same rows (`batched`, `padded_rows(..., batched=True)`). Without `grouped_mm`
    (PyTorch < 2.8), or with widths whose rows are not 16-byte aligned as it requires, a Python loop over experts."""
    # cast as autocast does for `F.linear` (else the experts run in fp32 under bf16 autocast, at a third of the
    # dense layers' pace); the GEMM takes one dtype
    dtype = compute_dtype(x)
    x, weight = x.to(dtype), weight.to(dtype)
    if batched:
        return _BatchedLinear.apply(x, weight)
    if GROUPED_MM is not None and all(d * x.element_size() % 16 == 0 for d in weight.shape[1:]):
        if dtype != torch.bfloat16 and torch.compiler.is_compiling():
            return grouped_mm(x, weight.transpose(1, 2), ends)
        return GROUPED_MM(x, weight.transpose(1, 2), offs=ends)
    bounds = [0, *ends.tolist()]
    return torch.cat([F.linear(x[a:b], weight[e]) for e, (a, b) in enumerate(itertools.pairwise(bounds))])


class _BatchedLinear(torch.autograd.Function):
    """Rows of x (M, in) in E equal groups times their expert's weight (E, out, in) transposed, as one `bmm`, the
    weight's gradient made in the weight's own layout (as `F.linear`'s and `grouped_mm`'s backward make it):
    autograd's, through `weight.transpose(1, 2)`, is its transpose, which accumulating into `.grad` copies (an MoE
    layer's forward and backward 1.2x slower at d_model 384 on a CPU)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, weight)
        groups = x.view(weight.shape[0], -1, x.shape[-1])  # (E, M / E, in)
        return torch.bmm(groups, weight.transpose(1, 2)).view(x.shape[0], -1)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:  # type: ignore[no-untyped-def]
        x, weight = ctx.saved_tensors
        grad = grad.reshape(weight.shape[0], -1, grad.shape[-1])  # (E, M / E, out)
        grad_x = torch.bmm(grad, weight).view(x.shape) if ctx.needs_input_grad[0] else None
        groups = x.view(weight.shape[0], -1, x.shape[-1])
        grad_weight = torch.bmm(grad.transpose(1, 2), groups) if ctx.needs_input_grad[1] else None
        return grad_x, grad_weight


BATCH_PADDING = 1.25
GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@torch.library.custom_op("lmforge::grouped_mm", mutates_args=())
def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """`GROUPED_MM(a, b, offs=offs)` as an opaque op, for torch.compile in dtypes other than bf16: torch 2.13's fake
    kernel for `grouped_mm` repeats the CUDA kernel's bf16-only check, while the eager op (on a CPU, and CUDA's
    fallback) computes fp32 and fp16 too. (M, K) x (E, K, N) -> (M, N); the weight gradient (K, M) x (M, N) ->
    (E, K, N)."""
    assert GROUPED_MM is not None
    return GROUPED_MM(a, b, offs=offs)


@grouped_mm.register_fake
def _(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


def _save_operands(ctx, inputs: tuple[Tensor, Tensor, Tensor], output: Tensor) -> None:  # type: ignore[no-untyped-def]
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[no-untyped-def]
    a, b, offs = ctx.saved_tensors
    return grouped_mm(grad, b.transpose(1, 2), offs), grouped_mm(a.t(), grad, offs), None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_save_operands)


class MoE(nn.Module):
    """Sparse feed-forward: route each token to its top-k experts and mix their outputs by router weight (plus a
    gated shared expert where the config has one)."""

    def __init__(self, d_model: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.gate = TopKRouter(d_model, cfg.n_experts, cfg.top_k, cfg.norm_topk_prob)
        self.experts = Experts(cfg.n_experts, d_model, cfg.d_ff_expert)
        if cfg.shared_expert_d_ff is not None:
            # Qwen2-MoE's shared expert: every token visits it, its output scaled by sigmoid(shared_expert_gate · x)
            self.shared_expert = FeedForward(d_model, cfg.shared_expert_d_ff)
            self.shared_expert_gate = nn.Linear(d_model, 1, bias=False)

    def forward(self, x: Tensor) -> tuple[Tensor, RouterStats]:
        """x (B, T, H) -> (B, T, H) and this layer's router statistics."""
        tokens = x.reshape(-1, x.shape[-1])  # (N, H)
        weights, expert_ids, probs, logits = self.gate(tokens)
        out = self.experts(tokens, weights, expert_ids)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(tokens)) * self.shared_expert(tokens)
        return out.view_as(x), router_stats(probs, logits, expert_ids, self.n_experts)


def router_stats(probs: Tensor, logits: Tensor, expert_ids: Tensor, n_experts: int) -> RouterStats:
    """Switch load-balancing loss E * sum_e f_e * P_e (f: share of assignments, P: mean probability) and z-loss."""
    counts = torch.bincount(expert_ids.reshape(-1), minlength=n_experts)
    fraction = counts.float() / expert_ids.numel()  # (E,) sums to 1
    aux = n_experts * (fraction * probs.mean(dim=0)).sum()
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    return RouterStats(aux_loss=aux, z_loss=z, tokens_per_expert=counts)
