"""The demo's verdict (demo/queue.py): checks per job and for the queue, its timeline and a PNG of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bootstrap.cloud_init import USER_DATA_LIMIT_BYTES
from demo.queue import Notice, QueuedJob, QueueResult
from demo.report import LENGTHEN, MIN_ACCURACY, Check, cost_line, lives_table, mark_interruption
from trainstack_job.contract import ExitCode

COMPLETED = "completed"
CANCELLED = "cancelled"
NOTICE_S = 120  # a spot notice's two minutes: the checkpoint must be confirmed in S3 within them


def _lives(job: QueuedJob) -> list[dict[str, Any]]:
    lives = job.ledger.get("lives")
    return [life for life in lives if isinstance(life, dict)] if isinstance(lives, list) else []


def interrupted_mid_run(job: QueuedJob) -> tuple[bool, str]:
    """The notice came before the job's last step and the job stopped early with exit 75; a job that
    finished first proves nothing about the promise, so it fails here saying what to change."""
    notice = job.notice
    if notice is None:
        return False, f"no notice was injected: the job finished before the demo's point; {LENGTHEN}"
    code = notice.stop_event.get("exit_code")
    stopped = notice.stopped_step
    if notice.step >= notice.total:
        return False, f"the notice came at the job's last step ({notice.step}/{notice.total}); {LENGTHEN}"
    if code == ExitCode.COMPLETED or (stopped is not None and stopped >= notice.total):
        return False, f"the job finished before the notice: {LENGTHEN} (exit {code}, step {stopped})"
    if code != ExitCode.STOPPED:
        why = "no stop line from the agent" if not notice.stop_event else f"exit {code}"
        return False, f"the job did not stop with exit 75 ({why}); docs/job-contract.md, Stopping"
    return True, (
        f"notice at step {notice.step}/{notice.total} on {notice.boot}, stopped at {stopped} with exit 75"
    )


def steps_lost(job: QueuedJob) -> int | None:
    """Steps the interrupted boot trained past the checkpoint it confirmed (the next boot must redo them)."""
    notice = job.notice
    if notice is None or notice.stop_event.get("checkpoint_step") is None:
        return None
    reached = [int(notice.stop_event.get("reached_step") or 0)]
    reached += [s.step for s in job.samples if s.boot == notice.boot]
    return max(0, max(reached) - int(notice.stop_event["checkpoint_step"]))


def _interrupted_job_checks(job: QueuedJob, result: QueueResult) -> list[Check]:
    notice = job.notice or Notice(0.0, "", 0, 0)
    mid_run, mid_run_detail = interrupted_mid_run(job)
    lost = steps_lost(job)
    checkpoint = notice.stop_event.get("checkpoint_step")
    lives = _lives(job)
    outcomes = [str(life.get("outcome")) for life in lives]
    where = [str(life.get("instance_id")) for life in lives]
    boots = {b.instance_id: b.name for b in result.boots}
    on = [b.instance_id for name in (notice.boot, notice.resumed_boot) if (b := result.boot(name))]
    confirmed_in = notice.stop_confirmed_at - notice.at if notice.stop_confirmed_at else None
    checks = [
        Check(f"{job.label}: the notice interrupted it mid-run", mid_run, mid_run_detail),
        Check(
            f"{job.label}: stopped with a confirmed checkpoint",
            mid_run and bool(notice.stop_event.get("checkpoint_confirmed")),
            f"checkpoint step {checkpoint}, confirmed {notice.stop_event.get('checkpoint_confirmed')}",
        ),
        Check(
            f"{job.label}: checkpoint confirmed within the 2-minute notice",
            confirmed_in is not None and 0 <= confirmed_in < NOTICE_S,
            f"{confirmed_in:.1f}s after the notice" if confirmed_in is not None else "never",
        ),
        Check(f"{job.label}: steps lost = 0", mid_run and lost == 0, f"{lost}"),
        Check(
            f"{job.label}: resumed at the checkpoint step",
            notice.resumed_step is not None and notice.resumed_step == checkpoint,
            f"{notice.resumed_boot or 'no boot'} resumed at {notice.resumed_step}, checkpoint {checkpoint}",
        ),
        Check(
            f"{job.label}: completed, its ledger its own",
            job.ledger.get("status") == COMPLETED
            and outcomes == ["preempted", COMPLETED]
            and where == on
            and job.ledger.get("interruptions") == 1,
            f"status {job.ledger.get('status')}, lives {outcomes} on "
            f"{[boots.get(i, i) for i in where]}, interruptions {job.ledger.get('interruptions')}",
        ),
        Check(
            f"{job.label}: its own results in S3",
            bool(job.own_results) and set(job.own_results) <= set(job.results),
            f"jobs/{job.job_id}/results/: {', '.join(sorted(job.results)) or 'none'}",
        ),
    ]
    if job.builtin:
        checks += [_across_precisions(job, result), _accuracy(job)]
    return checks


def _across_precisions(job: QueuedJob, result: QueueResult) -> Check:
    """The built-in trainer's replacement is another GPU type in another zone, and the checkpoint crosses
    precisions (the L4's bf16 continues in the T4's fp16 with a fresh loss scaler), as on a mixed fleet."""
    notice = job.notice or Notice(0.0, "", 0, 0)
    stopped, resumed = result.boot(notice.boot), result.boot(notice.resumed_boot)
    other = (
        stopped is not None
        and resumed is not None
        and stopped.instance_type != resumed.instance_type
        and stopped.az != resumed.az
    )
    crossed = " -> " in job.resumed_as and "precision" in job.resumed_as
    where = " -> ".join(f"{b.name} {b.instance_type} {b.az}" for b in (stopped, resumed) if b is not None)
    return Check(
        f"{job.label}: resumed on another GPU type and zone, across precisions",
        other and crossed,
        f"{where or 'no boots'}; {job.resumed_as.split(': ', 1)[-1] or 'no precision change seen'}",
    )


def final_accuracy(job: QueuedJob) -> float | None:
    final = job.metrics.get("final")
    value = (final if isinstance(final, dict) else job.metrics).get("val_accuracy")
    return float(value) if isinstance(value, (int, float)) else None


def _accuracy(job: QueuedJob) -> Check:
    accuracy = final_accuracy(job)
    return Check(
        f"{job.label}: final accuracy ≥ {MIN_ACCURACY}",
        accuracy is not None and accuracy >= MIN_ACCURACY,
        f"{accuracy} (its results/metrics.json)",
    )


def _costs(result: QueueResult) -> Check:
    """Each job that ran has a cost: every life priced at the simulated spot price of its instance type."""
    ran = [j for j in result.jobs if _lives(j)]
    priced = all(
        float(j.ledger.get("total_cost_usd") or 0) > 0
        and all(life.get("price_usd_per_hour") is not None for life in _lives(j))
        for j in ran
    )
    return Check(
        "each job that ran has its cost at simulated spot prices",
        bool(ran) and priced,
        "; ".join(f"{j.label} {cost_line(j.ledger)}" for j in ran) or "no job ran",
    )


def _no_reboot(first: QueuedJob, second: QueuedJob, result: QueueResult) -> Check:
    """The second job's first life ran on the boot that completed the first, after it, in the same agent."""
    resumed = first.notice.resumed_boot if first.notice else ""
    boot = result.boot(resumed)
    second_starts = [s for b in result.boots for s in b.starts if s.job_id == second.job_id]
    hop = next((h for h in boot.hops if h[1:] == (first.job_id, second.job_id)), None) if boot else None
    start = second_starts[0] if second_starts else None
    # The ledgers say it too: the first job's last life and the second's first are on one instance.
    first_lives, second_lives = _lives(first), _lives(second)
    same_instance = (
        bool(first_lives and second_lives)
        and boot is not None
        and first_lives[-1].get("instance_id") == second_lives[0].get("instance_id") == boot.instance_id
    )
    passed = (
        boot is not None
        and hop is not None
        and start is not None
        and any(s is start for s in boot.starts)
        and start.restored_step is None
        and bool(first.completed_at)
        and start.time > first.completed_at
        and same_instance
    )
    began = "?" if start is None else "from scratch" if start.restored_step is None else start.restored_step
    detail = (
        f"{resumed or 'no boot'} completed {first.label}, then its agent went on to {second.label} "
        f"({'queue hop seen' if hop else 'no queue hop'}), which started {began}; ledgers "
        f"{'agree' if same_instance else 'disagree'} on the instance; {len(result.boots)} boots in all"
    )
    return Check(f"{second.label} ran after {first.label} on the same instance, no new boot", passed, detail)


