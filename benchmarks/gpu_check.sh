#!/usr/bin/env bash
# The GPU check, one command of at most 5 minutes, for when a GPU machine is lent: training throughput in bf16
# through the DeepSpeed engine vs a plain loop, MFU against the measured GEMM and the published bf16 peak
# (989 TFLOP/s for H100/H200), and the MoE cost. Needs the project installed (PYTHON points at its interpreter).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
export DS_ACCELERATOR=cuda OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
timeout 280 "$PYTHON" benchmarks/train_throughput.py --precision bf16 --skip-scaling --steps 30
