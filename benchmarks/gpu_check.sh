#!/usr/bin/env bash
# The GPU check: one command of under 5 minutes on a CUDA machine, printing JSON lines.
#
#   bash benchmarks/gpu_check.sh prepare   # here, with the package index: wheels the GPU machine lacks -> .whl/
#   bash benchmarks/gpu_check.sh           # there: installs .whl/ into /tmp/site if needed, then measures
#
# `prepare` builds DeepSpeed (the version in the lock) as a pure-Python wheel (DS_BUILD_OPS=0: kernels are
# JIT-compiled where needed) and downloads cp312 manylinux wheels of pydantic, its core and their needs and hjson:
# what the engine-level path needs besides torch, transformers, peft, safetensors, pyarrow, numpy and PyYAML.
# Ray, MLflow and Prefect are not needed there (tests/integration/test_without_services.py).
# The check prints:
# - train_throughput.py, bf16, `gpt2-small-like` (124M) and `1b`: engine/plain ratio, MFU vs the measured GEMM
#   and vs the published peak (989 TFLOP/s dense bf16 for H100/H200; goal >= 0.45), MoE top-2-of-8 vs dense;
# - gpu_extras.py: ZeRO-2 vs ZeRO-0 step time, an fp16 run under dynamic loss scaling, and the bf16 logits of
#   the Hugging Face export vs ours on the GPU.
# GPU_CHECK_COMPILE=1 also times parallel.compile=true (longer: inductor compiles every block shape).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.whl

if [[ "${1:-}" == "prepare" ]]; then
  PY="${PYTHON:-.venv/bin/python}"
  mkdir -p "$WHEELS"
  grep -qxF "/$WHEELS/" .git/info/exclude 2>/dev/null || echo "/$WHEELS/" >> .git/info/exclude
  version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$WHEELS" "deepspeed==$(version deepspeed)"
  platforms=()
  for n in 2_17 2_27 2_28 2_31 2_34; do platforms+=(--platform "manylinux_${n}_x86_64"); done
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d "$WHEELS" \
    "pydantic==$(version pydantic)" "pydantic_core==$(version pydantic_core)" \
    "annotated-types==$(version annotated-types)" "typing-inspection==$(version typing-inspection)" \
    "hjson==$(version hjson)"
  du -sh "$WHEELS" && ls "$WHEELS"
  exit 0
fi

PY="${PYTHON:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}"
if ! "$PY" -c "import deepspeed, pydantic" 2>/dev/null; then
  [[ -d "$WHEELS" ]] || { echo "deepspeed/pydantic missing and no $WHEELS/: run 'bash $0 prepare' where pip can reach an index" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DS_ACCELERATOR=cuda OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), torch.__version__)"
compile=()
[[ "${GPU_CHECK_COMPILE:-0}" == 1 ]] && compile=(--compile)
timeout 170 "$PY" benchmarks/train_throughput.py --precision bf16 --skip-scaling --steps 15 "${compile[@]}"
timeout 110 "$PY" benchmarks/gpu_extras.py --shape gpt2-small-like
