"""Next-token cross-entropy over the vocabulary, in fp32, without a full-size fp32 copy of bf16/fp16 logits: the mean
(the training loss) and each row's (`token_cross_entropy`: minus the per-token log-probabilities of DPO and RL).

`F.cross_entropy(logits.float(), ...)` on bf16 logits of R rows and V columns makes, eagerly, a fp32 copy, its
log-softmax (kept for the backward: 4 bytes per logit), a zero-filled gradient and the log-softmax's backward, each a
full-size fp32 pass over memory. Here the forward keeps the logits as they are (2 bytes per logit) and each row's
log-sum-exp, and the backward writes softmax − one-hot straight into a gradient of the logits' dtype, a chunk of
rows at a time that fits in a core's L2 cache. Compiled (`training/compile.py`) it runs as one chunk, which Inductor
fuses into a pass each way (the targets' entries written after the backward's pass). The result equals
`F.cross_entropy` on the fp32 logits to float rounding. At d_model 384, vocab 8,192, 1,024 tokens, bf16, one core
(`benchmarks/cross_entropy.py`): the head and loss forward and backward 55-57 -> 49-50 ms eager, 43-46 -> 41-42 ms
compiled (its GEMMs alone 21-22); an engine step 1.3% (eager) / 1.6% (compiled) faster. fp32 logits go to
`F.cross_entropy`: there is no copy to avoid, and its fused log-softmax made a step 2.4-2.8% faster than the chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# targets with this value carry no loss (as `data_pipeline.loader`'s; model code stays light)
IGNORE_INDEX = -100

CHUNK_BYTES = 1 << 21  # one chunk's fp32 rows on a CPU: a core's L2 (2 MiB on the Xeons measured)
# elsewhere (a GPU) a bound on the backward's transient fp32 softmax, in a few chunks: a CPU's chunk would be ~10
# rows at a vocabulary of 50k, hundreds of kernel launches (not measured: no GPU yet)
DEVICE_CHUNK_BYTES = 1 << 28


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """logits (R, V) of any float dtype, targets (R,) with IGNORE_INDEX where no loss -> the mean over the rows that
    carry loss of log-sum-exp(logits) − logits[target], in fp32 (NaN when no row does, as `F.cross_entropy`)."""
    if logits.dtype == torch.float32:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    return token_cross_entropy(logits, targets).sum() / (targets != IGNORE_INDEX).sum()


def token_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Each row's log-sum-exp(logits) − logits[target] (R,) in fp32, 0 where the target is IGNORE_INDEX: minus the
    target's log-probability (the policy's and DPO's per-token log-probabilities)."""
    if logits.dtype == torch.float32:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")
    return _TokenCrossEntropy.apply(logits, targets)


def _chunk_rows(logits: Tensor) -> int:
    """Rows a chunk holds: all of them while torch.compile traces (Inductor fuses the passes), else an L2's worth on
    a CPU and `DEVICE_CHUNK_BYTES` of fp32 elsewhere."""
    if torch.compiler.is_compiling():
        return logits.shape[0]
    budget = CHUNK_BYTES if logits.device.type == "cpu" else DEVICE_CHUNK_BYTES
    return max(1, budget // (4 * logits.shape[1]))


class _TokenCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor) -> Tensor:  # type: ignore[override]
        rows = _chunk_rows(logits)
        carries = targets != IGNORE_INDEX
        target = torch.where(carries, targets, 0)
        lse = torch.cat([torch.logsumexp(chunk.float(), -1) for chunk in logits.split(rows)])  # (R,)
        picked = logits.gather(-1, target[:, None]).squeeze(-1).float()
        ctx.save_for_backward(logits, lse, target, carries)
        ctx.rows = rows
        return torch.where(carries, lse - picked, 0.0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        logits, lse, target, carries = ctx.saved_tensors
        scale = torch.where(carries, grad, 0.0)[:, None]  # (R, 1)
        # compiled: one element-wise pass, then each row's target entry minus one; the one-hot subtracted from the
        # fp32 softmax made Inductor write it out and read it back (vocab 8,192, 1,024 rows: this backward 21.7-23.1
        # -> 4.4-5.6 ms; with the one-hot an int64 arange compared inside the pass, 8.8-9.9 ms)
        if torch.compiler.is_compiling():
            out = ((logits.float() - lse[:, None]).exp() * scale).to(logits.dtype)
            rows = torch.arange(logits.shape[0], device=logits.device)
            picked = (logits[rows, target].float() - lse).exp()
            out[rows, target] = ((picked - 1.0) * scale[:, 0]).to(logits.dtype)
            return out, None
        out = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.rows):
            end = min(start + ctx.rows, logits.shape[0])
            probs = (logits[start:end].float() - lse[start:end, None]).exp_()  # (rows, V) softmax
            probs[torch.arange(end - start, device=probs.device), target[start:end]] -= 1.0
            out[start:end] = probs.mul_(scale[start:end])
        return out, None
