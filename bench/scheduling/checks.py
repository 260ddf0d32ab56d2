"""One scheduling bench run, its checks and its figures."""

from __future__ import annotations

import itertools
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from bench.scheduling.embedded_aws import reset
from bench.scheduling.instances import STOP, Instance, Launcher, Scaler, SchedulerFunction, World
from bench.scheduling.journal import Holding, Journal
from bench.scheduling.metering import Meter, Tally
from bench.scheduling.runs import RunSpec
from trainstack_job.records import ENDED_STATUSES

# No run may take longer than this: a hung instance must not hold the bench for ever.
RUN_TIMEOUT_S = 1800.0


def _percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


@dataclass
class RunResult:
    spec: RunSpec
    seconds: float
    journal: Journal
    tally: Tally
    lowered: int
    checks: list[Check] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    # The scheduler function's invocations by trigger, and how many of them raised a pool (scheduler runs).
    invocations: dict[str, int] = field(default_factory=dict)
    raised: int = 0
    passes: int = 0  # the invocations that read the state (the others a pass had covered)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)


def overlaps(holdings: list[Holding]) -> list[str]:
    """Pairs of lease holds of one job that overlap in time: two writers at once."""
    found: list[str] = []
    by_job: dict[str, list[Holding]] = {}
    for holding in holdings:
        by_job.setdefault(holding.job, []).append(holding)
    for job, held in sorted(by_job.items()):
        held.sort(key=lambda h: h.start)
        for first, second in itertools.pairwise(held):
            if second.start < first.end:
                found.append(
                    f"{job}: {first.instance} held it until +{first.end - second.start:.3f} s after "
                    f"{second.instance} took it"
                )
    return found


def most_at_once(holdings: list[Holding]) -> int:
    """The most jobs running at one instant: each from its holder's lease taken until its end was written
    (the lease's release, for a job that did not complete in that hold). Each interval lies within the
    job's hold of its run slot, so an overlap here is an overlap there."""
    trained = [h for h in holdings if h.trained]
    edges = sorted(
        [(h.start, 1, h.job) for h in trained]
        + [(h.ran_until if h.ran_until is not None else h.end, -1, h.job) for h in trained],
        key=lambda edge: (edge[0], edge[1]),  # an end before a start at the same instant
    )
    running: Counter[str] = Counter()
    most = 0
    for _, step, job in edges:
        running[job] += step
        most = max(most, sum(1 for count in running.values() if count > 0))
    return most


def check_run(spec: RunSpec, journal: Journal) -> list[Check]:
    jobs = [job.job_id for job in spec.jobs]
    completed = Counter(h.job for h in journal.holdings if h.completed)
    trained = Counter(h.job for h in journal.holdings if h.trained)
    twice = sorted(job for job in jobs if completed[job] > 1 or trained[job] > 1)
    never = sorted(job for job in jobs if completed[job] == 0)
    once_detail = f"{sum(1 for job in jobs if completed[job] == 1 and trained[job] == 1)} of {len(jobs)} once"
    if twice:
        once_detail += f"; twice: {', '.join(twice[:5])}" + (" ..." if len(twice) > 5 else "")
        reborn = [
            h
            for h in journal.holdings
            if h.trained and h.job in twice and h.status_at_begin in ENDED_STATUSES
        ]
        if reborn:
            once_detail += (
                f" ({len(reborn)} of the second runs began their life on a ledger already "
                f"{reborn[0].status_at_begin!r}: bound while the job still ran, its life began after it "
                "ended)"
            )
    if never:
        once_detail += f"; never: {', '.join(never[:5])}" + (" ..." if len(never) > 5 else "")
    double = overlaps(journal.holdings)
    busy_gone = [instance for instance, busy in journal.scaled_in if busy]
    return [
        Check("every job ran exactly once", not twice and not never, once_detail),
        Check(
            "never two writers at once",
            not double,
            f"{len(journal.holdings)} lease holds, {len(double)} overlapping"
            + (f": {double[0]}" if double else ""),
        ),
        Check(
            "no job's lease lost",
            not journal.lease_problems,
            "; ".join(journal.lease_problems[:3])
            or "every holder proved its lease at the end and released it",
        ),
        Check(
            "no busy instance scaled in",
            not busy_gone,
            f"{len(journal.scaled_in)} instances scaled in, {len(busy_gone)} of them holding a lease"
            if spec.scale_in
            else "no scale-in in this run (holders protected; checked in the burst run)",
        ),
        Check("no errors", not journal.errors, "; ".join(journal.errors[:3]) or "none"),
        *_limit_check(spec, journal),
    ]


def _limit_check(spec: RunSpec, journal: Journal) -> list[Check]:
    if not spec.max_concurrent_jobs:
        return []
    most = most_at_once(journal.holdings)
    return [
        Check(
            "never more than maxConcurrentJobs at once",
            most <= spec.max_concurrent_jobs,
            f"at most {most} jobs trained at once (maxConcurrentJobs {spec.max_concurrent_jobs})",
        )
    ]


