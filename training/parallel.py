"""DeepSpeed inside one worker: the process group, the generated DeepSpeed config, the `Engine` the loop drives,
the expert-parallel MoE swap, and reading weights back from its checkpoints. The only module that imports
`deepspeed`; the optimiser itself comes from `training/optim.py`.

References: Rajbhandari et al. 2020 (ZeRO); Rajbhandari et al. 2022 (DeepSpeed-MoE, expert parallelism).
The accelerator is CUDA when present, else DeepSpeed's CPU accelerator over gloo.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from data_pipeline.loader import Batch
from training.config import OptimConfig, ParallelConfig, TrainConfig
from training.model import ModelOutput, Transformer
from training.moe import MoE, MoEConfig, RouterStats
from training.optim import BuiltByDeepSpeed, build_optimizer, param_groups

log = logging.getLogger(__name__)
DS_TAG = "state"  # DeepSpeed's tag inside each of our checkpoint directories


def accelerator() -> str:
    """'cuda' when a GPU is visible, else 'cpu'; exported as DS_ACCELERATOR before deepspeed is imported."""
    name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
    os.environ["DS_ACCELERATOR"] = name
    return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed() -> None:
    """Join the process group Ray Train set up, or start a one-process group on 127.0.0.1."""
    backend = "nccl" if accelerator() == "cuda" else "gloo"
    import deepspeed

    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1"
        )
    deepspeed.init_distributed(dist_backend=backend)


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = (
            deep_merge(merged[key], value)
            if isinstance(value, dict) and isinstance(merged.get(key), dict)
            else value
        )
    return merged


def deepspeed_config(parallel: ParallelConfig, optim: OptimConfig, train: TrainConfig) -> dict[str, Any]:
    """The DeepSpeed JSON for these slices (the optimiser is passed separately); `parallel.deepspeed` keys are
    merged on top."""
    config: dict[str, Any] = {
        "train_batch_size": train.global_batch(parallel.world_size),
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum_steps(parallel.world_size),
        "gradient_clipping": optim.grad_clip,
        "zero_optimization": {"stage": parallel.zero_stage},
        "bf16": {"enabled": parallel.precision == "bf16"},
        "fp16": {"enabled": parallel.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }
    return deep_merge(config, parallel.deepspeed)


class _ExpertFFN(nn.Module):
    """One SwiGLU expert, the unit DeepSpeed's MoE layer replicates."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(torch.nn.functional.silu(gate) * up)


class ExpertParallelMoE(nn.Module):
    """Our MoE interface over DeepSpeed's expert-parallel layer: dropless, top-k renormalised (k >= 2).

    Each rank holds n_experts / ep_size experts; tokens travel to their experts by all-to-all. Outputs equal
    ours for the same weights (tested); the load-balancing loss is DeepSpeed's, which for top-2 counts only
    first choices (GShard), and there is no z-loss on this path.
    """

    def __init__(self, d_model: int, cfg: MoEConfig, ep_size: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE as DeepSpeedMoE

        self.layer = DeepSpeedMoE(
            hidden_size=d_model,
            expert=_ExpertFFN(d_model, cfg.d_ff_expert),
            num_experts=cfg.n_experts,
            ep_size=ep_size,
            k=cfg.top_k,
            drop_tokens=False,
            use_rts=False,
            top2_2nd_expert_sampling=False,
        )
        self.n_experts = cfg.n_experts
        self.ep_size = ep_size

    def forward(self, x: Tensor) -> tuple[Tensor, RouterStats]:
        y, aux, counts = self.layer(x)
        return y, RouterStats(aux_loss=aux, z_loss=aux.new_zeros(()), tokens_per_expert=counts)

    @torch.no_grad()
    def load_from(self, ours: MoE) -> None:
        """Copy the router and this rank's experts from one of our MoE layers (same weights, same outputs)."""
        self.layer.deepspeed_moe.gate.wg.weight.copy_(ours.gate.weight)
        experts = self.layer.deepspeed_moe.experts
        ep_rank = torch.distributed.get_rank() % self.ep_size  # DeepSpeed's expert groups: consecutive ranks
        first = experts.num_local_experts * ep_rank
        for local, expert in enumerate(experts.deepspeed_experts):
            expert.gate_up_proj.weight.copy_(ours.experts.gate_up_proj[first + local])
            expert.down_proj.weight.copy_(ours.experts.down_proj[first + local])


def swap_in_expert_parallel(model: Transformer, ep_size: int) -> None:
    """Replace every MoE feed-forward by DeepSpeed's expert-parallel layer, keeping the weights."""
    assert model.cfg.moe is not None
    for block in model.model.layers:
        if isinstance(block.mlp, MoE):
            parallel = ExpertParallelMoE(model.cfg.d_model, model.cfg.moe, ep_size)
            parallel.load_from(block.mlp)
            block.mlp = parallel


def checkpoint_activations(model: Transformer) -> None:
    """Recompute each block's activations in backward instead of storing them (Chen et al. 2016)."""
    from torch.utils.checkpoint import checkpoint

    for block in model.model.layers:
        forward = block.forward
        block.forward = lambda *args, _forward=forward: checkpoint(_forward, *args, use_reentrant=False)


class DeepSpeedEngine:
    """The loop's `Engine` over a DeepSpeed engine (DeepSpeed counts micro-batches in its own `step()` calls)."""

    def __init__(self, ds: Any) -> None:
        self.ds = ds
        self.module: nn.Module = ds.module
        self.accumulation_steps: int = ds.gradient_accumulation_steps()
        self.device = next(ds.module.parameters()).device
        self._micro = 0
        # DeepSpeed reports no gradient norm for plain fp32 without ZeRO; there p.grad holds the full gradient.
        self._plain_grads = ds.zero_optimization_stage() == 0 and not (ds.bfloat16_enabled() or ds.fp16_enabled())

    def forward(self, batch: Batch) -> ModelOutput:
        return self.ds(batch.inputs.to(self.device), targets=batch.targets.to(self.device))

    def backward(self, loss: Tensor) -> None:
        self.ds.backward(loss)
        self._micro += 1
        if self._micro < self.accumulation_steps:
            self.ds.step()  # not a boundary: DeepSpeed only advances its micro-step counter

    def step(self, lr: float) -> float:
        for group in self.ds.optimizer.param_groups:
            group["lr"] = lr
        local = _grad_norm(self.module) if self._plain_grads else float("nan")
        self.ds.step()
        self._micro = 0
        reported = self.ds.get_global_grad_norm()
        return float(reported) if reported is not None else local

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    def save(self, directory: Path) -> None:
        """All ranks: module, optimizer and step counters (without DeepSpeed's `latest` pointer)."""
        self.ds.save_checkpoint(str(directory), tag=DS_TAG, save_latest=False)

    def load(self, directory: Path) -> None:
        path, _ = self.ds.load_checkpoint(str(directory), tag=DS_TAG, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{directory}: DeepSpeed found no checkpoint to load")


def _grad_norm(module: nn.Module) -> float:
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads)) if grads else float("nan")


