"""The model: configuration, the transformer (dense, MoE, linear attention), sampling, accounting, LoRA, and the Hugging Face mapping and export."""