def figures(result: RunResult) -> dict[str, Any]:
    journal, tally, spec = result.journal, result.tally, result.spec
    jobs = len(spec.jobs)
    kinds = tally.kinds()
    dispatch = [seconds for _, seconds in journal.dispatch]
    waits = [seconds for _, seconds in journal.queue_wait]
    lived = sum((end if end is not None else start) - start for start, end in journal.alive.values())
    busy = sum(journal.busy.values())
    decisions = journal.decisions
    binds = [d for d in decisions if d.kind == "bind"]
    looks = [d for d in decisions if d.kind == "look"]
    decision_seconds = [d.seconds for d in decisions]
    return {
        "jobs": jobs,
        "instances": sum(pool.instances for pool in spec.pools),
        "wall_s": round(result.seconds, 2),
        "dispatch_p50_s": round(_percentile(dispatch, 0.5), 3),
        "dispatch_p95_s": round(_percentile(dispatch, 0.95), 3),
        "queue_wait_p50_s": round(_percentile(waits, 0.5), 3),
        "queue_wait_p95_s": round(_percentile(waits, 0.95), 3),
        "utilisation": round(busy / lived, 3) if lived else 0.0,
        "busy_s": round(busy, 2),
        "instance_s": round(lived, 2),
        "s3_requests": dict(kinds),
        "s3_per_job": {kind: round(count / jobs, 1) for kind, count in kinds.items()},
        "s3_usd_per_job": round(tally.usd() / jobs, 6),
        "s3_usd_total": round(tally.usd(), 5),
        "conflicts_412": tally.conflicts,
        "autoscaling_calls": dict(tally.autoscaling),
        "scaler_lowered": result.lowered,
        "decisions": len(decisions),
        "decisions_bind": len(binds),
        "decisions_look": len(looks),
        "decision_p50_s": round(_percentile(decision_seconds, 0.5), 3),
        "decision_p95_s": round(_percentile(decision_seconds, 0.95), 3),
        "decision_get_mean": round(statistics.fmean(d.get for d in decisions), 1) if decisions else 0.0,
        "decision_get_max": max((d.get for d in decisions), default=0),
        "decision_list_mean": round(statistics.fmean(d.list for d in decisions), 2) if decisions else 0.0,
        "decision_put_mean": round(statistics.fmean(d.put for d in decisions), 2) if decisions else 0.0,
        "decision_s3_share": round(
            sum(d.get + d.list + d.put for d in decisions) / max(1, sum(kinds.values())), 3
        ),
        "roles": dict(journal.roles),
        "notes": list(journal.notes),
        "lambda_invocations": dict(result.invocations),
        "lambda_raised": result.raised,
        "lambda_passes": result.passes,
        "most_at_once": most_at_once(journal.holdings),
    }


def run_one(spec: RunSpec, endpoint: str, seed: int, say: Callable[[str], None] = print) -> RunResult:
    """One run in a fresh moto state: submit, start the instances, wait for all of them to leave."""
    reset(endpoint)
    meter = Meter()
    world = World(spec, meter, seed)
    function = launcher = None
    if spec.scheduler:
        function, launcher = SchedulerFunction(world), Launcher(world)
        world.on_submit = partial(function.trigger, "queue entry")
        world.on_instance_end = partial(function.trigger, "instance ended")
        function.thread.start()
        launcher.thread.start()
    started = time.monotonic()
    if spec.submit_over_s <= 0:
        for job in spec.jobs:
            world.submit(job)
    else:
        gap = spec.submit_over_s / max(1, len(spec.jobs))
        for job in spec.jobs:
            world.submit(job)
            pause = started + gap * (len(world.journal.submitted)) - time.monotonic()
            if pause > 0:
                time.sleep(pause)
    say(f"  {spec.name}: {len(spec.jobs)} jobs queued in {time.monotonic() - started:.2f} s; instances start")
    if function is not None and launcher is not None:
        return _driven_by_the_function(spec, world, function, launcher, started, meter)
    instances = [
        Instance(world, pool, instance_id) for pool in spec.pools for instance_id in world.launch(pool)
    ]
    scaler = Scaler(world) if spec.scale_in else None
    began = time.monotonic()
    for instance in instances:
        instance.thread.start()
    if scaler is not None:
        scaler.thread.start()
    deadline = began + RUN_TIMEOUT_S
    for instance in instances:
        instance.thread.join(max(0.0, deadline - time.monotonic()))
    if any(instance.thread.is_alive() for instance in instances):
        world.stop.set()
        world.journal.errors.append(f"the run did not end within {RUN_TIMEOUT_S:.0f} s")
        for instance in instances:
            instance.thread.join(30)
    if scaler is not None:
        scaler.done.set()
        scaler.thread.join(10)
    seconds = time.monotonic() - began
    result = RunResult(spec, seconds, world.journal, meter.total, scaler.lowered if scaler else 0)
    result.checks = check_run(spec, world.journal)
    result.figures = figures(result)
    return result


def _driven_by_the_function(
    spec: RunSpec,
    world: World,
    function: SchedulerFunction,
    launcher: Launcher,
    began: float,
    meter: Meter,
) -> RunResult:
    """A run whose instances the scheduler function starts: it ends once every job completed and every
    instance left (the pools back at zero), or at the timeout."""
    wanted = {job.job_id for job in spec.jobs}
    deadline = began + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        with world.journal.lock:
            completed = {h.job for h in world.journal.holdings if h.completed}
        if completed >= wanted and not launcher.running():
            break
        time.sleep(0.05)
    else:
        world.stop.set()
        world.journal.errors.append(f"the run did not end within {RUN_TIMEOUT_S:.0f} s")
    launcher.done.set()
    launcher.thread.join(10)
    for instance in launcher.instances:
        instance.thread.join(30)
    function.done.set()
    function.trigger(STOP)
    function.thread.join(30)
    invocations = dict(function.invocations)
    seconds = time.monotonic() - began
    result = RunResult(
        spec,
        seconds,
        world.journal,
        meter.total,
        0,
        invocations=invocations,
        raised=function.raised,
        passes=function.passes_run,
    )
    result.checks = check_run(spec, world.journal)
    result.figures = figures(result)
    return result
