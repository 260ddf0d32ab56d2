"""`trainstack estimate`: the configured job's cost per instance type, spot and on-demand, beside the cap, and
the pool's types ranked by expected dollars per 1,000 useful steps.

The ranking: a type's spot price per hour over the steps it makes per hour, less what interruptions waste.
With checkpoints every tau (the trainer's Young/Daly interval, tau = sqrt(2 x C x MTBI) within its bounds,
training/checkpoint_policy.py), a fraction C/tau of the time goes to checkpoints, and each interruption (one
per MTBI) loses tau/2 of work on average plus the restart. So the useful share is
1 - C/tau - (tau/2 + restart)/MTBI, and $ per 1,000 useful steps = price/h / (steps/h x useful share) x 1000.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from rich.table import Table

from training.checkpoint_policy import (
    ASSUMED_CHECKPOINT_SECONDS,
    DEFAULT_BAND,
    InterruptionRate,
    choose_interval,
)
from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.output import console, format_usd, print_json
from trainstack.prices import Risk, SpotPrice, gather
from trainstack.stack import NAMESPACE, Stack
from trainstack_job.contract import JobEnv
from trainstack_job.resources import ResourceError, match_pool, pool_offers
from trainstack_job.throughput import DROP_MARGIN, expected_throughput

if TYPE_CHECKING:
    from trainstack.stack import StackConfig

# An interruption's restart, billed or waited for without training: bench/cost.py's launch delay (2 min) and
# boot and restore (6 min).
RESTART_SECONDS = 8 * 60.0
# The unit when the throughput module has only its shipped estimates: speeds relative to a T4, so the ranking
# prices the work a T4 does in 1,000 seconds.
SHIPPED_UNIT = "T4-seconds of work"

HOURS_KEY = f"{NAMESPACE}:expectedHours"
CAP_KEY = f"{NAMESPACE}:maxCostUsd"


@dataclass(frozen=True)
class TypeCost:
    """One instance type: its hourly prices now and the whole job at those prices."""

    instance_type: str
    spot_usd_per_hour: float | None  # the cheapest AZ's price in effect now
    on_demand_usd_per_hour: float | None
    spot_job_usd: float | None
    on_demand_job_usd: float | None


@dataclass(frozen=True)
class Progress:
    """One type ranked: the inputs, the checkpoint interval they imply, and the expected $ per 1,000 steps."""

    instance_type: str
    usd_per_hour: float
    steps_per_second: float
    mtbi_hours: float
    mtbi_source: str
    checkpoint_seconds: float
    restart_seconds: float
    checkpoint_every_minutes: float
    waste: float  # share of the paid time that makes no lasting progress
    useful_steps_per_hour: float
    usd_per_1000_steps: float | None  # None: interruptions waste everything (the type can never finish)
    throughput_source: str = ""


def progress_of(
    instance_type: str,
    usd_per_hour: float,
    steps_per_second: float,
    rate: InterruptionRate,
    *,
    checkpoint_seconds: float,
    restart_seconds: float,
) -> Progress:
    interval = choose_interval(checkpoint_seconds, rate)
    tau = interval.minutes * 60
    mtbi = rate.mtbi_hours * 3600
    waste = min(1.0, checkpoint_seconds / tau + (tau / 2 + restart_seconds) / mtbi)
    useful = steps_per_second * 3600 * (1 - waste)
    return Progress(
        instance_type=instance_type,
        usd_per_hour=usd_per_hour,
        steps_per_second=steps_per_second,
        mtbi_hours=rate.mtbi_hours,
        mtbi_source=rate.source,
        checkpoint_seconds=checkpoint_seconds,
        restart_seconds=restart_seconds,
        checkpoint_every_minutes=interval.minutes,
        waste=waste,
        useful_steps_per_hour=useful,
        usd_per_1000_steps=usd_per_hour / useful * 1000 if useful > 0 else None,
    )


def rank_by_progress(
    usd_per_hour: Mapping[str, float],
    steps_per_second: Mapping[str, float],
    rates: Mapping[str, InterruptionRate],
    *,
    checkpoint_seconds: float = ASSUMED_CHECKPOINT_SECONDS,
    restart_seconds: float = RESTART_SECONDS,
    throughput_sources: Mapping[str, str] | None = None,
) -> list[Progress]:
    """The types with both a price and a throughput, cheapest per 1,000 useful steps first. A type without a
    rate of its own gets the checkpoint rule's default band."""
    default = InterruptionRate.from_band(*DEFAULT_BAND)
    sources = throughput_sources or {}
    ranked = [
        replace(
            progress_of(
                name,
                usd_per_hour[name],
                steps_per_second[name],
                rates.get(name, default),
                checkpoint_seconds=checkpoint_seconds,
                restart_seconds=restart_seconds,
            ),
            throughput_source=sources.get(name, ""),
        )
        for name in usd_per_hour
        if steps_per_second.get(name, 0.0) > 0
    ]
    ranked.sort(key=lambda p: (p.usd_per_1000_steps is None, p.usd_per_1000_steps or 0.0, p.instance_type))
    return ranked


