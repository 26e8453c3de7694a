"""fp32 weights, with our module's keys, read back from a checkpoint the engine wrote (no engine needed)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from training.parallel.engine import DS_TAG
from training.parallel.expert_parallel import expert_parallel_state_dict


def fp32_state_dict(checkpoint: Path, tie_embeddings: bool) -> dict[str, Tensor]:
    """fp32 weights, with our module's keys, from a checkpoint written by `DeepSpeedEngine.save`.

    ZeRO 1-3 (and bf16 without ZeRO) keep fp32 master weights, which DeepSpeed's `zero_to_fp32` gathers; fp32
    training without ZeRO stores the module itself in fp32; expert-parallel checkpoints are reassembled into
    our stacked-expert layout.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    if any((checkpoint / DS_TAG).glob("layer_*_expert_*_model_states.pt")):
        state = expert_parallel_state_dict(checkpoint / DS_TAG)
    elif any((checkpoint / DS_TAG).glob("*optim_states.pt")) and not _plain_fp32(checkpoint):
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DS_TAG)
    else:
        state = torch.load(checkpoint / DS_TAG / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    state = {k: v.detach().float().clone() for k, v in state.items()}
    if tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _plain_fp32(checkpoint: Path) -> bool:
    """True for fp32 training without ZeRO: the module file already holds the fp32 weights (ZeRO-3 writes no
    such file: its module is partitioned)."""
    path = checkpoint / DS_TAG / "mp_rank_00_model_states.pt"
    if not path.is_file():
        return False
    module = torch.load(path, weights_only=False, mmap=True)
    dtypes = {v.dtype for v in module["module"].values()}
    return dtypes == {torch.float32} and not any((checkpoint / DS_TAG).glob("*zero_pp_rank*"))
