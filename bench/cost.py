"""`python -m bench cost`: a reference job replayed against spot prices and interruptions, per band."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace

# g5.xlarge, Linux, us-east-1, on-demand: https://aws.amazon.com/ec2/pricing/on-demand/ (USD per hour).
ON_DEMAND_USD_PER_HOUR = 1.006
# The AWS Spot Instance Advisor's interruption-frequency bands (https://aws.amazon.com/ec2/spot/instance-advisor/):
# the share of a type's spot instances interrupted over the trailing month. Each band is replayed at its upper
# edge (the pessimistic end); ">20%" at 30%.
BANDS: tuple[tuple[str, float], ...] = (
    ("<5%", 0.05),
    ("5-10%", 0.10),
    ("10-15%", 0.15),
    ("15-20%", 0.20),
    (">20%", 0.30),
)
HOURS_PER_MONTH = 730.0


@dataclass(frozen=True)
class Job:
    """The reference job and the platform's timings (hours unless named otherwise)."""

    work_hours: float = 24.0  # GPU-hours of training on one g5.xlarge-class GPU
    checkpoint_every_hours: float = 0.25  # training/configs/default.yaml: checkpoint.every_minutes 15
    checkpoint_hours: float = 20 / 3600  # save + confirmed upload, training paused
    # A replacement: the group notices the termination, launches, the instance boots the DLAMI, the agent
    # fetches code and data and the trainer restores the checkpoint. Billing starts at launch.
    launch_delay_hours: float = 2 / 60  # interruption -> replacement launched (not billed)
    boot_and_restore_hours: float = 6 / 60  # billed, no training
    notice_hours: float = 2 / 60  # spot interruption notice
    # The agent checkpoints on the notice (bench/RESULTS.md: 2.2 s for 205 MB); False = lose the work since
    # the last periodic checkpoint, as after a crash with no notice.
    emergency_checkpoint: bool = True
    fallback_after_hours: float = 15 / 60  # trainstack:spotFallbackMinutes
    shutdown_hours: float = 0.5 / 60  # after completion: results upload, scale to zero, termination
    on_demand_usd_per_hour: float = ON_DEMAND_USD_PER_HOUR
    spot_fraction: float = 0.30  # mean spot price / on-demand (assumption, see bench/RESULTS.md)
    spot_volatility: float = 0.03  # hourly log-change of the spot price
    spot_band: float = 0.15  # the price stays within ±15% of its mean
    # After an interruption the type's spot pools stay empty for an exponential time of this mean.
    outage_mean_hours: float = 0.5


@dataclass
class Replay:
    """One job's run: what it cost and where the hours went."""

    cost_usd: float = 0.0
    billed_hours: float = 0.0
    on_demand_hours: float = 0.0
    lost_gpu_hours: float = 0.0
    interruptions: int = 0
    lives: int = 0
    billed_after_completion_hours: float = 0.0


class SpotPrices:
    """A seeded spot price series, piecewise constant per hour, mean-reverting within a band."""

    def __init__(self, job: Job, rng: random.Random) -> None:
        self._job = job
        self._rng = rng
        self._prices: list[float] = []

    def at(self, hour: int) -> float:
        job = self._job
        mean = job.on_demand_usd_per_hour * job.spot_fraction
        while len(self._prices) <= hour:
            last = self._prices[-1] if self._prices else mean
            step = last * math.exp(self._rng.gauss(0.0, job.spot_volatility)) if job.spot_volatility else last
            self._prices.append(min(max(step, mean * (1 - job.spot_band)), mean * (1 + job.spot_band)))
        return self._prices[hour]

    def cost(self, start: float, end: float) -> float:
        """USD for one instance from `start` to `end` (hours), per second, as the price changes."""
        total, t = 0.0, start
        while t < end:
            boundary = min(end, math.floor(t) + 1.0)
            total += (boundary - t) * self.at(int(t))
            t = boundary
        return total


def _bill(life_hours: float) -> float:
    # Per-second billing with a 60-second minimum per instance (Linux on-demand and spot).
    return max(life_hours, 60 / 3600)


