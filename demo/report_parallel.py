"""`python -m demo --parallel`'s verdict: the checks that must hold, and a timeline on the terminal."""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Any

from rich.console import Console
from rich.table import Table

from demo.parallel import BIG_POOL, DEFAULT_POOL, ParallelResult, StepSeen
from demo.report import Check, lives_table

# Not built yet (issue 32, item 5): `trainstack jobs` shows no waiting reasons; the demo says so.
SKIPPED = ("waiting reasons shown in `trainstack jobs`", "not built yet: the check is skipped")


def segments(result: ParallelResult) -> dict[tuple[str, str], tuple[StepSeen, StepSeen]]:
    """(job id, instance) -> its first and last trained step there: the span that instance wrote the job."""
    found: dict[tuple[str, str], tuple[StepSeen, StepSeen]] = {}
    for step in result.steps:
        key = (step.job_id, step.instance)
        first, _ = found.get(key, (step, step))
        found[key] = (first, step)
    return found


def busy(result: ParallelResult) -> dict[str, list[tuple[float, float, str]]]:
    """Instance name -> the spans it was busy with a job, (start, end, job id): from taking the job's lease
    (or taking it over) until its trainer's work was over (results uploaded, the trainer stopped), the lease
    released or the life ended. A life that completed its job leaves the group (or scales it to zero)
    before it lets the lease go: it is idle by then."""
    spans: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
    bound: dict[str, str] = {}
    since: dict[str, tuple[float, str]] = {}
    for event in result.events:
        name = event.instance
        if event.stage == "job" and event.message == "job bound":
            bound[name] = str(event.fields.get("job_id"))
        if event.stage == "lease" and event.message in ("lease acquired", "lease taken over"):
            since[name] = (event.time, bound.get(name, ""))
        elif name in since and (
            (event.stage == "lease" and ("released" in event.message or "lost" in event.message))
            or event.stage in ("end", "results")
            or event.message.startswith("trainer stopped")
        ):
            start, job = since.pop(name)
            spans[name].append((start, event.time, job))
    for instance in result.instances:
        if instance.name in since:
            start, job = since.pop(instance.name)
            spans[instance.name].append((start, instance.exited_at or float("inf"), job))
    return spans


def left_itself(result: ParallelResult, name: str) -> tuple[float, str] | None:
    """When and how an instance's agent took it out of its group (or its group to zero), if it did."""
    for event in result.events_of(name):
        if event.stage == "fleet" and ("left the group" in event.message or "set to 0" in event.message):
            return event.time, event.message.split(",")[0]
    return None


def _t(result: ParallelResult, moment: float) -> str:
    return f"{moment - result.started:.1f}s"


def check_one_writer(result: ParallelResult) -> Check:
    """Per job, the spans its trainers trained on different instances never overlap."""
    spans = segments(result)
    problems = []
    for job in result.jobs:
        mine = sorted((v for (j, _), v in spans.items() if j == job.job_id), key=lambda v: v[0].time)
        for before, after in itertools.pairwise(mine):
            if after[0].time <= before[1].time:
                problems.append(
                    f"{job.label}: {after[0].instance} trained step {after[0].step} at "
                    f"{_t(result, after[0].time)} while {before[0].instance} trained until step "
                    f"{before[1].step} at {_t(result, before[1].time)}"
                )
    writers = {job.label: len([k for k in spans if k[0] == job.job_id]) for job in result.jobs}
    missing = [label for label, count in writers.items() if count == 0]
    ok = not problems and not missing
    detail = "; ".join(problems) or (
        f"never trained by none: {missing}"
        if missing
        else "trainers per job, one after the other: " + ", ".join(f"{k} {v}" for k, v in writers.items())
    )
    return Check("never two trainers for one job at once", ok, detail)


def job_spans(result: ParallelResult, pool: str) -> dict[str, list[tuple[float, float]]]:
    """Job id -> the spans an instance was busy with it (busy()), for the jobs of `pool`."""
    found: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for spans in busy(result).values():
        for start, end, job_id in spans:
            job = result.job(job_id)
            if job is not None and job.pool == pool:
                found[job_id].append((start, end))
    return found


