#!/usr/bin/env bash
# The GPU benchmark, ready for any machine with an NVIDIA GPU and this repo's venv (or the DLAMI's
# PyTorch): ResNet-50 on synthetic data, trainer (bf16/fp16 auto, channels_last, auto micro-batch,
# compiled and not) vs the naive fp32 loop. Prints img/s, the micro-batch found and peak memory.
# Usage: bench/gpu.sh [--model resnet50] [--steps 50] [--max-batch 256]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3
if ! nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; then
  echo "bench/gpu.sh: no working NVIDIA GPU (nvidia-smi failed); run it on a GPU instance" >&2
  exit 1
fi
lscpu | grep -E '^Model name|^CPU\(s\)' || true
date -u +"%Y-%m-%d %H:%M UTC"
exec "$PYTHON" -m bench.gpu "$@"
