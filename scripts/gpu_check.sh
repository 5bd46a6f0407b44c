#!/usr/bin/env bash
# The GPU check (one GPU, under 10 minutes: the step timeouts below add up to 530 s):
#   1. kernel tests compiled on CUDA: every Triton kernel (the grouped MoE expert products and
#      MXFP8 quantization the DeepSeek V4 engine calls included) against its torch reference,
#      and the gpu-marked V4-Flash-scale cases;
#   2. the shipped model's engine with its Triton kernels on Triton's interpreter vs the torch
#      kernels (the CPU check, kept here), and a DeepSeek V4.1 engine served with
#      --device cuda against the same checkpoint on the CPU (greedy tokens, MTP, a prefix
#      hit, truncation; tests/engine/deepseek_v41/test_device.py -m gpu);
#   3. bench/kernels/bandwidth.py: GB/s and fraction of peak per kernel, Triton vs torch.
# Figures go to bench/out/kernels.json (and kernels_moe.png); copy them, with the date,
# into README's "Kernels / GPU" section.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device")'
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)'
echo "== 1. kernel tests on CUDA"
timeout 150 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels -m "not interpreter"
echo "== 2. engine: Triton interpreter vs torch kernels (greedy tokens)"
timeout 100 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels/test_v4_engine_triton.py -m interpreter
timeout 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/engine/deepseek_v41/test_device.py -m gpu
echo "== 3. bench/kernels/bandwidth.py"
timeout 160 "$PY" -m bench.kernels.bandwidth