@dataclass(frozen=True)
class RankingInputs:
    """What the CLI gathered for the ranking: throughput per type (steps/s unless `unit` says samples), the
    interruption rate overriding every type's (a measured MTBI), the checkpoint and restart costs."""

    @classmethod
    def from_flags(
        cls,
        types: Sequence[str],
        *,
        throughput: Sequence[str],
        samples_per_step: float | None,
        mtbi_hours: float | None,
        checkpoint_seconds: float | None,
        restart_seconds: float | None,
        family: str | None = None,
    ) -> RankingInputs:
        """--throughput figures (steps/s) when given, else the throughput module's samples/s, per step when
        --samples-per-step says how many samples a step takes."""
        if samples_per_step is not None and not (math.isfinite(samples_per_step) and samples_per_step > 0):
            raise CliError(f"--samples-per-step {samples_per_step:g}: give a positive number of samples")
        for flag, value in (
            ("--checkpoint-seconds", checkpoint_seconds),
            ("--restart-seconds", restart_seconds),
        ):
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise CliError(f"{flag} {value:g}: give a number of seconds, 0 or more")
        rates, unit = parse_throughput(throughput), "steps"
        sources = dict.fromkeys(rates, "--throughput")
        if not rates:
            found = throughput_from_helper(types, family)
            rates = {name: value for name, (value, _) in found.items()}
            sources = {name: source for name, (_, source) in found.items()}
            if rates and all(source.startswith("shipped") for source in sources.values()):
                # Relative speeds (a T4 = 1), not samples/s: $ per 1,000 T4-seconds of work still ranks.
                unit = SHIPPED_UNIT
            elif samples_per_step:
                rates = {name: value / samples_per_step for name, value in rates.items()}
            else:
                unit = "samples"
        return cls(
            steps_per_second=rates,
            throughput_sources=sources,
            unit=unit,
            mtbi=measured_mtbi(mtbi_hours),
            checkpoint_seconds=ASSUMED_CHECKPOINT_SECONDS
            if checkpoint_seconds is None
            else checkpoint_seconds,
            restart_seconds=RESTART_SECONDS if restart_seconds is None else restart_seconds,
        )

    steps_per_second: Mapping[str, float] = field(default_factory=dict)
    throughput_sources: Mapping[str, str] = field(default_factory=dict)
    unit: str = "steps"
    mtbi: InterruptionRate | None = None
    checkpoint_seconds: float = ASSUMED_CHECKPOINT_SECONDS
    restart_seconds: float = RESTART_SECONDS


@dataclass(frozen=True)
class Estimate:
    stack: str
    region: str
    instance_count: int
    expected_hours: float | None
    max_cost_usd: float | None
    types: list[TypeCost]
    notes: list[str]
    price_source: str = ""
    ranking: list[Progress] = field(default_factory=list)
    unit: str = "steps"

    def cheapest(self) -> TypeCost | None:
        priced = [t for t in self.types if t.spot_job_usd is not None]
        return min(priced, key=lambda t: t.spot_job_usd or 0.0) if priced else None

    def most_expensive(self) -> TypeCost | None:
        """The dearest type at its dearest purchase option (on-demand: what the capacity fallback pays)."""
        priced = [t for t in self.types if _dearest(t) is not None]
        return max(priced, key=lambda t: _dearest(t) or 0.0) if priced else None


def _dearest(cost: TypeCost) -> float | None:
    known = [c for c in (cost.spot_job_usd, cost.on_demand_job_usd) if c is not None]
    return max(known) if known else None


