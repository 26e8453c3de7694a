"""Expert parallelism (Rajbhandari et al. 2022, DeepSpeed-MoE): DeepSpeed's MoE layer behind our MoE interface,
swapped in before the engine is built, and our stacked-expert layout reassembled from its checkpoint files.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import Tensor, nn

from training.model.config import MoEConfig
from training.model.moe import MoE, RouterStats
from training.model.transformer import Transformer


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


_DS_MOE = re.compile(r"^model\.layers\.(\d+)\.mlp\.layer\.deepspeed_moe\.")


def expert_parallel_state_dict(state_dir: Path) -> dict[str, Tensor]:
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