def replay(job: Job, monthly_rate: float, seed: int) -> Replay:
    """A discrete-event replay: launch, train with periodic checkpoints, interruptions, capacity outages with
    the on-demand fallback, completion and scale to zero."""
    rng = random.Random(seed)
    # Interruptions draw from their own stream: each band sees the same draws, scaled (common random numbers).
    arrivals = random.Random(seed * 7919 + 1)
    prices = SpotPrices(job, random.Random(seed * 104729 + 2))
    rate = monthly_rate / HOURS_PER_MONTH  # interruptions per instance-hour (Poisson)
    result = Replay()
    saved = 0.0  # work in a confirmed checkpoint
    now = 0.0
    on_demand = False
    while saved < job.work_hours - 1e-12:
        start = now
        result.lives += 1
        compute = now + job.boot_and_restore_hours
        done = saved
        interrupt_at = math.inf if on_demand or rate <= 0 else start + arrivals.expovariate(1.0) / rate
        last_checkpoint_work = saved
        finished = False
        while True:
            # Train until the next periodic checkpoint, the end of the job, or the interruption notice.
            to_checkpoint = job.checkpoint_every_hours - (done - last_checkpoint_work)
            step = min(to_checkpoint, job.work_hours - done)
            notice = interrupt_at - job.notice_hours
            if compute + step >= notice:
                done += max(0.0, notice - compute)
                compute = notice
                break
            done += step
            compute += step
            if done >= job.work_hours - 1e-12:
                finished = True
                break
            compute += job.checkpoint_hours
            last_checkpoint_work = done
        if finished:
            end = compute + job.shutdown_hours
            result.billed_after_completion_hours += end - compute
            saved = job.work_hours
        else:
            result.interruptions += 1
            if job.emergency_checkpoint and job.checkpoint_hours <= job.notice_hours:
                saved = done
            else:
                saved = last_checkpoint_work
                result.lost_gpu_hours += done - saved
            end = interrupt_at
        life = end - start
        # Boot and restore, and a notice spent idle, were billed without training.
        result.lost_gpu_hours += 0.0 if result.lives == 1 else job.boot_and_restore_hours
        if not finished:
            result.lost_gpu_hours += max(0.0, end - compute)
        billed = _bill(life)
        result.billed_hours += billed
        if on_demand:
            result.on_demand_hours += billed
            result.cost_usd += billed * job.on_demand_usd_per_hour
        else:
            result.cost_usd += prices.cost(start, start + billed)
        if finished:
            break
        # The replacement: spot pools empty for a while; the fallback launches on-demand after its delay.
        outage = rng.expovariate(1.0 / job.outage_mean_hours) if job.outage_mean_hours > 0 else 0.0
        if outage > job.fallback_after_hours:
            on_demand = True
            now = end + job.fallback_after_hours + job.launch_delay_hours
        else:
            now = end + outage + job.launch_delay_hours
    return result


def on_demand_cost(job: Job) -> float:
    """The same job on demand: one uninterrupted life."""
    return replay(replace(job, spot_fraction=1.0, spot_volatility=0.0), 0.0, 0).cost_usd


@dataclass(frozen=True)
class BandResult:
    band: str
    monthly_rate: float
    runs: int
    ratio_mean: float
    ratio_p95: float
    lost_gpu_hours_mean: float
    interruptions_mean: float
    on_demand_hours_mean: float
    jobs_with_fallback: float  # share of runs that fell back to on-demand
    billed_minutes_after_completion_max: float


def run_band(job: Job, band: str, monthly_rate: float, runs: int, seed: int) -> BandResult:
    reference = on_demand_cost(job)
    replays = [replay(job, monthly_rate, seed + i) for i in range(runs)]
    ratios = sorted(r.cost_usd / reference for r in replays)
    return BandResult(
        band=band,
        monthly_rate=monthly_rate,
        runs=runs,
        ratio_mean=statistics.fmean(ratios),
        ratio_p95=ratios[min(len(ratios) - 1, math.ceil(0.95 * len(ratios)) - 1)],
        lost_gpu_hours_mean=statistics.fmean(r.lost_gpu_hours for r in replays),
        interruptions_mean=statistics.fmean(r.interruptions for r in replays),
        on_demand_hours_mean=statistics.fmean(r.on_demand_hours for r in replays),
        jobs_with_fallback=sum(1 for r in replays if r.on_demand_hours > 0) / runs,
        billed_minutes_after_completion_max=60 * max(r.billed_after_completion_hours for r in replays),
    )


def run_all(job: Job, runs: int, seed: int) -> list[BandResult]:
    return [run_band(job, band, rate, runs, seed) for band, rate in BANDS]


def main(argv: list[str] | None = None) -> None:
    import argparse
    import platform
    from datetime import datetime, timezone

    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(prog="python -m bench cost", description=__doc__)
    parser.add_argument("--runs", type=int, default=2000, help="seeded replays per band (default 2000)")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--spot-fraction", type=float, default=Job.spot_fraction, help="mean spot/on-demand")
    parser.add_argument(
        "--no-emergency-checkpoint",
        action="store_true",
        help="lose the work since the last periodic checkpoint at each interruption",
    )
    args = parser.parse_args(argv)
    job = Job(spot_fraction=args.spot_fraction, emergency_checkpoint=not args.no_emergency_checkpoint)
    console = Console(width=150)
    console.print(
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  {platform.processor() or platform.machine()}  "
        f"python {platform.python_version()}"
    )
    console.print(
        f"{job.work_hours:g} GPU-h on g5.xlarge (on-demand ${job.on_demand_usd_per_hour}/h = "
        f"${on_demand_cost(job):.2f} for the job), spot at {job.spot_fraction:.0%} of on-demand on average, "
        f"checkpoint every {job.checkpoint_every_hours * 60:g} min, fallback after "
        f"{job.fallback_after_hours * 60:g} min, emergency checkpoint "
        f"{'on' if job.emergency_checkpoint else 'off'}, "
        f"{args.runs} replays per band, seed {args.seed}"
    )
    table = Table(title="cost replay: the job on spot vs the same job on demand")
    for column in (
        "band (monthly)", "cost / on-demand", "p95", "interruptions", "GPU-h lost", "on-demand h",
        "runs fell back", "min billed after completion",
    ):  # fmt: skip
        table.add_column(column, justify="left" if column.startswith("band") else "right")
    for r in run_all(job, args.runs, args.seed):
        table.add_row(
            r.band,
            f"{r.ratio_mean:.3f}",
            f"{r.ratio_p95:.3f}",
            f"{r.interruptions_mean:.3f}",
            f"{r.lost_gpu_hours_mean:.4f}",
            f"{r.on_demand_hours_mean:.3f}",
            f"{r.jobs_with_fallback:.1%}",
            f"{r.billed_minutes_after_completion_max:.1f}",
        )
    console.print(table)