def project(
    rows: Sequence[SpotPrice], types: Sequence[str], instance_count: int, hours: float | None
) -> list[TypeCost]:
    """Instance count × expected hours × the price per type; the cheapest AZ for spot (the group's strategy
    picks across AZs). No hours: prices only."""
    costs = []
    for instance_type in types:
        own = [r for r in rows if r.instance_type == instance_type]
        spot = min((r.spot_usd_per_hour for r in own), default=None)
        on_demand = next((r.on_demand_usd_per_hour for r in own if r.on_demand_usd_per_hour), None)
        costs.append(
            TypeCost(
                instance_type=instance_type,
                spot_usd_per_hour=spot,
                on_demand_usd_per_hour=on_demand,
                spot_job_usd=_job(spot, instance_count, hours),
                on_demand_job_usd=_job(on_demand, instance_count, hours),
            )
        )
    return costs


def _job(price: float | None, instance_count: int, hours: float | None) -> float | None:
    if price is None or hours is None:
        return None
    return price * instance_count * hours


def build(
    clients: Clients,
    stack: Stack,
    *,
    hours: float | None,
    offline: bool = False,
    scores: bool = False,
    ranking: RankingInputs | None = None,
    job: JobAsked | None = None,
) -> Estimate:
    config = stack.config
    region = clients.region or config.region
    if not region:
        raise CliError("no AWS region: `pulumi config set aws:region us-east-1`, or pass --region")
    # Read through the program's schema (trainstack/stack.py): the cap is the one the agent enforces.
    expected_hours = config.expected_hours if hours is None else hours
    max_cost = config.max_cost_usd
    types = list(job.types if job else config.instance_types)
    instances = job.instances if job else config.instance_count
    found = gather(clients, types, region, days=1, offline=offline, scores=scores, capacity=instances)
    notes = found.notes
    if expected_hours is None:
        notes.append(
            f"no job length: set {HOURS_KEY} (e.g. `pulumi config set {HOURS_KEY} 24`) or pass --hours"
        )
    costs = project(found.rows, types, instances, expected_hours)
    inputs = ranking or RankingInputs()
    spot = {c.instance_type: c.spot_usd_per_hour for c in costs if c.spot_usd_per_hour is not None}
    ranked = rank_by_progress(
        spot,
        inputs.steps_per_second,
        _rates(types, found.risks, inputs.mtbi),
        checkpoint_seconds=inputs.checkpoint_seconds,
        restart_seconds=inputs.restart_seconds,
        throughput_sources=inputs.throughput_sources,
    )
    unranked = [t for t in types if t not in {p.instance_type for p in ranked}]
    if unranked:
        notes.append(
            f"not ranked by progress: {', '.join(unranked)} (no spot price or no throughput: "
            "pass --throughput TYPE=STEPS_PER_SECOND)"
        )
    return Estimate(
        stack=stack.name,
        region=region,
        instance_count=config.instance_count,
        expected_hours=expected_hours,
        max_cost_usd=max_cost,
        types=costs,
        notes=notes,
        price_source=found.source,
        ranking=ranked,
        unit=inputs.unit,
    )


def _rates(
    types: Sequence[str], risks: Mapping[str, Risk], measured: InterruptionRate | None
) -> dict[str, InterruptionRate]:
    """Per type: a measured MTBI for all, else the type's band (placement score or catalogue)."""
    if measured is not None:
        return dict.fromkeys(types, measured)
    rates = {}
    for name, risk in risks.items():
        rate = InterruptionRate.from_band(*risk.band)
        rates[name] = InterruptionRate(rate.mtbi_hours, risk.source)
    return rates


def measured_mtbi(hours: float | None, environ: Mapping[str, str] | None = None) -> InterruptionRate | None:
    """--mtbi-hours, else the stack's measured MTBI in TRAINSTACK_MTBI_HOURS (the agent's ledger figure)."""
    if hours is not None:
        if not (math.isfinite(hours) and hours > 0):
            raise CliError(f"--mtbi-hours {hours:g}: give a positive number of hours between interruptions")
        return InterruptionRate(hours, "--mtbi-hours")
    env = os.environ if environ is None else environ
    if env.get(JobEnv.MTBI_HOURS.value):
        rate = InterruptionRate.from_env(env)
        return InterruptionRate(rate.mtbi_hours, f"{JobEnv.MTBI_HOURS.value} ({rate.source})")
    return None


