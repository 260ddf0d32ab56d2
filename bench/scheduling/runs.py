"""The scheduling bench's runs: its pools, its jobs and when they are submitted."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

POOL_B = "b"


@dataclass(frozen=True)
class PoolSpec:
    name: str  # "" = the stack's default pool
    instances: int
    lanes: int

    @property
    def label(self) -> str:
        return self.name or "default"


@dataclass(frozen=True)
class JobSpec:
    job_id: str
    pool: str
    train_s: float
    sweep: dict[str, Any] | None = None


@dataclass(frozen=True)
class RunSpec:
    name: str
    title: str
    pools: tuple[PoolSpec, ...]
    jobs: tuple[JobSpec, ...]
    # 0: every job is queued before the instances start; > 0: the jobs are submitted over this many seconds
    # while the instances start (the first submission woke the group).
    submit_over_s: float = 0.0
    scale_in: bool = False
    # The scheduler function drives the pools (lambdas/scheduler/handler.py, invoked on each queue entry,
    # each instance's end and a schedule): the groups start at zero and every instance is one it started.
    scheduler: bool = False
    # trainstack:maxConcurrentJobs (0: none): the agents' run slots and the scheduler's limit.
    max_concurrent_jobs: int = 0


def _job_id(name: str, index: int) -> str:
    return f"{name}-{index:08x}"


def _train_times(count: int, rng: random.Random, low: float, high: float) -> list[float]:
    return [round(rng.uniform(low, high), 3) for _ in range(count)]


def pools_run(
    jobs: int, instances_a: int, lanes_a: int, instances_b: int, lanes_b: int, seed: int
) -> RunSpec:
    rng = random.Random(seed)
    times = _train_times(jobs, rng, 0.05, 0.3)
    # Jobs split between the pools in proportion to their lanes (3:1 at the default sizes), interleaved.
    share_b = lanes_b / (lanes_a + lanes_b)
    specs = []
    for i in range(jobs):
        pool = POOL_B if int((i + 1) * share_b) > int(i * share_b) else ""
        specs.append(JobSpec(_job_id("job", i), pool, times[i]))
    return RunSpec(
        "pools",
        f"{jobs} jobs over {instances_a + instances_b} instances in 2 pools "
        f"(default: {instances_a} instances, {lanes_a} lanes; "
        f"{POOL_B}: {instances_b} instances, {lanes_b} lanes)",
        (PoolSpec("", instances_a, lanes_a), PoolSpec(POOL_B, instances_b, lanes_b)),
        tuple(specs),
    )


def sweep_run(points: int, lanes: int, instances: int, parallel: int, seed: int) -> RunSpec:
    rng = random.Random(seed + 1)
    times = _train_times(points, rng, 0.05, 0.3)
    sweep: dict[str, Any] = {"name": "lr", "point": {}}
    if parallel:
        sweep["parallel"] = parallel
    specs = tuple(
        JobSpec(_job_id(f"lr-p{i}", i), "", times[i], {**sweep, "point": {"lr": i}}) for i in range(points)
    )
    limit = f", --parallel {parallel}" if parallel else ""
    return RunSpec(
        "sweep",
        f"a {points}-point sweep on a pool of {lanes} lanes and {instances} instances{limit}",
        (PoolSpec("", instances, lanes),),
        specs,
    )


def burst_run(jobs: int, lanes: int, instances: int, seed: int, scale_in: bool = True) -> RunSpec:
    rng = random.Random(seed + 2)
    times = _train_times(jobs, rng, 0.05, 0.3)
    specs = tuple(JobSpec(_job_id("burst", i), "", times[i]) for i in range(jobs))
    return RunSpec(
        "burst",
        f"a burst of {jobs} submissions within 1 s, drained by {instances} instances ({lanes} lanes)"
        + (", scale-in on" if scale_in else ""),
        (PoolSpec("", instances, lanes),),
        specs,
        submit_over_s=1.0,
        scale_in=scale_in,
    )


def limit_run(jobs: int, instances: int, lanes: int, limit: int, seed: int) -> RunSpec:
    """Two pools of `lanes` lanes and `instances` instances each, driven by the scheduler function alone,
    under a stack-wide maxConcurrentJobs of `limit`: jobs submitted over one second, half to each pool."""
    rng = random.Random(seed + 3)
    times = _train_times(jobs, rng, 0.05, 0.3)
    specs = tuple(JobSpec(_job_id("cap", i), POOL_B if i % 2 else "", times[i]) for i in range(jobs))
    return RunSpec(
        "limit",
        f"{jobs} jobs over 2 pools of {lanes} lanes and at most {instances} instances each, "
        f"maxConcurrentJobs {limit}, every instance started by the scheduler function",
        (PoolSpec("", instances, lanes), PoolSpec(POOL_B, instances, lanes)),
        specs,
        submit_over_s=1.0,
        scheduler=True,
        max_concurrent_jobs=limit,
    )