def build_engine(
    model: nn.Module, optim: OptimConfig, parallel: ParallelConfig, train: TrainConfig
) -> DeepSpeedEngine:
    """deepspeed.initialize over our parameter groups and the optimiser `training/optim.py` builds."""
    import deepspeed

    if parallel.ep_size > 1:
        swap_in_expert_parallel(model, parallel.ep_size)
    if parallel.activation_checkpointing:
        checkpoint_activations(model)
    groups = param_groups(model, optim)
    if parallel.ep_size > 1:  # expert weights are reduced within their expert-data-parallel group only
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    config = deepspeed_config(parallel, optim, train)
    optimizer = build_optimizer(groups, optim)
    if isinstance(optimizer, BuiltByDeepSpeed):
        config["optimizer"] = optimizer.config
        ds, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    else:
        ds, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return DeepSpeedEngine(ds)


def fp32_state_dict(checkpoint: Path, tie_embeddings: bool) -> dict[str, Tensor]:
    """fp32 weights, with our module's keys, from a checkpoint written by `save_engine` (no engine needed).

    ZeRO 1-3 (and bf16 without ZeRO) keep fp32 master weights, which DeepSpeed's `zero_to_fp32` gathers; fp32
    training without ZeRO stores the module itself in fp32; expert-parallel checkpoints are reassembled into
    our stacked-expert layout.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if any((checkpoint / DS_TAG).glob("layer_*_expert_*_model_states.pt")):
        state = _expert_parallel_state_dict(checkpoint / DS_TAG)
    elif any((checkpoint / DS_TAG).glob("*optim_states.pt")) and not _plain_fp32(checkpoint):
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DS_TAG)
    else:
        state = torch.load(checkpoint / DS_TAG / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    state = {k: v.detach().float().clone() for k, v in state.items()}
    if tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


_DS_MOE = re.compile(r"^model\.layers\.(\d+)\.mlp\.layer\.deepspeed_moe\.")


def _expert_parallel_state_dict(state_dir: Path) -> dict[str, Tensor]:
    """Our MoE layout from DeepSpeed's expert-parallel files: router from the module file, one file per expert.

    DeepSpeed's MoE checkpoints carry no fp32 master copy that `zero_to_fp32` can gather, so these are the
    module's (training-precision) weights.
    """
    module = torch.load(state_dir / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    state = {k: v for k, v in module.items() if not _DS_MOE.match(k)}
    experts: dict[int, dict[int, dict[str, Tensor]]] = {}
    for key, value in module.items():
        if match := _DS_MOE.match(key):
            state[f"model.layers.{match.group(1)}.mlp.gate.weight"] = value
    for path in state_dir.glob("layer_*_expert_*_model_states.pt"):
        for key, value in torch.load(path, weights_only=False).items():
            layer, rest = (
                int(_DS_MOE.match(key).group(1)),
                _DS_MOE.sub("", key),
            )  # experts.deepspeed_experts.E.x.weight
            _, _, expert, name, _ = rest.split(".")
            experts.setdefault(layer, {}).setdefault(int(expert), {})[name] = value
    for layer, by_expert in experts.items():
        ordered = [by_expert[e] for e in sorted(by_expert)]
        state[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [e["gate_up_proj"] for e in ordered]
        )
        state[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([e["down_proj"] for e in ordered])
    return state


def _plain_fp32(checkpoint: Path) -> bool:
    """True for fp32 training without ZeRO: the module file already holds the fp32 weights."""
    module = torch.load(checkpoint / DS_TAG / "mp_rank_00_model_states.pt", weights_only=False, mmap=True)
    dtypes = {v.dtype for v in module["module"].values()}
    return dtypes == {torch.float32} and not any((checkpoint / DS_TAG).glob("*zero_pp_rank*"))