def parse_throughput(values: Sequence[str]) -> dict[str, float]:
    """`TYPE=STEPS_PER_SECOND` flags -> {type: steps/s}; one line naming the bad flag otherwise."""
    found = {}
    for value in values:
        name, _, number = value.partition("=")
        try:
            rate = float(number)
        except ValueError:
            rate = math.nan
        if not name or not (math.isfinite(rate) and rate > 0):
            raise CliError(
                f"--throughput {value!r}: expected TYPE=STEPS_PER_SECOND, e.g. --throughput g6.xlarge=4.2"
            )
        found[name] = rate
    return found


@dataclass(frozen=True)
class JobAsked:
    """What `trainstack estimate JOB` reads from a job file or training config: the pool it would run on
    (as `trainstack run` chooses it), its instances, its model family and its samples per step."""

    source: str
    pool: str
    types: tuple[str, ...]
    instances: int
    family: str | None = None
    samples_per_step: float | None = None


def read_job(path: Path, config: StackConfig) -> JobAsked:
    """The job as `trainstack run` reads it (a job file: a mapping with `command`; else a training config),
    validated the same way, and the pool of this stack's config that serves what it asks for."""
    from trainstack.run import RunRequest, load_definition, type_offer

    file = path / "job.yaml" if path.is_dir() else path
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise CliError(
            f"{path}: not a readable YAML job file or training config ({exc}); e.g. job.yaml"
        ) from None
    is_job = isinstance(raw, dict) and "command" in raw
    definition = load_definition(RunRequest(job_file=path) if is_job else RunRequest(config_file=path))
    # The pools as `pulumi up` declares them (trainstack:pools, else the single group's keys).
    pools = (
        {
            pool.name: {"instance_types": list(pool.instance_types), "max_instances": pool.max_instances}
            | {"default": pool.default}
            for pool in config.settings.pools
        }
        if config.settings is not None
        else {
            "default": {"instance_types": list(config.instance_types), "max_instances": config.instance_count}
        }
    )
    offers = pool_offers(pools, type_offer)
    asked = definition.resources
    instances = 1 if definition.user_job is not None else asked.instances or config.instance_count
    try:
        pool = match_pool(asked, offers, instances=instances, where=str(path))
    except ResourceError as error:
        raise CliError(str(error)) from None
    trainer = definition.trainer_config or {}
    model, train = trainer.get("model"), trainer.get("train")
    family = model.get("name") if isinstance(model, dict) else None
    batch = train.get("batch_size") if isinstance(train, dict) else None
    return JobAsked(
        source=str(path),
        pool=pool.name,
        types=tuple(t.instance_type for t in pool.types),
        instances=instances,
        family=family if isinstance(family, str) else None,
        samples_per_step=float(batch) if isinstance(batch, (int, float)) and batch > 0 else None,
    )


def throughput_from_helper(types: Sequence[str], family: str | None = None) -> dict[str, tuple[float, str]]:
    """trainstack_job/throughput.py's expected throughput per type (for the job's model family, when a job
    file names one) and its source. The estimate reads no stack outputs, so no measured table: these are its
    shipped estimates (relative to a T4)."""
    found: dict[str, tuple[float, str]] = {}
    for name in types:
        expected = expected_throughput(name, family=family)
        if expected is not None and expected.samples_per_second > 0:
            found[name] = (expected.samples_per_second, expected.source)
    return found


def behind(ranking: Sequence[Progress], margin: float = DROP_MARGIN) -> list[str]:
    """A line for each ranked type whose expected $ per useful step is more than `margin` above the best's:
    a type this job gains nothing from. The pool's group cannot leave it out for one job (its weights
    already make AWS compare price per unit of training); the line says what the user can do."""
    priced = [p for p in ranking if p.usd_per_1000_steps is not None]
    if not priced:
        return []
    best = priced[0]
    best_cost = best.usd_per_1000_steps or 0.0
    return [
        f"{p.instance_type}: {(p.usd_per_1000_steps or 0.0) / best_cost - 1:.0%} dearer per useful step "
        f"than {best.instance_type} (past the {margin:.0%} margin): this job gains nothing from it; run the "
        "job on a pool without it (`trainstack run --pool`), or remove it from the pool (`pulumi config`)"
        for p in priced[1:]
        if best_cost > 0 and (p.usd_per_1000_steps or 0.0) > best_cost * (1 + margin)
    ] + [
        f"{p.instance_type}: interruptions waste all its time at this rate: this job gains nothing from it"
        for p in ranking
        if p.usd_per_1000_steps is None
    ]


