"""A checkpoint written on one layout (number of workers, experts per rank), loaded on another.

The module file of a ZeRO-0 fp32 checkpoint holds the whole optimiser state, which any number of workers loads
as it is. ZeRO 1-3 and the bf16 optimiser partition their fp32 master weights and optimiser state over the
ranks that wrote them: those files are converted into DeepSpeed's universal checkpoint (one folder per parameter
with its fp32 weight, Adam moments and step; Lian et al. 2024), which DeepSpeed slices for the new layout when it
loads. DeepSpeed's converter cannot place experts (each rank names its own experts 0..k-1), so an expert-parallel
checkpoint, or one continued with experts spread, is converted here: every rank's fragments are put back together
per expert (global expert = expert-parallel rank x experts per rank + local index), in our stacked layout, and each
new rank gets a universal folder holding the experts it owns under its own names. Expert parallelism with ZeRO-3,
or without partitioned optimiser state (fp32 ZeRO-0), is refused in one line, never loaded with wrong experts.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from infra.errors import UserError
from training.config import describe_layout

log = logging.getLogger(__name__)


class LayoutError(UserError):
    """A checkpoint that cannot continue on this attempt's layout; the message names the layout it can."""


def partitioned(state_dir: Path) -> bool:
    """True when the optimiser state is split over the ranks that wrote it (ZeRO 1-3, the bf16 optimiser)."""
    return any(state_dir.glob("*zero_pp_rank_*_optim_states.pt"))


def spreads_experts(saved_on: dict[str, int], now: dict[str, int]) -> bool:
    return saved_on.get("ep_size", 1) > 1 or now.get("ep_size", 1) > 1


def check_layout_change(state_dir: Path, saved_on: dict[str, int], now: dict[str, int]) -> None:
    """Refuse what cannot be resharded: experts spread over ranks without ZeRO 1-2 or bf16 partitions."""
    zero3 = any(state_dir.glob("zero_pp_rank_*_model_states.pt"))
    if spreads_experts(saved_on, now) and (zero3 or not partitioned(state_dir)):
        raise LayoutError(
            f"{state_dir.parent}: saved with {describe_layout(saved_on)}; an expert-parallel run moves to another "
            f"layout only with ZeRO 1-2 or bf16 (not {'ZeRO-3' if zero3 else 'fp32 ZeRO-0'}): {rerun_on(saved_on)}"
        )


def rerun_on(saved_on: dict[str, int]) -> str:
    """The fix a refusal names: the layout the checkpoint was saved on."""
    return f"rerun with parallel.world_size={saved_on['world_size']} parallel.ep_size={saved_on.get('ep_size', 1)}"


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


# DeepSpeed's MoE layer: a rank's k-th expert, and the router; ours keeps all experts stacked in one tensor
_DS_EXPERT = re.compile(
    r"^(.*\.mlp)\.layer\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(\w+)\.weight$"
)
_DS_ROUTER = re.compile(r"^(.*\.mlp)\.layer\.deepspeed_moe\.gate\.wg\.weight$")
_STACKED = re.compile(r"^.*\.mlp\.experts\.\w+$")
STATES = ("fp32", "exp_avg", "exp_avg_sq")


def canonical(name: str, rank: int, ep_size: int, local_experts: int) -> tuple[str, int | None]:
    """(our parameter name, global expert or None) of `rank`'s parameter `name`; DeepSpeed's expert groups are
    consecutive ranks, so the expert-parallel rank is rank mod ep_size."""
    if match := _DS_EXPERT.match(name):
        return f"{match[1]}.experts.{match[3]}", (rank % ep_size) * local_experts + int(match[2])
    if match := _DS_ROUTER.match(name):
        return f"{match[1]}.gate.weight", None
    return name, None


