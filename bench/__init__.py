"""Trainer benchmarks: `python -m bench` (CPU) and `bench/gpu.sh` (an NVIDIA machine)."""