def verdict(estimate: Estimate) -> list[str]:
    """The lines under the table: the range, and where it stands against maxCostUsd."""
    cheapest, dearest = estimate.cheapest(), estimate.most_expensive()
    lines = []
    if cheapest is not None and dearest is not None:
        lines.append(
            f"cheapest: {cheapest.instance_type} on spot, {format_usd(cheapest.spot_job_usd)}; "
            f"most expensive: {dearest.instance_type} {_option(dearest)}, {format_usd(_dearest(dearest))}"
        )
        lines.append(
            "spot figures assume no interruption and today's prices "
            "(`python -m bench cost` replays interruptions)"
        )
    cap = estimate.max_cost_usd
    if cap is None:
        lines.append(f"{CAP_KEY}: not set (no cost cap)")
    elif cheapest is not None and dearest is not None:
        over = [t.instance_type for t in estimate.types if (_dearest(t) or 0.0) > cap]
        if (cheapest.spot_job_usd or 0.0) > cap:
            lines.append(
                f"{CAP_KEY} {format_usd(cap)}: even the cheapest type exceeds it; the job stops at the cap"
            )
        elif over:
            lines.append(
                f"{CAP_KEY} {format_usd(cap)}: {', '.join(over)} could exceed it (on-demand or a dear spot "
                "price); the job stops at the cap"
            )
        else:
            lines.append(f"{CAP_KEY} {format_usd(cap)}: every type fits, spot or on-demand")
    else:
        lines.append(f"{CAP_KEY} {format_usd(cap)}")
    return lines


def _option(cost: TypeCost) -> str:
    if cost.on_demand_job_usd is not None and cost.on_demand_job_usd >= (cost.spot_job_usd or 0.0):
        return "on demand"
    return "on spot"


def markdown(estimate: Estimate) -> str:
    """The pull-request comment: the same figures as a Markdown table."""
    hours = "?" if estimate.expected_hours is None else f"{estimate.expected_hours:g}"
    lines = [
        f"### trainstack estimate: `{estimate.stack}`, {estimate.region}, "
        f"{estimate.instance_count} instance(s) × {hours} h",
        "",
        f"prices: {estimate.price_source}",
        "",
        "| type | spot now (cheapest AZ) | on-demand | job on spot | job on demand |",
        "|---|---:|---:|---:|---:|",
    ]
    for t in estimate.types:
        lines.append(
            f"| {t.instance_type} | {format_usd(t.spot_usd_per_hour, 4)}/h | "
            f"{format_usd(t.on_demand_usd_per_hour, 4)}/h | {format_usd(t.spot_job_usd)} | "
            f"{format_usd(t.on_demand_job_usd)} |"
        )
    lines.append("")
    lines += _ranking_markdown(estimate)
    lines += [f"- {line}" for line in [*verdict(estimate), *(f"note: {n}" for n in estimate.notes)]]
    return "\n".join(lines) + "\n"


def _per_1000(p: Progress) -> str:
    return "never finishes" if p.usd_per_1000_steps is None else format_usd(p.usd_per_1000_steps, 4)


def ranking_heading(estimate: Estimate) -> str:
    return (
        f"ranked by expected $ per 1,000 useful {estimate.unit} on spot ({estimate.price_source}): "
        "price/h / (throughput x (1 - C/tau - (tau/2 + restart)/MTBI)), tau = Young/Daly interval"
    )


def _rate_column(unit: str) -> str:
    return "speed (T4 = 1)" if unit == SHIPPED_UNIT else f"{unit}/s"


def _cost_column(unit: str) -> str:
    return "$ / 1k T4-s" if unit == SHIPPED_UNIT else f"$ / 1k {unit}"


