"""CPU benchmarks: trainer vs the naive loop, and the cost of periodic checkpoints."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

from bench.naive import naive_samples_per_s
from training.config import load_config
from training.loop import Trainer

TINY = Path(__file__).resolve().parents[1] / "training" / "configs" / "tiny.yaml"


def trainer_metrics(work: Path, data: Path, *overrides: str) -> dict[str, object]:
    """Run the real trainer in-process and return its metrics.json."""
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
    code = Trainer(config).run()
    if code != 0:
        raise RuntimeError(f"trainer exited {code} in {work}")
    metrics: dict[str, object] = json.loads((work / "output" / "metrics.json").read_text())
    return metrics


def trainer_vs_naive(
    work: Path, data: Path, model: str, image_size: int, batch: int, rounds: int
) -> dict[str, float]:
    """Rounds alternate which loop goes first, so background load and warm caches favour neither."""
    naive: list[float] = []
    trainer: list[float] = []

    def run_trainer() -> int:
        metrics = trainer_metrics(
            work / "trainer",
            data,
            f"model.name={model}",
            f"data.image_size={image_size}",
            f"train.batch_size={batch}",
            f"train.micro_batch_size={batch}",
            "train.epochs=2",
            "train.deterministic=false",
            "data.num_workers=auto",
            "checkpoint.every_steps=0",
            "checkpoint.every_minutes=0",
        )
        trainer.append(float(metrics["samples_per_s"]))  # type: ignore[arg-type]
        return int(metrics["steps"])  # type: ignore[call-overload]

    steps = run_trainer()  # also a warm-up: the first round's trainer figure is dropped below
    trainer.clear()
    for round_index in range(rounds):
        if round_index % 2:
            run_trainer()
        naive.append(naive_samples_per_s(str(data / "train"), model, image_size, batch, steps))
        if not round_index % 2:
            run_trainer()
    return {
        "naive_samples_per_s": statistics.median(naive),
        "trainer_samples_per_s": statistics.median(trainer),
        "ratio": statistics.median(trainer) / statistics.median(naive),
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
