"""DeepSpeed inside one worker, fenced in this package (the only place that imports `deepspeed`).

`process_group`: the accelerator and the process group; `engine`: the generated DeepSpeed config and the `Engine`
the loop drives; `expert_parallel`: DeepSpeed's expert-parallel MoE layer behind our MoE interface; `weights`:
fp32 weights read back from DeepSpeed checkpoints. The optimiser itself comes from `training/optim/optimizers.py`.

References: Rajbhandari et al. 2020 (ZeRO); Rajbhandari et al. 2022 (DeepSpeed-MoE, expert parallelism).
"""

from training.parallel.engine import DeepSpeedEngine, build_engine, deepspeed_config
from training.parallel.process_group import accelerator, init_distributed
from training.parallel.weights import fp32_state_dict

__all__ = [
    "DeepSpeedEngine",
    "accelerator",
    "build_engine",
    "deepspeed_config",
    "fp32_state_dict",
    "init_distributed",
]
