"""`checkpoint.every_minutes: auto`: the time-based checkpoint interval by the Young/Daly rule.

Checkpointing every T costs C/T of the run; an interruption with no usable notice loses T/2 on average, once
per MTBI. The sum is smallest at T = sqrt(2 × C × MTBI) (Young 1974; Daly 2006 refines it by terms negligible
while C ≪ MTBI). C is what a checkpoint blocks the training loop for, measured at each save; the agent uploads
in the background, so the upload does not stall training and does not count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from trainstack_job.contract import JobEnv

MIN_MINUTES = 2.0
MAX_MINUTES = 60.0
HOURS_PER_MONTH = 730.0
# Until the first save is measured: a few hundred MB written to local NVMe, generously.
ASSUMED_CHECKPOINT_SECONDS = 30.0
# The Spot Instance Advisor (https://aws.amazon.com/ec2/spot/instance-advisor/) publishes, per type and
# region, the share of spot instances interrupted over the last month in bands (<5%, 5-10%, 10-15%, 15-20%,
# >20%). Without the ledger's own history the rule assumes the 5-10% band's midpoint: an interruption per
# 9 733 instance-hours.
DEFAULT_BAND = (0.05, 0.10)


@dataclass(frozen=True)
class InterruptionRate:
    """Mean time between interruptions, and where the figure comes from (for the log line)."""

    mtbi_hours: float
    source: str

    @classmethod
    def from_band(cls, low: float, high: float) -> InterruptionRate:
        monthly = (low + high) / 2
        return cls(
            HOURS_PER_MONTH / monthly,
            f"the published {100 * low:g}-{100 * high:g}%/month interruption band (Spot Instance Advisor)",
        )

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> InterruptionRate:
        """The agent's figure from the ledger (TRAINSTACK_MTBI_HOURS/_SOURCE), else the default band."""
        raw = environ.get(JobEnv.MTBI_HOURS.value, "")
        try:
            hours = float(raw)
        except ValueError:
            hours = math.nan
        if not math.isfinite(hours) or hours <= 0:
            return cls.from_band(*DEFAULT_BAND)
        return cls(hours, environ.get(JobEnv.MTBI_SOURCE.value) or "the agent's ledger")


@dataclass(frozen=True)
class CheckpointInterval:
    minutes: float
    checkpoint_seconds: float
    rate: InterruptionRate
    bound: str | None  # "floor" or "ceiling" when the rule's value was clamped

    def describe(self) -> str:
        clamp = f", held at the {self.bound}" if self.bound else ""
        return (
            f"checkpoint interval {self.minutes:.1f} min (Young/Daly: C={self.checkpoint_seconds:.1f} s, "
            f"MTBI={self.rate.mtbi_hours:.1f} h from {self.rate.source}{clamp})"
        )


def young_daly_seconds(checkpoint_seconds: float, mtbi_hours: float) -> float:
    """T = sqrt(2 × C × MTBI), unbounded."""
    return math.sqrt(2 * max(0.0, checkpoint_seconds) * mtbi_hours * 3600)


def choose_interval(checkpoint_seconds: float, rate: InterruptionRate) -> CheckpointInterval:
    """The rule's interval within [MIN_MINUTES, MAX_MINUTES]."""
    minutes = young_daly_seconds(checkpoint_seconds, rate.mtbi_hours) / 60
    bound = "floor" if minutes < MIN_MINUTES else "ceiling" if minutes > MAX_MINUTES else None
    clamped = min(max(minutes, MIN_MINUTES), MAX_MINUTES)
    return CheckpointInterval(clamped, max(0.0, checkpoint_seconds), rate, bound)