def concurrency(result: ParallelResult, pool: str) -> int:
    """The most jobs of `pool` that instances were busy with at one moment (each holding its job's lease)."""
    moments = [
        (moment, change)
        for spans in job_spans(result, pool).values()
        for start, end in spans
        for moment, change in ((start, 1), (end, -1))
    ]
    now = most = 0
    for _, change in sorted(moments, key=lambda m: (m[0], m[1])):  # an end before a start at one moment
        now += change
        most = max(most, now)
    return most


def stepping_at_once(result: ParallelResult, pool: str) -> int:
    """The most jobs of `pool` whose trainers logged steps in overlapping spans."""
    moments: list[tuple[float, int]] = []
    for (job_id, _), (first, last) in segments(result).items():
        job = result.job(job_id)
        if job is not None and job.pool == pool:
            moments += [(first.time, 1), (last.time + 1e-6, -1)]
    now = most = 0
    for _, change in sorted(moments, key=lambda m: (m[0], m[1])):
        now += change
        most = max(most, now)
    return most


def check_pool_maximum(result: ParallelResult) -> Check:
    """Each group never held more than its maximum; each pool never trained more jobs than its lanes."""
    problems, parts = [], []
    for name, pool in result.pools.items():
        samples = [s for s in result.samples if s.pool == name]
        most = max((len(s.protected) for s in samples), default=0)
        trainers = concurrency(result, name)
        parts.append(
            f"{name}: at most {most} instances (maximum {pool.max_size}), {trainers} jobs running at once "
            f"(maxJobs {pool.max_jobs})"
        )
        if most > pool.max_size:
            problems.append(f"{name} held {most} instances, above its maximum {pool.max_size}")
        if trainers > pool.max_jobs * pool.max_instances:
            problems.append(f"{name} ran {trainers} jobs at once, above maxJobs {pool.max_jobs}")
    return Check("at most each pool's maximum at once", not problems, "; ".join(problems or parts))


def check_sweep_parallel(result: ParallelResult) -> Check:
    """Two points ran at once (each busy on its own instance); the other two waited for a lane: each started
    only after one of the first two had ended."""
    spans = job_spans(result, DEFAULT_POOL)
    points = [j for j in result.jobs if j.pool == DEFAULT_POOL]
    first = {job_id: min(s[0] for s in found) for job_id, found in spans.items()}
    last = {job_id: max(s[1] for s in found) for job_id, found in spans.items()}
    together = concurrency(result, DEFAULT_POOL)
    order = sorted((j for j in points if j.job_id in first), key=lambda j: first[j.job_id])
    problems = []
    if len(points) != 4 or len(order) != 4:
        problems.append(f"{len(order)} of {len(points)} points ran")
    elif together != 2:
        problems.append(f"{together} points ran at once, not 2")
    else:
        freed = min(last[j.job_id] for j in order[:2])
        early = [j.label for j in order[2:] if first[j.job_id] < freed]
        if early:
            problems.append(f"{', '.join(early)} started before a lane was free")
    detail = (
        ", ".join(f"{j.label} {_t(result, first[j.job_id])}-{_t(result, last[j.job_id])}" for j in order)
        + f"; trainers stepping at once: {stepping_at_once(result, DEFAULT_POOL)}"
    )
    return Check(
        "the sweep ran 2 points at once, 2 waited for a lane", not problems, "; ".join(problems) or detail
    )


def check_completed_once(result: ParallelResult) -> Check:
    problems = []
    for job in result.jobs:
        lives = job.ledger.get("lives") or []
        done = [life for life in lives if life.get("outcome") == "completed"]
        ends = [
            e
            for e in result.events
            if e.stage == "end"
            and e.message.startswith("completed")
            and _bound_job(result, e.instance, e.time) == job.job_id
        ]
        if job.ledger.get("status") != "completed" or len(done) != 1 or len(ends) != 1:
            problems.append(
                f"{job.label}: status {job.ledger.get('status')}, {len(done)} completed lives, "
                f"{len(ends)} completions"
            )
    detail = "; ".join(problems) or f"{len(result.jobs)} jobs, each completed by one life"
    return Check("every job completed exactly once", not problems, detail)


def _bound_job(result: ParallelResult, instance: str, moment: float) -> str:
    bound = [e for e in result.events_of(instance) if e.message == "job bound" and e.time <= moment]
    return str(bound[-1].fields.get("job_id")) if bound else ""


