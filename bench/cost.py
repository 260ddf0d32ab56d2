"""`python -m bench cost`: a reference job replayed against spot prices and interruptions, per band.

By default the spot price is a seeded series around an assumed 0.30 x on-demand. With `--trace FILE` it is a
real spot price history instead: the JSON `aws ec2 describe-spot-price-history` prints, e.g.

    aws ec2 describe-spot-price-history --region us-east-1 --instance-types g5.xlarge \
        --product-descriptions Linux/UNIX --availability-zone us-east-1a \
        --start-time "$(date -u -d '90 days ago' +%FT%TZ)" --output json \
        > bench/traces/g5.xlarge-us-east-1a.json

Each replay starts at a seeded point of the trace (wrapping past its end) and pays the price in effect each
second; interruptions, replacements and the on-demand fallback are replayed as before, and the report gives
the p50 and p95 cost per finished job against the same job on demand.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

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


class Prices(Protocol):
    def cost(self, start: float, end: float) -> float: ...


class TraceError(ValueError):
    """A trace file that cannot be replayed: the message names the file and the fix."""


@dataclass(frozen=True)
class PriceTrace:
    """One type's spot price history in one AZ: a step function of hours since the trace's first point."""

    instance_type: str
    zone: str
    hours: tuple[float, ...]  # when each price took effect, the first at 0
    prices: tuple[float, ...]  # USD per hour
    span_hours: float  # from the first point to the last (the trace wraps after it)
    source: str

    @classmethod
    def from_history(
        cls,
        document: Mapping[str, Any],
        *,
        source: str,
        instance_type: str | None = None,
        zone: str | None = None,
    ) -> PriceTrace:
        """From DescribeSpotPriceHistory's answer ({"SpotPriceHistory": [...]}); by default the type and AZ
        with the most points."""
        entries = document.get("SpotPriceHistory")
        if not isinstance(entries, list) or not entries:
            raise TraceError(
                f"{source}: no SpotPriceHistory entries; write the file with "
                "`aws ec2 describe-spot-price-history ... --output json`"
            )
        series: dict[tuple[str, str], list[tuple[datetime, float]]] = {}
        for entry in entries:
            when = entry["Timestamp"]
            stamp = (
                when
                if isinstance(when, datetime)
                else datetime.fromisoformat(str(when).replace("Z", "+00:00"))
            )
            key = (str(entry["InstanceType"]), str(entry["AvailabilityZone"]))
            series.setdefault(key, []).append((stamp, float(entry["SpotPrice"])))
        wanted = [k for k in series if (instance_type in (None, k[0])) and (zone in (None, k[1]))]
        if not wanted:
            raise TraceError(f"{source}: no prices for {instance_type or 'any type'} in {zone or 'any AZ'}")
        key = max(wanted, key=lambda k: (len(series[k]), k))
        points = sorted(series[key])
        start = points[0][0]
        hours = tuple((t - start).total_seconds() / 3600 for t, _ in points)
        # One point has no length of its own: it is a constant price.
        span = max(hours[-1], 1.0)
        return cls(key[0], key[1], hours, tuple(p for _, p in points), span, source)

    @classmethod
    def load(cls, path: Path, *, instance_type: str | None = None, zone: str | None = None) -> PriceTrace:
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise TraceError(f"{path}: not a readable JSON spot price history ({error})") from error
        if not isinstance(document, dict):
            raise TraceError(f"{path}: expected DescribeSpotPriceHistory's JSON object")
        cited = document.get("Source")
        source = f"{path} ({cited})" if cited else str(path)
        return cls.from_history(document, source=source, instance_type=instance_type, zone=zone)

    def price_at(self, hour: float) -> float:
        """The price in effect `hour` hours after the first point, wrapping after the span."""
        t = hour % self.span_hours
        low, high = 0, len(self.hours) - 1
        while low < high:  # the last point at or before t
            middle = (low + high + 1) // 2
            if self.hours[middle] <= t:
                low = middle
            else:
                high = middle - 1
        return self.prices[low]

    def mean(self) -> float:
        """The time-weighted mean price over the span."""
        return TracePrices(self, 0.0).cost(0.0, self.span_hours) / self.span_hours


class TracePrices:
    """A trace replayed from `offset` hours into it: the Prices a replay pays."""

    def __init__(self, trace: PriceTrace, offset: float) -> None:
        self._trace = trace
        self._offset = offset
        # Every change of price within one pass of the trace, and its end (where it wraps).
        self._edges = (*trace.hours[1:], trace.span_hours)

    def cost(self, start: float, end: float) -> float:
        total, t = 0.0, start
        span = self._trace.span_hours
        while t < end - 1e-12:
            position = (self._offset + t) % span
            boundary = next((edge for edge in self._edges if edge > position + 1e-12), span)
            step = min(end - t, boundary - position)
            total += step * self._trace.price_at(position)
            t += step
        return total


def _bill(life_hours: float) -> float:
    # Per-second billing with a 60-second minimum per instance (Linux on-demand and spot).
    return max(life_hours, 60 / 3600)


def replay(job: Job, monthly_rate: float, seed: int, trace: PriceTrace | None = None) -> Replay:
    """A discrete-event replay: launch, train with periodic checkpoints, interruptions, capacity outages with
    the on-demand fallback, completion and scale to zero. With `trace`, spot pays the trace's prices from a
    seeded starting point; else the seeded series."""
    rng = random.Random(seed)
    # Interruptions draw from their own stream: each band sees the same draws, scaled (common random numbers).
    arrivals = random.Random(seed * 7919 + 1)
    prices: Prices
    if trace is None:
        prices = SpotPrices(job, random.Random(seed * 104729 + 2))
    else:
        prices = TracePrices(trace, random.Random(seed * 104729 + 3).uniform(0.0, trace.span_hours))
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


def percentile(ordered: Sequence[float], q: float) -> float:
    """Nearest rank, as run_band's p95."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


