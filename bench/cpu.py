"""CPU benchmarks: trainer vs the naive loop, and the cost of periodic checkpoints."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from bench.naive import naive_step_ends
from training.config import Config, load_config
from training.data import Batch
from training.loop import Trainer

TINY = Path(__file__).resolve().parents[1] / "training" / "configs" / "tiny.yaml"

# Steps left out at the start of every run of either loop (first-call allocations, oneDNN primitive
# creation, cold caches): the comparison is of steady-state speed.
WARMUP_STEPS = 2


class TimedTrainer(Trainer):
    """The trainer unchanged, plus a timestamp at the end of each optimizer step (as the naive loop takes)."""

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.step_ends: list[float] = []

    def _optimizer_step(
        self,
        model: nn.Module,
        criterion: nn.Module,
        batches: Iterator[Batch],
        scheduler: torch.optim.lr_scheduler.LRScheduler,
    ) -> tuple[float, torch.Tensor, torch.Tensor]:
        result = super()._optimizer_step(model, criterion, batches, scheduler)
        self.step_ends.append(time.perf_counter())
        return result


def run_trainer(work: Path, data: Path, *overrides: str) -> tuple[dict[str, object], list[float]]:
    """Run the real trainer in-process; returns its metrics.json and the end time of every step."""
    shutil.rmtree(work, ignore_errors=True)
    config = load_config(
        TINY,
        [
            f"data.train_dir={data / 'train'}",
            f"data.val_dir={data / 'val'}",
            f"checkpoint.dir={work / 'checkpoints'}",
            f"output.dir={work / 'output'}",
            "train.log_every_steps=1000",
            *overrides,
        ],
    )
    trainer = TimedTrainer(config)
    code = trainer.run()
    if code != 0:
        raise RuntimeError(f"trainer exited {code} in {work}")
    metrics: dict[str, object] = json.loads((work / "output" / "metrics.json").read_text())
    return metrics, trainer.step_ends


def trainer_metrics(work: Path, data: Path, *overrides: str) -> dict[str, object]:
    """Run the real trainer in-process and return its metrics.json."""
    return run_trainer(work, data, *overrides)[0]


def steady_step_seconds(ends: list[float], steps_per_epoch: int, warmup: int = WARMUP_STEPS) -> list[float]:
    """Each step's time, from the end of the previous step, for the steps after `warmup`. The first step
    of each epoch is left out: its gap holds the trainer's evaluation (which its own samples/s excludes
    too) and either loop's loader restart."""
    return [ends[i] - ends[i - 1] for i in range(max(1, warmup), len(ends)) if i % steps_per_epoch]


def trainer_vs_naive(
    work: Path, data: Path, model: str, image_size: int, batch: int, rounds: int
) -> dict[str, float]:
    """Both loops on the same images, model, batch and seed, in this process (so with the same torch
    threads), `rounds` times, each round running both back to back and alternating which goes first.

    Per round and loop: samples/s over the steady steps (see `steady_step_seconds`). The ratio is the
    median of the per-round ratios, so a load spike on this shared machine skews one pair, not the
    result; the median step time (robust to a spike inside a run) gives a second ratio.
    A first round of both, untimed, warms the page cache and the allocator.
    """
    threads = torch.get_num_threads()
    epochs = 2
    steps_per_epoch = 0
    trainer_reported: list[float] = []

    def run_the_trainer() -> list[float]:
        nonlocal steps_per_epoch
        metrics, ends = run_trainer(
            work / "trainer",
            data,
            f"model.name={model}",
            f"data.image_size={image_size}",
            f"train.batch_size={batch}",
            f"train.micro_batch_size={batch}",
            f"train.epochs={epochs}",
            "train.deterministic=false",
            "data.num_workers=auto",
            "checkpoint.every_steps=0",
            "checkpoint.every_minutes=0",
        )
        trainer_reported.append(float(metrics["samples_per_s"]))  # type: ignore[arg-type]
        steps_per_epoch = int(metrics["steps"]) // epochs  # type: ignore[call-overload]
        return ends

    def run_naive(steps: int) -> list[float]:
        return naive_step_ends(str(data / "train"), model, image_size, batch, steps)

    load_before = os.getloadavg()[0]
    steps = len(run_the_trainer())  # the untimed warm-up round
    run_naive(steps)
    trainer_reported.clear()
    per_round: list[dict[str, float]] = []
    for round_index in range(rounds):
        if round_index % 2:
            naive_ends = run_naive(steps)
            trainer_ends = run_the_trainer()
        else:
            trainer_ends = run_the_trainer()
            naive_ends = run_naive(steps)
        if torch.get_num_threads() != threads:
            raise RuntimeError(f"torch threads changed from {threads} to {torch.get_num_threads()}")
        result: dict[str, float] = {}
        for name, ends in (("trainer", trainer_ends), ("naive", naive_ends)):
            seconds = steady_step_seconds(ends, steps_per_epoch)
            result[f"{name}_samples_per_s"] = batch * len(seconds) / sum(seconds)
            result[f"{name}_median_step_s"] = statistics.median(seconds)
        per_round.append(result)
    ratios = [r["trainer_samples_per_s"] / r["naive_samples_per_s"] for r in per_round]
    median_step_ratios = [r["naive_median_step_s"] / r["trainer_median_step_s"] for r in per_round]
    return {
        "naive_samples_per_s": statistics.median(r["naive_samples_per_s"] for r in per_round),
        "trainer_samples_per_s": statistics.median(r["trainer_samples_per_s"] for r in per_round),
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "median_step_ratio": statistics.median(median_step_ratios),
        "trainer_reported_samples_per_s": statistics.median(trainer_reported),
        "rounds": float(rounds),
        "threads": float(threads),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }


def checkpoint_overhead(
    work: Path, data: Path, model: str, every_steps: int, rounds: int
) -> dict[str, float]:
    """Samples/s with a checkpoint every N steps, counting each save's stall, vs the same run without them.

    Both figures come from the same run (its training time, and the time the loop stood still for each
    periodic save), so machine noise between runs does not swamp a cost of a few percent. The S3
    upload runs in a background thread and is not a stall; with no checkpoint.uri here it is not run.
    """
    common = [f"model.name={model}", "train.epochs=4", "checkpoint.every_minutes=0", "checkpoint.keep=2"]
    without, with_checkpoints, save_seconds = [], [], []
    for _ in range(rounds):
        timed = trainer_metrics(work / "ckpt", data, *common, f"checkpoint.every_steps={every_steps}")
        samples = float(timed["steps"]) * float(timed["global_batch"])  # type: ignore[arg-type]
        checkpoints = timed["checkpoints"]
        assert isinstance(checkpoints, dict)
        periodic = int(checkpoints["count"]) - 1  # the last one is written after training ends
        train_seconds = samples / float(timed["samples_per_s"])  # type: ignore[arg-type]
        stall = periodic * float(checkpoints["save_seconds_mean"])
        without.append(samples / train_seconds)
        with_checkpoints.append(samples / (train_seconds + stall))
        save_seconds.append(float(checkpoints["save_seconds_mean"]))
    return {
        "every_steps": float(every_steps),
        "samples_per_s_without": statistics.median(without),
        "samples_per_s_with": statistics.median(with_checkpoints),
        "save_seconds_mean": statistics.median(save_seconds),
        "ratio": statistics.median(with_checkpoints) / statistics.median(without),
    }