def _cancelled(job: QueuedJob, result: QueueResult) -> Check:
    bound = [name for b in result.boots for _, name in b.bound]
    never_ran = (
        job.cancel_request
        and job.ledger.get("status", CANCELLED) == CANCELLED
        and not _lives(job)
        and not job.checkpoints
        and not job.results
        and job.job_id not in bound
    )
    return Check(
        f"{job.label}: cancelled before it ran, never ran",
        never_ran,
        f"cancel request {'present' if job.cancel_request else 'missing'}, status "
        f"{job.ledger.get('status', 'no ledger')}, lives {len(_lives(job))}, "
        f"checkpoints {len(job.checkpoints)}, results {len(job.results)}, "
        f"bound by an agent: {job.job_id in bound}",
    )


def _nothing_mixed(result: QueueResult) -> Check:
    """Each job's files stay under its own prefix: its results are exactly what it writes (the trainer's
    curves.png never among Lightning's), its checkpoint files its own kind (the trainer's state.pt,
    Lightning's lightning.ckpt), nothing in the stack's own top-level prefixes."""
    problems: list[str] = []
    files: dict[str, set[str]] = {}
    for job in result.jobs:
        if job.writes and sorted(job.results) != sorted(job.writes):
            problems.append(f"{job.label}'s results are {sorted(job.results)}, it writes {list(job.writes)}")
        names = {k.rsplit("/", 1)[-1] for k in job.checkpoints} - {"manifest.json", "latest.json"}
        if job.writes and not any(k == "latest.json" for k in job.checkpoints):
            problems.append(f"{job.label} has no checkpoints/latest.json of its own")
        for label, theirs in files.items():
            if names & theirs:
                problems.append(f"{job.label} and {label} share checkpoint files {sorted(names & theirs)}")
        files[job.label] = names
    if result.legacy_objects:
        problems.append("objects outside jobs/: " + ", ".join(result.legacy_objects))
    return Check(
        "nothing mixed between jobs",
        not problems,
        "; ".join(problems) or "each job's checkpoints and results under jobs/<its id>/ only",
    )