@dataclass(frozen=True)
class TraceResult:
    """The job replayed over a real price trace at one interruption band: cost per finished job."""

    band: str
    monthly_rate: float
    runs: int
    on_demand_usd: float
    p50_usd: float
    p95_usd: float
    interruptions_mean: float
    jobs_with_fallback: float

    @property
    def p50_ratio(self) -> float:
        return self.p50_usd / self.on_demand_usd

    @property
    def p95_ratio(self) -> float:
        return self.p95_usd / self.on_demand_usd


def run_trace(
    job: Job, trace: PriceTrace, band: str, monthly_rate: float, runs: int, seed: int
) -> TraceResult:
    replays = [replay(job, monthly_rate, seed + i, trace) for i in range(runs)]
    costs = sorted(r.cost_usd for r in replays)
    return TraceResult(
        band=band,
        monthly_rate=monthly_rate,
        runs=runs,
        on_demand_usd=on_demand_cost(job),
        p50_usd=percentile(costs, 0.50),
        p95_usd=percentile(costs, 0.95),
        interruptions_mean=statistics.fmean(r.interruptions for r in replays),
        jobs_with_fallback=sum(1 for r in replays if r.on_demand_hours > 0) / runs,
    )


def _print_trace(console: Any, job: Job, trace: PriceTrace, runs: int, seed: int) -> None:
    from rich.table import Table

    console.print(
        f"spot prices: {trace.instance_type} in {trace.zone}, {len(trace.prices)} price changes over "
        f"{trace.span_hours / 24:.1f} days, mean ${trace.mean():.4f}/h "
        f"({trace.mean() / job.on_demand_usd_per_hour:.0%} of on-demand); source: {trace.source}"
    )
    table = Table(title="cost replay over a real spot price trace: cost per finished job")
    for column in ("band (monthly)", "on-demand", "p50", "p95", "p50 / on-demand", "p95 / on-demand",
                   "interruptions", "runs fell back"):  # fmt: skip
        table.add_column(column, justify="left" if column.startswith("band") else "right")
    for band, rate in BANDS:
        r = run_trace(job, trace, band, rate, runs, seed)
        table.add_row(
            r.band,
            f"${r.on_demand_usd:.2f}",
            f"${r.p50_usd:.2f}",
            f"${r.p95_usd:.2f}",
            f"{r.p50_ratio:.3f}",
            f"{r.p95_ratio:.3f}",
            f"{r.interruptions_mean:.3f}",
            f"{r.jobs_with_fallback:.1%}",
        )
    console.print(table)


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
    parser.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="replay over this spot price history (`aws ec2 describe-spot-price-history --output json`)",
    )
    parser.add_argument(
        "--on-demand", type=float, default=ON_DEMAND_USD_PER_HOUR, help="the trace type's on-demand USD/h"
    )
    args = parser.parse_args(argv)
    job = Job(
        spot_fraction=args.spot_fraction,
        emergency_checkpoint=not args.no_emergency_checkpoint,
        on_demand_usd_per_hour=args.on_demand,
    )
    console = Console(width=150)
    if args.trace is not None:
        try:
            trace = PriceTrace.load(args.trace)
        except TraceError as error:
            parser.error(str(error))
        _print_trace(console, job, trace, args.runs, args.seed)
        return
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
