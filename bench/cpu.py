"""CPU benchmarks: trainer vs the naive loop, and the cost of periodic checkpoints."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench.naive import naive_samples_per_s
from training.config import load_config
from training.loop import Trainer

TINY = Path(__file__).resolve().parents[1] / "training" / "configs" / "tiny.yaml"


def trainer_metrics(work: Path, data: Path, *overrides: str) -> dict[str, object]:
    """Run the real trainer in-process and return its metrics.json."""
    shutil_rmtree(work)
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


def shutil_rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def trainer_vs_naive(
    work: Path, data: Path, model: str, image_size: int, batch: int, rounds: int
) -> dict[str, float]:
    """Interleaved rounds (naive, trainer, ...) so background load hits both alike; medians compared."""
    steps_per_epoch = 0
    naive, trainer = [], []
    for _ in range(rounds):
        metrics = trainer_metrics(
            work / "trainer",
            data,
            f"model.name={model}",
            f"data.image_size={image_size}",
            f"train.batch_size={batch}",
            f"train.micro_batch_size={batch}",
            "train.epochs=1",
            "train.deterministic=false",
            "data.num_workers=auto",
            "checkpoint.every_steps=0",
            "checkpoint.every_minutes=0",
        )
        steps_per_epoch = int(metrics["steps"])  # type: ignore[call-overload]
        trainer.append(float(metrics["samples_per_s"]))  # type: ignore[arg-type]
        naive.append(naive_samples_per_s(str(data / "train"), model, image_size, batch, steps_per_epoch))
    return {
        "naive_samples_per_s": statistics.median(naive),
        "trainer_samples_per_s": statistics.median(trainer),
        "ratio": statistics.median(trainer) / statistics.median(naive),
    }


def checkpoint_overhead(
    work: Path, data: Path, model: str, every_steps: int, rounds: int
) -> dict[str, float]:
    """Samples/s counting checkpoint save time, with a checkpoint every N steps vs none."""
    common = [f"model.name={model}", "train.epochs=2", "checkpoint.every_minutes=0", "checkpoint.keep=2"]
    without, with_checkpoints, save_seconds = [], [], []
    for _ in range(rounds):
        base = trainer_metrics(work / "none", data, *common, "checkpoint.every_steps=0")
        timed = trainer_metrics(work / "ckpt", data, *common, f"checkpoint.every_steps={every_steps}")
        samples = float(base["steps"]) * float(base["global_batch"])  # type: ignore[arg-type]
        without.append(float(base["samples_per_s"]))  # type: ignore[arg-type]
        checkpoints = timed["checkpoints"]
        assert isinstance(checkpoints, dict)
        # The final checkpoint is written after training; count only the periodic ones in the loop.
        periodic = int(checkpoints["count"]) - 1
        train_seconds = samples / float(timed["samples_per_s"])  # type: ignore[arg-type]
        spent = periodic * float(checkpoints["save_seconds_mean"])
        with_checkpoints.append(samples / (train_seconds + spent))
        save_seconds.append(float(checkpoints["save_seconds_mean"]))
    return {
        "every_steps": float(every_steps),
        "samples_per_s_without": statistics.median(without),
        "samples_per_s_with": statistics.median(with_checkpoints),
        "save_seconds_mean": statistics.median(save_seconds),
        "ratio": statistics.median(with_checkpoints) / statistics.median(without),
    }


def timed(label: str) -> float:
    print(f"... {label}", flush=True)
    return time.perf_counter()
