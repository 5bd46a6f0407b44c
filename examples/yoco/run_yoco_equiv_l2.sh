#!/usr/bin/env bash
# mask vs compact vs off on one prompt: per-position L2 distances and greedy agreement.
cd "$(dirname "$0")/../.." && exec "${PYTHON:-.venv/bin/python}" examples/yoco/yoco_equiv.py "$@"
