#!/usr/bin/env bash
# The GPU check (one GPU, under 8 minutes): the kernel tests compiled on CUDA (including
# the gpu-marked v41-flash-geometry ones), the engine equivalence test (Triton kernels vs
# torch kernels, greedy tokens, under Triton's interpreter in a child process), the engine
# placed on CUDA against the CPU engine (tests/engine/test_device.py), then bench/kernels.py. Figures go to
# bench/out/kernels.json; copy them, with the date, into README's Kernels section.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: no CUDA device")'
"$PY" -c 'import torch; print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)'
echo "== kernel tests on CUDA"
timeout 150 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels -m "not interpreter"
echo "== engine on CUDA (--device cuda) vs the CPU engine, every engine tensor on the GPU"
timeout 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/engine/test_device.py -m gpu
echo "== engine: Triton path vs torch path (greedy tokens)"
timeout 200 "$PY" -m pytest -q -x -p no:cacheprovider tests/kernels -m interpreter
echo "== bench/kernels.py"
timeout 100 "$PY" bench/kernels.py
