"""The accelerator (CUDA when present, else DeepSpeed's CPU accelerator over gloo) and the process group."""

from __future__ import annotations

import os
import socket

import torch

# DeepSpeed's CPU shared-memory all-reduce op (ShareMemCommBuilder.NAME). Only DeepSpeed-inference's tensor-parallel
# all-reduce uses it (training's collectives go through gloo), yet DeepSpeed compiles it whenever it starts a process
# group on a CPU: ~50 s of C++ in every new environment (each fresh install, `make demo`, a CI run).
SHM_COMM_OP = "deepspeed_shm_comm"


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
    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False  # not built: see SHM_COMM_OP
    deepspeed.init_distributed(dist_backend=backend)
