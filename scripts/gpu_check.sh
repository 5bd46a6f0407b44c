#!/usr/bin/env bash
# The GPU check (one GPU, under 8 minutes: the step timeouts below add up to 470 s):
#   1. kernel tests compiled on CUDA: every Triton kernel (ragged attention and the grouped
#      MoE expert products of DeepSeek V4 included) against
#      its torch reference, the gpu-marked v41-flash-geometry cases, and the engine on CUDA
#      with Triton vs the same engine with KVMESH_KERNELS=torch (greedy tokens, logits);
#   2. the engine placed on CUDA against the CPU engine in float64 (tests/engine/core/test_device.py:
#      placement, exact logits, pinned non-blocking host copies);
#   3. the engine on Triton's interpreter vs the torch kernels (the CPU check, kept here);
#   4. bench/kernels/bandwidth.py: GB/s and fraction of peak per kernel, Triton vs torch, and the
#      end-to-end decode tokens/s of a v41-flash-shaped stack.
# Figures go to bench/out/kernels.json (and kernels_decode.png); copy them, with the date,
# into README's "Kernels / GPU" section.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device")'
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)'
echo "== 1. kernel tests on CUDA (and the engine: Triton path vs torch path on CUDA)"
timeout 150 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels -m "not interpreter"
echo "== 2. engine on CUDA (--device cuda) vs the CPU engine, every engine tensor on the GPU"
timeout 60 "$PY" -m pytest -q -x -p no:cacheprovider tests/engine/core/test_device.py -m gpu
echo "== 3. engine: Triton interpreter vs torch kernels (greedy tokens)"
timeout 100 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels/test_engine_triton.py -m interpreter
echo "== 4. bench/kernels/bandwidth.py"
timeout 160 "$PY" -m bench.kernels.bandwidth
