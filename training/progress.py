"""Progress: a log line every N steps, `progress.json` for the agent, and the data-starvation warning."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from trainstack_job.atomic import write_atomic
from trainstack_job.contract import PROGRESS
from trainstack_job.layout import now_iso
from trainstack_job.records import Progress, first_step_stamp

log = logging.getLogger("training")

# Above this share of step time spent waiting for the loader, the accelerator is starved (the seeds'
# "GPU utilisation under 50-70%" rule, measured at the source instead of guessed from nvidia-smi).
DATA_WAIT_WARNING = 0.30
SUSTAINED_LOG_LINES = 3


class GpuMonitor:
    """Utilisation and memory of this process's GPU via NVML; silent where there is none."""

    def __init__(self, device: torch.device) -> None:
        self.handle: Any = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self._nvml = pynvml
        except Exception:  # no driver/NVML: report nothing rather than fail the job
            self.handle = None

    def sample(self) -> dict[str, float]:
        if self.handle is None:
            return {}
        try:
            util = self._nvml.nvmlDeviceGetUtilizationRates(self.handle)
            memory = self._nvml.nvmlDeviceGetMemoryInfo(self.handle)
        except Exception:
            return {}
        return {"gpu_util_percent": float(util.gpu), "gpu_memory_gib": memory.used / 2**30}


@dataclass
class Interval:
    """Counters since the last log line."""

    started: float
    wait_seconds: float = 0.0
    samples: int = 0
    steps: int = 0


class ProgressReporter:
    def __init__(
        self,
        output_dir: Path | None,
        *,
        epochs: int,
        total_steps: int,
        log_every: int,
        device: torch.device,
        num_workers: int,
        world_size: int = 1,
        precision: str | None = None,
        model: str | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = output_dir / PROGRESS if output_dir else None
        self.device = device
        self.epochs = epochs
        self.total_steps = total_steps
        self.log_every = log_every
        self.num_workers = num_workers
        # In progress.json: how many ranks trained, so the agent can show a job's world size over time.
        self.world_size = world_size
        # In progress.json: what the agent records each life's samples/s for (trainstack_job/throughput.py).
        self.precision = precision
        self.model = model
        self.gpu = GpuMonitor(device)
        self.interval = Interval(time.perf_counter())
        self.total_wait = 0.0
        self.total_train_seconds = 0.0
        self.total_samples = 0
        self.starved_lines = 0
        self.last: dict[str, Any] = {}
        # In progress.json: when this process completed its first optimizer step (wall clock, as the agent's
        # life start is), from which the agent keeps its life's time to first step. Once per process: a
        # resumed life runs a new trainer, so its first step is its own.
        self._wall_clock = wall_clock
        self.first_step_at: str | None = None

    def record_step(self, wait_seconds: float, samples: int) -> None:
        if self.first_step_at is None:
            if self.device.type == "cuda":
                # CUDA runs the step's kernels after the call returns: wait for them (once), so this is when
                # the first step finished, not when it was queued.
                torch.cuda.synchronize(self.device)
            moment = datetime.fromtimestamp(self._wall_clock(), timezone.utc)
            self.first_step_at = first_step_stamp(moment)
        self.interval.wait_seconds += wait_seconds
        self.interval.samples += samples
        self.interval.steps += 1

    def pause(self) -> float:
        """Close the interval before untimed work (eval, checkpoint); returns the time it covered."""
        elapsed = time.perf_counter() - self.interval.started
        self.total_train_seconds += elapsed
        self.total_wait += self.interval.wait_seconds
        self.total_samples += self.interval.samples
        return elapsed

    def resume(self) -> None:
        self.interval = Interval(time.perf_counter())

    def due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

    def report(self, *, epoch: int, step: int, loss: float) -> dict[str, Any]:
        elapsed = max(self.pause(), 1e-9)
        interval = self.interval
        samples_per_s = interval.samples / elapsed
        wait_fraction = min(1.0, interval.wait_seconds / elapsed)
        step_seconds = elapsed / max(1, interval.steps)
        eta_s = round((self.total_steps - step) * step_seconds)
        progress = Progress(
            step=step,
            total_steps=self.total_steps,
            updated_at=now_iso(),
            epoch=epoch,
            epochs=self.epochs,
            loss=round(loss, 5),
            samples_per_s=round(samples_per_s, 1),
            data_wait_fraction=round(wait_fraction, 3),
            first_step_at=self.first_step_at,
            eta_s=eta_s,
            world_size=self.world_size,
            precision=self.precision,
            model=self.model,
            extra={k: round(v, 2) for k, v in self.gpu.sample().items()},
        ).to_json()
        gpu = ""
        if "gpu_util_percent" in progress:
            gpu = f"  gpu {progress['gpu_util_percent']:.0f}% {progress['gpu_memory_gib']:.1f} GiB"
        log.info(
            "epoch %d/%d step %d/%d  loss %.4f  %.1f samples/s  data-wait %.0f%%%s  eta %s",
            epoch,
            self.epochs,
            step,
            self.total_steps,
            loss,
            samples_per_s,
            100 * wait_fraction,
            gpu,
            _duration(eta_s),
        )
        self._warn_if_starved(wait_fraction)
        if self.path is not None:
            write_atomic(self.path, json.dumps(progress).encode())
        self.last = progress
        self.resume()
        return progress

    def _warn_if_starved(self, wait_fraction: float) -> None:
        self.starved_lines = self.starved_lines + 1 if wait_fraction > DATA_WAIT_WARNING else 0
        if self.starved_lines == SUSTAINED_LOG_LINES:
            log.warning(
                "data loading is the bottleneck: %.0f%% of each step waits for the loader; raise "
                "data.num_workers (now %d), keep the data on local NVMe, or store smaller images",
                100 * wait_fraction,
                self.num_workers,
            )

    def summary(self) -> dict[str, float]:
        seconds = max(self.total_train_seconds, 1e-9)
        return {
            "samples_per_s": self.total_samples / seconds,
            "data_wait_fraction": min(1.0, self.total_wait / seconds),
        }


def _duration(seconds: int) -> str:
    hours, rest = divmod(max(0, seconds), 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
