"""The training stages over one lifecycle (`lifecycle.py`): pretraining, SFT, DPO, distillation, the scaling sweep, compression."""