def check_no_busy_scale_in(result: ParallelResult) -> Check:
    """No instance left its group while it was busy with a job (the demo's spot notice aside); and in the
    pool of several lanes every busy instance was protected from scale-in whenever the groups were read."""
    spans = busy(result)
    problems, left = [], []
    for instance in result.instances:
        if not instance.gone_at:
            continue
        if instance.spot_terminated_at:
            left.append(f"{instance.name} by the spot notice")
            continue
        itself = left_itself(result, instance.name)
        # Its own leave is timed by its event; another's scale-in by the first reading without it.
        moment = itself[0] if itself is not None else instance.gone_at - 0.1
        held = [s for s in spans.get(instance.name, []) if s[0] <= moment <= s[1]]
        if held:
            problems.append(f"{instance.name} left {instance.pool}'s group while busy with {held[0][2]}")
        left.append(f"{instance.name} {itself[1] if itself else 'scaled in by its group'}")
    unprotected = checked = 0
    for sample in result.samples:
        if result.pools[sample.pool].max_jobs <= 1:
            continue
        for instance_id, protected in sample.protected.items():
            seen = result.instance_by_id(instance_id)
            if seen is None:
                continue
            # The agent protects its instance right after it takes the lease: a second's grace.
            if any(s[0] + 1.0 <= sample.time <= s[1] for s in spans.get(seen.name, [])):
                checked += 1
                unprotected += not protected
    if unprotected:
        problems.append(
            f"a busy instance was unprotected from scale-in in {unprotected} of {checked} readings"
        )
    if not checked:
        problems.append("the groups were never read while an instance of the 2-lane pool was busy")
    detail = "; ".join(problems) or (
        f"busy instances protected from scale-in in {checked} of {checked} readings; "
        f"instances gone: {'; '.join(left)}"
    )
    return Check("no busy (lease-holding) instance scaled in", not problems, detail)


def check_pools_at_zero(result: ParallelResult) -> Check:
    ok = all(v == 0 for v in result.desired_end.values()) and not any(result.instances_end.values())
    detail = ", ".join(
        f"{pool}: desired {result.desired_end.get(pool)}, {len(result.instances_end.get(pool, []))} instances"
        for pool in result.pools
    )
    return Check("each pool's desired capacity 0 at the end", ok, detail)


def check_big_job(result: ParallelResult) -> Check:
    big = next((j for j in result.jobs if j.pool == BIG_POOL), None)
    pool = result.pools.get(BIG_POOL)
    if big is None or pool is None:
        return Check("the big job ran on the big pool's instance type", False, "no big job")
    trainers = {s.instance for s in result.steps if s.job_id == big.job_id}
    ran = [result.instance(name) for name in sorted(trainers)]
    ok = (
        bool(ran)
        and big.record.get("pool") == BIG_POOL
        and all(i is not None and i.pool == BIG_POOL and i.instance_type in pool.instance_types for i in ran)
    )
    where = ", ".join(f"{i.name} ({i.instance_type}, {i.device})" for i in ran if i is not None)
    return Check(
        "the big job ran on the big pool's instance type",
        ok,
        f"record pool {big.record.get('pool')!r}; trained on {where or 'nothing'}",
    )


def check_resumed(result: ParallelResult) -> Check:
    """The interrupted point resumed from the checkpoint its stop confirmed, on its replacement, while the
    point beside it trained on."""
    notice = result.notice
    name = "spot notice: the point resumed from its confirmed checkpoint, the other trained on"
    if not notice.at:
        return Check(
            name, False, "no notice was injected (no two points trained at once past the notice step)"
        )
    job = result.job(notice.job_id)
    other = result.job(notice.other_job)
    on = [
        s
        for s in result.steps
        if s.job_id == notice.other_job and notice.at <= s.time <= (notice.resumed_at or 0)
    ]
    problems = []
    if notice.checkpoint_step is None:
        problems.append("no confirmed checkpoint on the stop")
    if notice.resumed_step is None or notice.resumed_step != notice.checkpoint_step:
        problems.append(f"resumed at {notice.resumed_step}, confirmed {notice.checkpoint_step}")
    if not on:
        problems.append("the other point logged no step between the notice and the resume")
    detail = (
        f"{job.label if job else notice.job_id}: notice on {notice.instance} at step {notice.step}, "
        f"checkpoint {notice.checkpoint_step} confirmed, resumed on {notice.resumed_instance or '-'} at step "
        f"{notice.resumed_step}; {other.label if other else notice.other_job} trained {len(on)} steps "
        "meanwhile"
    )
    return Check(name, not problems, "; ".join(problems) + ("; " if problems else "") + detail)


