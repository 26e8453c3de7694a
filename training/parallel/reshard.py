"""A checkpoint written on one layout (number of workers), loaded on another.

The module file of a ZeRO-0 fp32 checkpoint holds the whole optimiser state, which any number of workers loads
as it is. ZeRO 1-3 and the bf16 optimiser partition their fp32 master weights and optimiser state over the
ranks that wrote them: those files are converted into DeepSpeed's universal checkpoint (one folder per parameter
with its fp32 weight, Adam moments and step; Lian et al. 2024), which DeepSpeed slices for the new layout when it
loads. Expert-parallel checkpoints (DeepSpeed's MoE layer keeps its experts and their optimiser state per rank) are
refused, never loaded with the wrong experts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import shutil
from pathlib import Path

from infra.errors import UserError
from training.config import describe_layout

log = logging.getLogger(__name__)


class LayoutError(UserError):
    """A checkpoint that cannot continue on this attempt's layout; the message names the layout it can."""


def partitioned(state_dir: Path) -> bool:
    """True when the optimiser state is split over the ranks that wrote it (ZeRO 1-3, the bf16 optimiser)."""
    return any(state_dir.glob("*optim_states.pt"))


def has_experts_per_rank(state_dir: Path) -> bool:
    return any(state_dir.glob("layer_*_expert_*_model_states.pt"))


def check_layout_change(state_dir: Path, saved_on: dict[str, int], now: dict[str, int]) -> None:
    """Refuse what cannot be resharded: an expert-parallel checkpoint, or an expert-parallel attempt."""
    if has_experts_per_rank(state_dir) or saved_on.get("ep_size", 1) > 1 or now.get("ep_size", 1) > 1:
        raise LayoutError(
            f"{state_dir.parent}: saved with {describe_layout(saved_on)}; an expert-parallel run resumes only on the "
            f"layout it was saved on, not {describe_layout(now)}: rerun with parallel.world_size="
            f"{saved_on['world_size']} parallel.ep_size={saved_on.get('ep_size', 1)}"
        )


def to_universal(state_dir: Path, out: Path) -> None:
    """DeepSpeed's universal checkpoint of `state_dir`'s partitions, written to `out` (replaced if present)."""
    from deepspeed.checkpoint import ds_to_universal

    if out.exists():
        shutil.rmtree(out)
    args = argparse.Namespace(
        input_folder=str(state_dir),
        output_folder=str(out),
        num_extract_workers=1,  # in this process: workers would each import torch and DeepSpeed again
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=True,
    )
    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        ds_to_universal.main(args)
    log.debug("ds_to_universal: %s", said.getvalue())
