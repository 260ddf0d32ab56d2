#!/usr/bin/env bash
# The GPU check, ready for any machine with an NVIDIA GPU and this repo's venv (or the DLAMI's PyTorch), in
# at most 8 minutes: ResNet-50 throughput (bf16, channels_last, the trainer's micro-batch search) against the
# naive fp32 loop, the fp16 GradScaler path, a SIGTERM stop and resume of `python -m training`, two NCCL ranks
# where the machine has 2 GPUs (else skipped, saying so), and a new dated section of bench/RESULTS.md with the
# figures, GPU model, driver, torch/CUDA versions and date (bench/gpu.py says how each is measured).
#
# Usage: bench/gpu.sh [--compile] [--results FILE] [--no-write] [--parts throughput,fp16,stop-resume,two-ranks]
#        bench/gpu.sh --device cpu --tiny --results /tmp/gpu.md   # the CPU dry run: the plumbing, no figures
# Exit: 0 every part held; 1 a part failed (its figures are still written); 124 the 8-minute limit passed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
[[ -x "$PYTHON" ]] || PYTHON=python3
# The whole check's limit: 8 minutes, so a hung part cannot hold a GPU instance (and its bill) for ever.
LIMIT_S="${GPU_BENCH_LIMIT_S:-480}"

device=cuda
for arg in "$@"; do
  case "$arg" in
    --device=cpu) device=cpu ;;
    cpu) [[ "${previous:-}" == "--device" ]] && device=cpu ;;
  esac
  previous="$arg"
done

if [[ "$device" == cuda ]]; then
  # Loudly and early, in one line: nothing below means anything without a working NVIDIA GPU.
  if ! gpus="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null)" \
    || [[ -z "$gpus" ]]; then
    echo "bench/gpu.sh: no working NVIDIA GPU here (nvidia-smi failed); run it on a GPU instance, or --device cpu --tiny for the dry run" >&2
    exit 1
  fi
  echo "$gpus"
fi
date -u +"%Y-%m-%d %H:%M UTC"
exec timeout --signal=TERM --kill-after=20 "$LIMIT_S" "$PYTHON" -m bench.gpu "$@"
