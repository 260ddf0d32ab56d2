"""`python -m bench`: the CPU benchmarks; `python -m bench cost`: the cost replay; `python -m bench scaling`:
1 vs 2 process data-parallel scaling of the trainer on CPU; `python -m bench handover`: a spot notice with a
warm standby vs a cold replacement, and the rebalance hand-over (see bench/RESULTS.md)."""

from __future__ import annotations

import argparse
import logging
import platform
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table


def main() -> None:
    if sys.argv[1:2] == ["cost"]:
        # Pure Python: no torch import for the cost replay.
        from bench.cost import main as cost_main

        cost_main(sys.argv[2:])
        return
    if sys.argv[1:2] == ["scaling"]:
        from bench.scaling import main as scaling_main

        scaling_main(sys.argv[2:])
        return
    if sys.argv[1:2] == ["handover"]:
        from bench.handover import main as handover_main

        handover_main(sys.argv[2:])
        return
    cpu_benchmarks()


def cpu_benchmarks() -> None:
    import torch

    from bench.cpu import checkpoint_overhead, trainer_vs_naive
    from bench.emergency import emergency_checkpoint_seconds
    from training.sample_data import write_dataset

    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved repetitions per comparison")
    parser.add_argument("--model", default="resnet18")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    console.print(
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  {platform.processor() or platform.machine()}  "
        f"{torch.get_num_threads()} torch threads  torch {torch.__version__}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        write_dataset(data, classes=4, train_per_class=128, val_per_class=8, size=64)
        speed = trainer_vs_naive(work, data, args.model, image_size=56, batch=32, rounds=args.rounds)
        overhead = checkpoint_overhead(work, data, "mobilenet_v3_small", every_steps=16, rounds=args.rounds)
    emergency = emergency_checkpoint_seconds()

    table = Table(title="trainstack CPU benchmarks")
    for column in ("benchmark", "result", "target"):
        table.add_column(column)
    table.add_row(
        f"trainer vs naive loop ({args.model}, 56 px, batch 32, {args.rounds} rounds)",
        f"{speed['trainer_samples_per_s']:.1f} vs {speed['naive_samples_per_s']:.1f} samples/s "
        f"= {speed['ratio']:.2f}x (rounds {speed['ratio_min']:.2f}-{speed['ratio_max']:.2f}x; "
        f"median step {speed['median_step_ratio']:.2f}x; load {speed['load_before']:.1f} -> "
        f"{speed['load_after']:.1f})",
        ">= 1.0",
    )
    table.add_row(
        f"checkpoint every {overhead['every_steps']:.0f} steps (mobilenet_v3_small)",
        f"{overhead['samples_per_s_with']:.1f} vs {overhead['samples_per_s_without']:.1f} samples/s "
        f"= {overhead['ratio']:.3f} (save {overhead['save_seconds_mean']:.2f} s)",
        ">= 0.98",
    )
    table.add_row(
        "emergency checkpoint, ResNet-50 + momentum -> local S3 (moto)",
        f"{emergency['checkpoint_mb']:.0f} MB: save {emergency['local_save_s']:.1f} s + upload confirmed "
        f"{emergency['upload_confirmed_s']:.1f} s = {emergency['total_s']:.1f} s",
        "<< 120 s",
    )
    console.print(table)


if __name__ == "__main__":
    main()