def _throughput_lines(estimate: Estimate) -> list[str]:
    """Where each type's throughput came from, once per distinct source."""
    sources = [f"{p.instance_type}: {p.throughput_source}" for p in estimate.ranking if p.throughput_source]
    return [f"throughput: {'; '.join(sources)}"] if sources else []


def _ranking_markdown(estimate: Estimate) -> list[str]:
    if not estimate.ranking:
        return []
    lines = [
        f"**{ranking_heading(estimate)}**",
        "",
        f"| rank | type | spot $/h | {_rate_column(estimate.unit)} | MTBI (source) | checkpoint every "
        f"| waste | {_cost_column(estimate.unit)} |",
        "|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    for place, p in enumerate(estimate.ranking, 1):
        lines.append(
            f"| {place} | {p.instance_type} | {format_usd(p.usd_per_hour, 4)} | {p.steps_per_second:.4g} | "
            f"{p.mtbi_hours:,.0f} h ({p.mtbi_source}) | {p.checkpoint_every_minutes:.1f} min | "
            f"{100 * p.waste:.2f}% | {_per_1000(p)} |"
        )
    first = estimate.ranking[0]
    lines += [
        "",
        f"- C (checkpoint) {first.checkpoint_seconds:g} s, restart {first.restart_seconds:g} s "
        "per interruption",
        *(f"- {line}" for line in _throughput_lines(estimate) + behind(estimate.ranking)),
        "",
    ]
    return lines


def run(
    clients: Clients,
    stack: Stack,
    *,
    hours: float | None,
    as_json: bool,
    as_markdown: bool,
    offline: bool = False,
    scores: bool = False,
    ranking: RankingInputs | None = None,
    job: JobAsked | None = None,
) -> int:
    estimate = build(clients, stack, hours=hours, offline=offline, scores=scores, ranking=ranking, job=job)
    if as_json:
        cheapest, dearest = estimate.cheapest(), estimate.most_expensive()
        print_json(
            {
                **asdict(estimate),
                "cheapest": None if cheapest is None else cheapest.instance_type,
                "most_expensive": None if dearest is None else dearest.instance_type,
                "behind": behind(estimate.ranking),
            }
        )
        return 0
    out = console()
    if as_markdown:
        # soft_wrap: a Markdown table row broken at the terminal's width is no longer a row.
        out.print(markdown(estimate), markup=False, end="", soft_wrap=True)
        return 0
    hours_text = "?" if estimate.expected_hours is None else f"{estimate.expected_hours:g}"
    table = Table(
        title=f"projected job cost, stack {estimate.stack}, {estimate.region}: "
        f"{estimate.instance_count} instance(s) × {hours_text} h ({estimate.price_source})"
    )
    for column in ("type", "spot now", "on-demand", "job on spot", "job on demand"):
        table.add_column(column, justify="left" if column == "type" else "right")
    for t in estimate.types:
        table.add_row(
            t.instance_type,
            format_usd(t.spot_usd_per_hour, 4),
            format_usd(t.on_demand_usd_per_hour, 4),
            format_usd(t.spot_job_usd),
            format_usd(t.on_demand_job_usd),
        )
    out.print(table)
    if estimate.ranking:
        out.print(_ranking_table(estimate))
        for line in _throughput_lines(estimate) + behind(estimate.ranking):
            out.print(line, markup=False)
    for line in verdict(estimate):
        out.print(line, markup=False)
    for note in estimate.notes:
        out.print(f"note: {note}", markup=False)
    return 0


def _ranking_table(estimate: Estimate) -> Table:
    table = Table(title=ranking_heading(estimate))
    columns = (
        "rank",
        "type",
        "spot $/h",
        _rate_column(estimate.unit),
        "MTBI h",
        "MTBI from",
        "checkpoint every",
    )
    for column in (*columns, "waste", _cost_column(estimate.unit)):
        table.add_column(column, justify="left" if column in {"type", "MTBI from"} else "right")
    for place, p in enumerate(estimate.ranking, 1):
        table.add_row(
            str(place),
            p.instance_type,
            format_usd(p.usd_per_hour, 4),
            f"{p.steps_per_second:.4g}",
            f"{p.mtbi_hours:,.0f}",
            p.mtbi_source,
            f"{p.checkpoint_every_minutes:.1f} min",
            f"{100 * p.waste:.2f}%",
            _per_1000(p),
        )
    return table