def checks(result: QueueResult) -> list[Check]:
    jobs = result.jobs
    calls = [c for c in result.cli if c.argv[:1] == ["run"]]
    ids = [j.job_id for j in jobs]
    subjects = [a["Subject"] for a in result.alerts]
    completions = [s for s in subjects if "training completed" in s]
    found: list[Check] = [
        Check(
            "user-data is the environment only, valid and fits",
            result.user_data_job == "" and result.user_data_bytes < USER_DATA_LIMIT_BYTES,
            f"{result.user_data_bytes} bytes; {result.user_data_valid}; "
            f"job in the agent config: {result.user_data_job or 'none'}",
        ),
        Check(
            "trainstack run queued each job and woke the group",
            len(calls) == len(jobs)
            and all(c.code == 0 for c in calls)
            and len(set(ids)) == len(ids)
            and all(ids)
            and result.desired_before == 0
            and result.desired_after_submit == 1,
            f"{len(calls)} submissions, ids {', '.join(ids)}; desired capacity "
            f"{result.desired_before} -> {result.desired_after_submit}",
        ),
        Check(
            "submitting never changed the launch template",
            result.template_versions == 1,
            f"latest version {result.template_versions}",
        ),
    ]
    interrupted = [j for j in jobs if j.interrupt]
    for job in interrupted:
        found += _interrupted_job_checks(job, result)
    if len(interrupted) >= 2:
        found.append(_no_reboot(interrupted[0], interrupted[1], result))
    lightning = next((j for j in jobs if "lightning" in j.what), None)
    if lightning is not None and lightning.notice is not None:
        resumed = result.boot(lightning.notice.resumed_boot)
        said = any(
            "Restored all states from the checkpoint" in line
            for at, line in (resumed.trainer_lines if resumed else [])
            if resumed is not None and resumed.job_at(at) == lightning.job_id
        )
        found.append(
            Check(
                f"{lightning.label}: Lightning itself restored the confirmed checkpoint",
                said,
                "its trainer said 'Restored all states from the checkpoint'" if said else "no such line",
            )
        )
    found += [_cancelled(j, result) for j in jobs if j.cancelled_at]
    found += [
        _nothing_mixed(result),
        _costs(result),
        Check(
            "every agent exited 0",
            bool(result.boots) and all(b.exit_code == 0 for b in result.boots),
            ", ".join(f"{b.name} {b.exit_code}" for b in result.boots),
        ),
        Check(
            "group scaled to zero once the queue was empty",
            result.desired_capacity == 0,
            f"desired capacity {result.desired_capacity}",
        ),
        Check(
            "one completion notification per completed job",
            len(completions) == len(interrupted),
            "; ".join(subjects) or "none",
        ),
    ]
    return found