def check_refused(result: ParallelResult) -> Check:
    code, line = result.refused
    ok = code != 0 and "no pool serves" in line
    return Check("a request no pool serves is refused at submit", ok, line or f"exit {code}")


def check_agents(result: ParallelResult) -> Check:
    codes = {i.name: i.exit_code for i in result.instances}
    return Check("every agent exited 0", all(c == 0 for c in codes.values()) and bool(codes), str(codes))


def checks(result: ParallelResult) -> list[Check]:
    return [
        check_refused(result),
        check_sweep_parallel(result),
        check_one_writer(result),
        check_pool_maximum(result),
        check_resumed(result),
        check_completed_once(result),
        check_no_busy_scale_in(result),
        check_big_job(result),
        check_pools_at_zero(result),
        check_agents(result),
    ]


def print_timeline(result: ParallelResult, console: Console) -> None:
    t0 = result.started
    rows: list[tuple[float, str]] = []
    spans = segments(result)
    for job in result.jobs:
        rows.append((job.submitted_at, f"{job.label} queued -> {job.job_id} (pool {job.pool})"))
        for (job_id, name), (first, last) in spans.items():
            if job_id == job.job_id:
                rows.append((first.time, f"{job.label} trains on {name} from step {first.step}"))
                rows.append((last.time, f"{job.label} last step on {name}: {last.step}"))
    for instance in result.instances:
        rows.append(
            (instance.booted_at, f"{instance.name} boots in pool {instance.pool} ({instance.instance_type})")
        )
        if instance.spot_terminated_at:
            rows.append(
                (instance.spot_terminated_at, f"spot notice on {instance.name}; the group replaces it")
            )
        if instance.exited_at:
            rows.append((instance.exited_at, f"{instance.name} agent exits {instance.exit_code}"))
    for event in result.events:
        if event.stage == "fleet" and ("left the group" in event.message or "set to 0" in event.message):
            rows.append((event.time, f"{event.instance}: {event.message}"))
        if event.stage == "lease" and event.message in (
            "lease acquired",
            "lease taken over",
            "lease released",
        ):
            rows.append((event.time, f"{event.instance}: {event.message}"))
    table = Table(title="Two pools, a 4-point sweep on 2 lanes, an L40S job, a spot notice")
    table.add_column("t (s)", justify="right")
    table.add_column("what happened", overflow="fold")
    for moment, text in sorted(rows, key=lambda row: row[0]):
        table.add_row(f"{moment - t0:.1f}", text)
    console.print(table)
    summary = Table(show_header=False, box=None)
    summary.add_column("what")
    summary.add_column("value", overflow="fold")
    for instance in result.instances:
        summary.add_row(f"{instance.name} ({instance.pool})", instance.device)
    for job in result.jobs:
        found = job.metrics.get("final")
        final: dict[str, Any] = found if isinstance(found, dict) else {}
        summary.add_row(
            f"{job.label} {job.job_id}",
            f"{job.ledger.get('status', 'no ledger')}, {len(job.ledger.get('lives') or [])} lives, "
            f"interruptions {job.ledger.get('interruptions', '-')}, val accuracy {final.get('val_accuracy')}",
        )
    summary.add_row("desired capacity after the sweep's submit", str(result.desired_after_sweep))
    summary.add_row("desired capacity after the big job's submit", str(result.desired_after_big))
    summary.add_row("desired capacity at the end", str(result.desired_end))
    summary.add_row("story took", f"{max((i.exited_at for i in result.instances), default=t0) - t0:.1f}s")
    console.print(summary)
    console.print(lives_table([(job.label, job.ledger) for job in result.jobs]))
    if result.jobs_table:
        console.print("[bold]trainstack jobs[/] at the end:")
        console.print(result.jobs_table, highlight=False, markup=False)


def report(result: ParallelResult, console: Console) -> list[Check]:
    console.rule("timeline")
    print_timeline(result, console)
    name, why = SKIPPED
    console.print(f"[yellow]SKIPPED[/] {name}: {why}", highlight=False)
    return checks(result)
