"""`torch.compile` of the transformer blocks and of the output head with its loss inside the engine (regional
compilation: every block shares one compiled graph, so warm-up costs one block's compile, not the model's), with a
fall-back to eager.

`parallel.compile: auto` compiles on CUDA, where fusing the norm, RoPE and SwiGLU element-wise work pays
(nanochat, torchtitan), and on a CPU for dense softmax-attention models at least `CPU_MIN_WIDTH` wide, where
the compile (8.1 s from a cold Inductor cache at d_model 384 in fp32, 5.7 s warm in bf16, 24 s cold at the demo's 64) is paid
back within a short run: one core, steps interleaved with an eager engine's, d_model 384 saved 77 ms (fp32, 7%) /
88 ms (bf16, 14%) per step, 105 / 65 steps to pay; d_model 64 saved 2.5 ms (9%), ~10,000 steps, more than the
demo's runs take. An MoE block compiles with automatic dynamic shapes (its experts' row counts change every step:
one symbolic graph after the first change, where static shapes recompiled every few steps); on a CPU auto compiles
it in bf16 from d_model 256: at 384 a step took 251-257 instead of 328-339 ms (its optimiser compiled both ways),
the compile ~1 s more from a warm Inductor cache (paid after ~12 steps), ~20 s cold. In fp32 it compiles (through
`moe.grouped_mm`) but a step was no faster (612 vs 608 ms at d_model 384, interleaved), so auto leaves it eager;
linear attention stays eager under auto: not measured. A platform where compile is unavailable stays eager (with one
warning when compile was asked for); a failure on the trial step falls back to eager with one warning; neither stops
a run. Decoding with a cache stays eager (shapes change every token).
"""

from __future__ import annotations

import copy
import logging
import shutil
import warnings
from typing import Literal

import torch
from torch import nn

from training.model.config import ModelConfig
from training.model.moe import MoE
from training.model.transformer import Transformer

log = logging.getLogger(__name__)
CompileSetting = Literal["auto"] | bool


CPU_MIN_WIDTH = 256


def wants_compile(
    setting: CompileSetting, device: torch.device, cfg: ModelConfig, dtype: torch.dtype = torch.float32
) -> bool:
    """The recipe's `parallel.compile` for this device and model: True/False as given; auto: CUDA, or a CPU for a
    softmax-attention model of d_model >= `CPU_MIN_WIDTH` (where it was measured to pay), dense, or MoE in bf16
    (in fp32 a compiled MoE block was no faster here)."""
    if setting != "auto":
        return bool(setting)
    if device.type == "cuda":
        return True
    return (
        device.type == "cpu"
        and cfg.d_model >= CPU_MIN_WIDTH
        and (cfg.moe is None or dtype == torch.bfloat16)
        and cfg.attention == "softmax"
    )


def compiles_optimizer(setting: CompileSetting, device: torch.device, cfg: ModelConfig) -> bool:
    """Whether `MasterWeights` steps through its compiled kernels: the recipe's `parallel.compile` where torch.compile
    can run; auto: a CPU model of d_model >= `CPU_MIN_WIDTH`, MoE and linear attention included (the optimiser's
    shapes never change), where it saved 12-20 ms a step at d_model 384 for a 3-15 s compile (~0.1 ms at the demo's
    64). Not on CUDA under auto: not measured there, where torch's fused AdamW is one kernel already and the extra
    passes over memory cost little, while the compile grows with the number of tensors."""
    if setting is False or (setting == "auto" and (device.type != "cpu" or cfg.d_model < CPU_MIN_WIDTH)):
        return False
    return unavailable_reason(device) is None


def unavailable_reason(device: torch.device) -> str | None:
    """Why torch.compile cannot run here (None: it can): no Dynamo for this Python, or no C++ compiler for
    Inductor's CPU code."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "TorchDynamo does not support this Python/platform"
    if device.type == "cpu":
        from torch._inductor import config as inductor

        compiler = inductor.cpp.cxx[0] if isinstance(inductor.cpp.cxx, tuple) else inductor.cpp.cxx
        if compiler is None:
            if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
                return "Inductor's CPU backend needs a C++ compiler (g++ or clang++) on PATH"
        elif not shutil.which(compiler):
            return f"Inductor's C++ compiler {compiler!r} is not on PATH"
    return None


def compile_blocks(model: Transformer) -> None:
    """Compile each block's training forward (a cached decode step keeps the eager forward), and the output head
    with its loss (its fp32 cast fused into the loss: at d_model 384 in bf16 the head and loss alone took 56 -> 39 ms,
    a whole step 198-201 -> 190-193 ms)."""
    model.logits_and_loss = torch.compile(model.logits_and_loss, dynamic=False)  # type: ignore[method-assign]
    for block in model.model.layers:
        eager = block.forward
        # an MoE block's expert row counts change every step: the first change recompiles them symbolic (automatic
        # dynamic shapes), later ones reuse that graph; static, each new count recompiled (~3 s each on a CPU)
        compiled = torch.compile(eager, dynamic=None if isinstance(block.mlp, MoE) else False)

        def forward(x, rope, cache=None, _eager=eager, _compiled=compiled):  # type: ignore[no-untyped-def]
            return _eager(x, rope, cache) if cache is not None else _compiled(x, rope)

        block.forward = forward


def trial_step(model: Transformer, batch: int, seq_len: int, dtype: torch.dtype) -> None:
    """One forward and backward of a copy of `model` in the engine's parameter dtype, at the training shapes:
    compiles the graphs the blocks will run (they share the code and its cache) or raises what fails."""
    trial = copy.deepcopy(model).to(dtype)
    compile_blocks(trial)
    device = next(trial.parameters()).device
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, trial.cfg.vocab_size, (batch, seq_len + 1), generator=generator).to(device)
    trial(tokens[:, :-1], targets=tokens[:, 1:], logits_grad=False).loss.backward()  # as the loop's


def maybe_compile(
    model: nn.Module, setting: CompileSetting, batch: int, seq_len: int, dtype: torch.dtype
) -> bool:
    """Compile `model`'s blocks if the setting asks for it on this device and a trial step succeeds; otherwise
    leave it eager (one warning when compile was asked for but cannot run). Returns whether it compiled."""
    device = next(model.parameters()).device
    if not isinstance(model, Transformer) or not wants_compile(setting, device, model.cfg, dtype):
        return False
    if (reason := unavailable_reason(device)) is not None:
        if setting is True:
            warnings.warn(f"parallel.compile: {reason}; training eager instead", stacklevel=2)
        else:
            log.info("parallel.compile=auto: %s; training eager", reason)
        return False
    try:
        trial_step(model, batch, seq_len, dtype)
    except Exception as error:  # any compiler failure: the eager model is still correct
        first_line = (str(error).strip().splitlines() or [""])[0][:200]
        warnings.warn(
            f"parallel.compile: torch.compile failed on a trial step ({type(error).__name__}: {first_line}); "
            "training eager instead",
            stacklevel=2,
        )
        return False
    compile_blocks(model)
    log.info("compiled %d transformer blocks", len(model.model.layers))
    return True