def print_timeline(result: QueueResult, console: Console) -> None:
    t0 = result.started
    rows: list[tuple[float, str]] = []
    for job in result.jobs:
        rows.append((job.submitted_at, f"{job.label} submitted: {job.what} -> {job.job_id}"))
        if job.cancelled_at:
            rows.append((job.cancelled_at, f"{job.label} cancelled while queued"))
        if job.samples:
            first = job.samples[0]
            rows.append((first.time, f"{job.label} trains on {first.boot}: first reported step {first.step}"))
        notice = job.notice
        if notice is not None:
            rows.append(
                (
                    notice.at,
                    f"spot notice on {notice.boot} during {job.label} (step {notice.step}/{notice.total})",
                )
            )
            if notice.stop_confirmed_at:
                rows.append(
                    (
                        notice.stop_confirmed_at,
                        f"{job.label}: checkpoint step {notice.stop_event.get('checkpoint_step')} confirmed "
                        f"in S3; {notice.boot} done",
                    )
                )
            if notice.resumed_at:
                rows.append(
                    (
                        notice.resumed_at,
                        f"{job.label} resumes on {notice.resumed_boot} at step {notice.resumed_step}",
                    )
                )
        if job.completed_at:
            rows.append((job.completed_at, f"{job.label} completed"))
    for boot in result.boots:
        rows.append((boot.booted_at, f"{boot.name} boots ({boot.instance_type}, {boot.az})"))
        for moment, _ended, following in boot.hops:
            rows.append((moment, f"{boot.name} goes on to the next queued job {following}: no reboot"))
        rows += boot.notes
        if boot.exited_at:
            rows.append((boot.exited_at, f"{boot.name} agent exits {boot.exit_code}"))
    table = Table(title="Three jobs, one queue: spot notices, resumes, no reboot between jobs, a cancel")
    table.add_column("t (s)", justify="right")
    table.add_column("what happened", overflow="fold")
    for moment, text in sorted(rows, key=lambda row: row[0]):  # ties keep the order they were told in
        table.add_row(f"{moment - t0:.1f}", text)
    console.print(table)
    summary = Table(show_header=False, box=None)
    summary.add_column("what")
    summary.add_column("value", overflow="fold")
    for boot in result.boots:
        summary.add_row(f"{boot.name} ({boot.az})", boot.device)
    for job in result.jobs:
        lives = _lives(job)
        summary.add_row(
            f"{job.label} {job.job_id}",
            f"{job.ledger.get('status', 'no ledger')}, {len(lives)} lives, "
            f"interruptions {job.ledger.get('interruptions', '-')}, "
            f"steps lost {'-' if job.notice is None else steps_lost(job)}",
        )
        notice = job.notice
        if notice is not None and notice.stop_confirmed_at:
            summary.add_row("  notice → checkpoint confirmed", f"{notice.stop_confirmed_at - notice.at:.1f}s")
        if notice is not None and notice.resumed_at:
            summary.add_row("  notice → training resumed", f"{notice.resumed_at - notice.at:.1f}s")
        if job.resumed_as:
            summary.add_row("  resumed as", job.resumed_as)
        if job.builtin:
            summary.add_row("  final validation accuracy", str(final_accuracy(job)))
        if lives:
            summary.add_row("  estimated cost", cost_line(job.ledger))
        if job.artifacts:
            summary.add_row("  artifacts", "\n".join(job.artifacts))
    summary.add_row("group desired capacity", str(result.desired_capacity))
    console.print(summary)
    console.print(lives_table([(job.label, job.ledger) for job in result.jobs]))
    if result.jobs_table:
        console.print("[bold]trainstack jobs[/] at the end:")
        console.print(result.jobs_table, highlight=False, markup=False)


def report(result: QueueResult, console: Console) -> list[Check]:
    console.rule("timeline")
    print_timeline(result, console)
    return checks(result)


def plot_timeline(result: QueueResult, path: Path) -> Path:
    """One panel per job that ran: its steps over time on each boot, its notice, the confirmed checkpoint and
    the resume (the jobs' lengths differ, so each has its own step axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result.started
    ran = [j for j in result.jobs if j.samples] or result.jobs[:1]
    figure, axes_list = plt.subplots(
        len(ran), 1, figsize=(9, 2.6 * len(ran) + 0.6), sharex=True, squeeze=False
    )
    palette = ("tab:blue", "tab:green", "tab:purple", "tab:olive")
    colours = {boot.name: palette[n % len(palette)] for n, boot in enumerate(result.boots)}
    for axes, job in zip([row[0] for row in axes_list], ran, strict=True):
        for boot in result.boots:
            steps = [s for s in job.samples if s.boot == boot.name]
            if steps:
                axes.plot(
                    [s.time - t0 for s in steps],
                    [s.step for s in steps],
                    marker=".",
                    color=colours.get(boot.name, "tab:gray"),
                    label=f"{boot.name} ({boot.instance_type})",
                )
        notice = job.notice
        if notice is not None:
            mark_interruption(
                axes,
                t0,
                notice_at=notice.at,
                confirmed_at=notice.stop_confirmed_at,
                checkpoint=notice.stop_event.get("checkpoint_step"),
                resumed_at=notice.resumed_at,
                resumed_step=notice.resumed_step,
                resumed_colour="black",
            )
        lost = "-" if job.notice is None else steps_lost(job)
        axes.set_title(f"{job.label}: {job.what} ({job.job_id}), steps lost = {lost}", fontsize=9)
        axes.set_ylabel("step")
        axes.legend(loc="upper left", fontsize=7)
        axes.grid(alpha=0.3)
    axes_list[-1][0].set_xlabel("seconds since the demo started")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
