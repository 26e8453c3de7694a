"""Compression: its configuration, quantization (RTN, GPTQ), low-rank factors, pruning, the model-level passes and the variants."""
