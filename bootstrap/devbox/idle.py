"""Is anybody using the dev box? Samples in, idle time and the decision to stop out: pure, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# Above this mean GPU utilisation the box is working (a training run left going in tmux counts as use);
# below, a GPU that only holds memory for an idle notebook does not keep the box billing.
GPU_BUSY_PERCENT = 5.0
SAMPLE_SECONDS = 30.0


@dataclass(frozen=True)
class Sample:
    """What the watcher saw at one moment (`at`: seconds on any one clock). `gpu_percent` None: no GPU
    visible to NVML, which counts as idle."""

    at: float
    ssm_sessions: int = 0
    ssh_sessions: int = 0
    busy_kernels: int = 0
    gpu_percent: float | None = None

    def busy(self, gpu_busy_percent: float = GPU_BUSY_PERCENT) -> list[str]:
        """Why the box is in use at this sample; empty = idle."""
        reasons = []
        if self.ssm_sessions:
            reasons.append(f"{self.ssm_sessions} Session Manager session(s)")
        if self.ssh_sessions:
            reasons.append(f"{self.ssh_sessions} SSH session(s)")
        if self.busy_kernels:
            reasons.append(f"{self.busy_kernels} Jupyter kernel(s) busy")
        if self.gpu_percent is not None and self.gpu_percent > gpu_busy_percent:
            reasons.append(f"GPU {self.gpu_percent:.0f}% busy")
        return reasons


@dataclass(frozen=True)
class Verdict:
    """`idle_seconds` since the last busy sample (or the first sample); `stop`: the limit is reached."""

    idle_seconds: float
    busy: list[str]
    stop: bool


def decide(
    samples: Sequence[Sample], limit_minutes: int, gpu_busy_percent: float = GPU_BUSY_PERCENT
) -> Verdict:
    """The verdict at the last sample. Idleness is counted from the first sample when nothing was ever
    busy: a box started and never used stops too. `limit_minutes` 0 = never stop."""
    if not samples:
        return Verdict(0.0, [], False)
    last = samples[-1]
    busy_now = last.busy(gpu_busy_percent)
    if busy_now:
        return Verdict(0.0, busy_now, False)
    idle_since = samples[0].at
    for sample in reversed(samples[:-1]):
        if sample.busy(gpu_busy_percent):
            # Idle from the moment after that sample: the use may have gone on until just before the next.
            idle_since = sample.at
            break
    idle = max(0.0, last.at - idle_since)
    return Verdict(idle, [], limit_minutes > 0 and idle >= limit_minutes * 60)


class IdleDetector:
    """`decide` over a running box's samples, keeping only what the verdict needs (the first sample and the
    last busy one), so a box up for weeks holds two samples, not thousands."""

    def __init__(self, limit_minutes: int, gpu_busy_percent: float = GPU_BUSY_PERCENT) -> None:
        self.limit_minutes = limit_minutes
        self._gpu_busy_percent = gpu_busy_percent
        self._kept: list[Sample] = []

    def observe(self, sample: Sample) -> Verdict:
        self._kept.append(sample)
        verdict = decide(self._kept, self.limit_minutes, self._gpu_busy_percent)
        # The latest sample stands for everything before it: if busy it restarts the count, if idle the
        # count runs from the earliest kept sample, which stays.
        self._kept = [sample] if verdict.busy else [*self._kept[:1], sample]
        return verdict
