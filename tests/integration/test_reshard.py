"""Optimiser state moved to other layouts and back, parameter by parameter, in DeepSpeed engines of spawned gloo
processes (training/parallel/reshard.py). A bf16 ZeRO-2 MoE saved at EP=2 on 2 ranks, loaded at EP=1 on 1 rank (our
stacked experts) and saved, loaded at EP=2 on 2 ranks and saved: every expert's fp32 master weight, Adam moments and
step survive both moves exactly, and the EP=1 engine computes with the EP=2 engines' experts in their global order.
A dense bf16 ZeRO-3 model (weights partitioned too) saved on 2 ranks, moved to 1 and then to 4: the same."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.pretrain_helpers import MOE

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MOE_SETTINGS = [MOE, "parallel.zero_stage=2", "parallel.precision=bf16", "train.micro_batch_size=2"]


def engine_process(
    rank: int,
    world: int,
    ep: int,
    port: int,
    settings: list[str],
    load: str | None,
    save: str,
    saved_on: dict,
) -> None:
    """One rank of the smoke recipe with `settings` on `world` ranks, experts over `ep`: build the engine, load
    `load` (written on `saved_on`) or train two steps, save to `save`, and dump the module's weights."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    from data_pipeline.loader import Batch
    from flows.recipe import load_recipe
    from training.model.transformer import Transformer
    from training.parallel import build_engine, init_distributed

    init_distributed()
    recipe = load_recipe("smoke", [*settings, "train.global_batch_size=4"])
    # the layout set here: the recipe's other stages need not fit it
    parallel = recipe.parallel.model_copy(update={"world_size": world, "ep_size": ep})
    engine = build_engine(Transformer(recipe.model, seed=0), recipe.optim, parallel, recipe.train)
    if load is None:
        tokens = torch.Generator().manual_seed(rank)
        micro = recipe.train.micro_batch_size
        for _ in range(2):
            for _ in range(engine.accumulation_steps):
                batch = torch.randint(0, recipe.model.vocab_size, (micro, 33), generator=tokens)
                engine.backward(engine.forward(Batch(batch[:, :-1], batch[:, 1:])).loss)
            engine.step(1e-3)
    else:
        engine.load(Path(load), saved_on)
    engine.save(Path(save))
    engine.saved()
    weights = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    torch.save(weights, f"{save}/weights-rank{rank}.pt")


def spawn(
    world: int, settings: list[str], load: Path | None, save: Path, saved_on: dict | None = None, ep: int = 1
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = (world, ep, port, settings, str(load) if load else None, str(save), saved_on)
    # a fork server that imported torch and DeepSpeed once (~8 s a process here); not a fork of this process,
    # whose process group (an in-process engine test's) the ranks must not inherit
    mp.set_forkserver_preload(["torch", "deepspeed", "training.parallel", "flows.recipe"])
    mp.start_processes(engine_process, args=args, nprocs=world, start_method="forkserver")


def per_expert(state_dir: Path, saved_on: dict) -> dict:
    """Every parameter's (fp32, exp_avg, exp_avg_sq), our names, a stacked expert tensor split into its experts."""
    from training.parallel.reshard import _STACKED, STATES, gather_partitions

    whole, _, step = gather_partitions(state_dir, saved_on)
    out = {}
    for (name, expert), states in whole.items():
        if expert is None and _STACKED.match(name):
            n = 4  # MOE: 4 experts
            for e in range(n):
                out[name, e] = tuple(states[w].view(n, -1)[e] for w in STATES)
        else:
            out[name, expert] = tuple(states[w] for w in STATES)
    return {**out, "step": step}


def test_expert_parallel_state_moves_to_one_rank_and_back_expert_by_expert(tmp_path: Path) -> None:
    from training.parallel.engine import DS_TAG

    two, one, back = tmp_path / "ep2", tmp_path / "ep1", tmp_path / "ep2-again"
    spawn(2, MOE_SETTINGS, None, two, ep=2)
    spawn(1, MOE_SETTINGS, two, one, {"world_size": 2, "ep_size": 2})
    spawn(2, MOE_SETTINGS, one, back, {"world_size": 1, "ep_size": 1}, ep=2)

    saved = per_expert(two / DS_TAG, {"world_size": 2, "ep_size": 2})
    assert (
        len([k for k in saved if k != "step" and k[1] is not None]) == 2 * 2 * 4
    )  # layers x weights x experts
    for moved, layout in ((one, {"world_size": 1, "ep_size": 1}), (back, {"world_size": 2, "ep_size": 2})):
        state = per_expert(moved / DS_TAG, layout)
        assert state.keys() == saved.keys()
        assert int(state["step"]) == int(saved["step"]) == 2
        for key in saved:
            if key != "step":
                assert all(torch.equal(a, b) for a, b in zip(state[key], saved[key], strict=True)), key

    # the weights the EP=1 engine computes with: rank r's k-th expert at EP=2 is global expert 2r + k
    ours = torch.load(one / "weights-rank0.pt")
    theirs = [torch.load(two / f"weights-rank{r}.pt") for r in range(2)]
    prefix = "model.layers.{}.mlp.layer.deepspeed_moe.experts.deepspeed_experts.{}.{}.weight"
    for layer in range(2):
        for weight in ("gate_up_proj", "down_proj"):
            stacked = ours[f"model.layers.{layer}.mlp.experts.{weight}"]
            for e in range(4):
                assert torch.equal(stacked[e], theirs[e // 2][prefix.format(layer, e % 2, weight)]), (
                    layer,
                    e,
                )


def test_zero3_state_moves_from_two_ranks_to_one_and_to_four(tmp_path: Path) -> None:
    """DeepSpeed's universal checkpoint, for weights partitioned too: fp32 master weights and Adam moments equal
    after 2 -> 1 -> 4 ranks, read back through the same conversion."""
    from training.parallel.engine import DS_TAG
    from training.parallel.reshard import to_universal

    settings = ["parallel.zero_stage=3", "parallel.precision=bf16", "train.micro_batch_size=1"]
    two, one, four = tmp_path / "two", tmp_path / "one", tmp_path / "four"
    spawn(2, settings, None, two)
    spawn(1, settings, two, one, {"world_size": 2, "ep_size": 1})
    spawn(4, settings, one, four, {"world_size": 1, "ep_size": 1})
    states = []
    for saved in (two, one, four):
        to_universal(saved / DS_TAG, tmp_path / f"universal-{saved.name}")
        zero = tmp_path / f"universal-{saved.name}" / "zero"
        states.append(
            {
                f"{param.name}/{which}": tensor_in(param / f"{which}.pt")
                for param in zero.iterdir()
                if param.is_dir()
                for which in ("fp32", "exp_avg", "exp_avg_sq")
            }
        )
    assert len(states[0]) == 3 * 21  # the smoke model's parameters
    for moved in states[1:]:
        assert moved.keys() == states[0].keys()
        assert all(torch.equal(moved[k], states[0][k]) for k in states[0]), [
            k for k in states[0] if not torch.equal(moved[k], states[0][k])
        ]


def tensor_in(path: Path) -> torch.Tensor:
    """A universal checkpoint file's tensor (ZeRO 1-2 files wrap it in a dict, ZeRO-3's do not)."""
    saved = torch.load(path, weights_only=False)
    return saved["param"] if isinstance(saved, dict) else saved
