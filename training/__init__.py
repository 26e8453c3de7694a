import logging

# torchao (imported by peft and transformers whenever it is installed, so in every worker) logs a warning per CUDA
# kernel library a CPU build lacks, and torch one per enum torchao registers: noise in every log
for _noisy in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_noisy).setLevel(logging.ERROR)