def gather_partitions(state_dir: Path, saved_on: dict[str, int]) -> tuple[dict, dict[str, Any], Tensor]:
    """Every parameter's fp32 weight and Adam moments, whole and flat, keyed by `canonical`; the optimiser's
    global state (loss scaler, clipping, version) and the step, from the ZeRO 1-2 / bf16 partition files."""
    files = sorted(state_dir.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=_rank_of)
    if len(files) != saved_on["world_size"]:
        raise LayoutError(f"{state_dir}: {len(files)} partition files for {describe_layout(saved_on)}")
    pieces: dict[tuple[str, int | None], dict[str, list[Tensor]]] = {}
    for rank, path in enumerate(files):
        sd = torch.load(path, weights_only=False, map_location="cpu")["optimizer_state_dict"]
        mappings = sd["param_slice_mappings"]
        local = _local_experts(mappings)
        for group, names in enumerate(mappings):
            flat = {"fp32": sd["single_partition_of_fp32_groups"][group]}
            state = sd["base_optimizer_state"]["state"][group]
            if not set(STATES[1:]) <= set(state):
                raise LayoutError(
                    f"{path}: optimiser state {sorted(state)} moves between layouts only as Adam's moments; "
                    f"{rerun_on(saved_on)}"
                )
            flat |= {name: state[name] for name in STATES[1:]}
            step = state["step"]
            for name, fragment in names.items():
                key = canonical(name, rank, saved_on.get("ep_size", 1), local)
                for which, tensor in flat.items():
                    part = tensor.narrow(0, fragment.start, fragment.numel)
                    pieces.setdefault(key, {}).setdefault(which, []).append(part)
        if rank == 0:
            common = {
                k: v for k, v in sd.items() if k not in ("base_optimizer_state", "param_slice_mappings")
            }
            common.pop("single_partition_of_fp32_groups")
    whole = {
        key: {which: torch.cat(parts) for which, parts in states.items()} for key, states in pieces.items()
    }
    return whole, common, torch.as_tensor(step)


def _rank_of(path: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", path.name)[1])


def _local_experts(mappings: list[dict[str, Any]]) -> int:
    """Experts per rank in one rank's partition mappings (per layer: the indices DeepSpeed's layer gives them)."""
    indices = {int(m[2]) for names in mappings for name in names if (m := _DS_EXPERT.match(name))}
    return len(indices) or 1


def experts_to_universal(
    state_dir: Path,
    out: Path,
    saved_on: dict[str, int],
    now: dict[str, int],
    rank: int,
    parameters: dict[str, Tensor],
    param_groups: list[dict[str, Any]],
) -> None:
    """A universal folder (`out`) for `rank` of the new layout: each of its `parameters` (name -> parameter, the
    engine's names) with fp32 weight, Adam moments and step, the experts it owns under its own names."""
    whole, common, step = gather_partitions(state_dir, saved_on)
    local = _local_experts([parameters])
    zero = out / "zero"
    for name, parameter in parameters.items():
        key = canonical(name, rank, now.get("ep_size", 1), local)
        states = _states_for(key, tuple(parameter.shape), whole, name, state_dir)
        folder = zero / name
        folder.mkdir(parents=True, exist_ok=True)
        for which, tensor in states.items():
            torch.save({"cat_dim": 0, "param": tensor.contiguous()}, folder / f"{which}.pt")
        torch.save(step.clone(), folder / "step.pt")
    groups = [{k: v for k, v in group.items() if k != "params"} for group in param_groups]
    torch.save({**common, "param_groups": groups}, zero / "optimizer_state.pt")
    for model_file in state_dir.glob("mp_rank_*_model_states.pt"):  # step counters and metadata
        shutil.copy(model_file, out / model_file.name)


def _states_for(
    key: tuple[str, int | None], shape: tuple[int, ...], whole: dict, name: str, state_dir: Path
) -> dict[str, Tensor]:
    """fp32 weight and moments of one parameter of the new layout, shaped: a stacked expert tensor from each
    expert's, one expert from the stacked tensor or its own, anything else as it was."""
    base, expert = key
    if expert is None and _STACKED.match(base) and (base, None) not in whole:  # ours from spread experts
        experts = sorted(e for b, e in whole if b == base)
        if len(experts) != shape[0]:
            raise LayoutError(
                f"{state_dir}: {len(experts)} experts saved for {name}, the model has {shape[0]}"
            )
        return {w: torch.stack([whole[base, e][w].view(shape[1:]) for e in experts]) for w in STATES}
    if expert is not None and (base, expert) not in whole and (base, None) in whole:  # one of our stacked
        return {w: whole[base, None][w].view(-1, *shape)[expert] for w in STATES}
    if key not in whole:
        raise LayoutError(
            f"{state_dir}: no saved state for {name} (expert {expert}); the model does not match"
        )
    return {w: whole[key][w].view(shape) for w in STATES}
