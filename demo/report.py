"""The demo's verdict: checks that must hold, a rich timeline on the terminal, and a PNG of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bootstrap.cloud_init import USER_DATA_LIMIT_BYTES
from demo.run import DemoResult
from trainstack.top import data_wait_text, first_step_text
from trainstack_job.contract import ExitCode
from trainstack_job.records import Life

MIN_ACCURACY = 0.5  # 4 classes: chance is 0.25


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str


def steps_lost(result: DemoResult) -> int | None:
    """Steps instance 1 had trained past the checkpoint it confirmed (and that instance 2 must redo)."""
    reached = result.stop_event.get("reached_step")
    checkpoint = result.stop_event.get("checkpoint_step")
    first_samples = [s.step for s in result.samples if s.instance == "instance-1"]
    if checkpoint is None:
        return None
    reached_max = max([int(reached or 0), *first_samples])
    return max(0, reached_max - int(checkpoint))


LENGTHEN = "lengthen it (more steps) so the demo can interrupt it"


def interrupted_mid_run(result: DemoResult) -> tuple[bool, str]:
    """Whether the notice really interrupted instance 1's job: injected before its last step, and the job
    stopped early (before its last step) with exit 75. A job that finished first proves nothing about
    the promise, whatever the other checks say, so it fails here with what to change."""
    total = result.total_steps
    code = result.stop_event.get("exit_code")
    stopped = result.trainer_stopped_step
    if stopped is None and isinstance(result.stop_event.get("newest_local_step"), int):
        stopped = int(result.stop_event["newest_local_step"])
    first = [s.step for s in result.samples if s.instance == "instance-1"]
    finished = (
        code == ExitCode.COMPLETED
        or (total > 0 and stopped is not None and stopped >= total)
        or (not result.stop_event and total > 0 and max(first, default=0) >= total)
    )
    if not result.notice_at:
        return False, f"no notice was injected: the job finished before the demo's point; {LENGTHEN}"
    if total > 0 and result.notice_step >= total:
        return False, f"the notice came at the job's last step ({result.notice_step}/{total}); {LENGTHEN}"
    if finished:
        return False, f"the job finished before the notice: {LENGTHEN} (exit {code}, step {stopped}/{total})"
    if code != ExitCode.STOPPED:
        why = "no stop line from the agent" if not result.stop_event else f"exit {code}"
        return False, (
            f"the job did not stop with exit 75 ({why}); it must save and exit 75 on the stop file or "
            "SIGTERM "
            "(docs/job-contract.md, Stopping)"
        )
    return True, f"notice at step {result.notice_step}/{total}, stopped at {stopped}/{total} with exit 75"


def final_accuracy(result: DemoResult) -> float | None:
    final = result.metrics.get("final")
    source = final if isinstance(final, dict) else result.metrics
    value = source.get("val_accuracy")
    return float(value) if isinstance(value, (int, float)) else None


def checks(result: DemoResult) -> list[Check]:
    lost = steps_lost(result)
    checkpoint = result.stop_event.get("checkpoint_step")
    notice_to_confirmed = result.stop_confirmed_at - result.notice_at if result.stop_confirmed_at else None
    accuracy = final_accuracy(result)
    names = {a.rsplit("/", 1)[-1] for a in result.artifacts}
    subjects = [a["Subject"] for a in result.alerts]
    mid_run, mid_run_detail = interrupted_mid_run(result)
    return [
        Check(
            "user-data renders, is valid and fits",
            result.user_data_bytes < USER_DATA_LIMIT_BYTES,
            f"{result.user_data_bytes} bytes; {result.user_data_valid}",
        ),
        Check("the notice interrupted the job mid-run", mid_run, mid_run_detail),
        Check(
            "instance 1 stopped with a confirmed checkpoint",
            mid_run
            and bool(result.stop_event.get("checkpoint_confirmed"))
            and result.stop_event.get("exit_code") == ExitCode.STOPPED
            and result.exit_codes[:1] == [0],
            f"checkpoint step {checkpoint}, job exit {result.stop_event.get('exit_code')}, "
            f"agent exit {result.exit_codes[:1]}",
        ),
        # Nothing was lost only means something when there was something to lose.
        Check("steps lost = 0", mid_run and lost == 0, f"{lost}" if mid_run else f"{lost}, not interrupted"),
        Check(
            "checkpoint confirmed within the 2-minute notice",
            notice_to_confirmed is not None and notice_to_confirmed < 120,
            f"{notice_to_confirmed:.1f}s" if notice_to_confirmed is not None else "never",
        ),
        Check(
            "instance 2 resumed at the checkpoint step",
            result.resumed_step is not None and result.resumed_step == checkpoint,
            f"resumed at {result.resumed_step}, checkpoint {checkpoint}",
        ),
        Check("instance 2 completed", result.exit_codes[1:] == [0], f"agent exit {result.exit_codes[1:]}"),
        *(
            [
                # The L4 life's bf16 checkpoint continues in the T4's fp16 (a fresh loss scaler).
                Check(
                    "instance 2 resumed across precisions",
                    " -> " in result.resumed_as and "precision" in result.resumed_as,
                    result.resumed_as.split(": ", 1)[-1] or "no precision change seen",
                ),
                Check(
                    f"final accuracy ≥ {MIN_ACCURACY}",
                    accuracy is not None and accuracy >= MIN_ACCURACY,
                    f"{accuracy}",
                ),
                Check(
                    "artifacts in S3",
                    {"model.pt", "metrics.json"} <= names,
                    ", ".join(sorted(names)) or "none",
                ),
            ]
            if result.job_name is None
            # A user's job decides what it writes: its output directory must have reached S3.
            else [Check("results in S3", bool(names), ", ".join(sorted(names)) or "none")]
        ),
        Check(
            "group scaled to zero",
            result.desired_capacity == 0,
            f"desired capacity {result.desired_capacity}",
        ),
        Check(
            "completion notification sent",
            any("training completed" in s for s in subjects),
            "; ".join(subjects),
        ),
        Check(
            "ledger counts one interruption",
            result.ledger.get("interruptions") == 1,
            f"interruptions {result.ledger.get('interruptions')}, status {result.ledger.get('status')}",
        ),
    ]


def print_timeline(result: DemoResult, console: Console) -> None:
    t0 = result.started
    table = Table(title="Spot interruption, resume, completion", show_lines=False)
    table.add_column("t (s)", justify="right")
    table.add_column("what happened", overflow="fold")
    rows: list[tuple[float, str]] = []
    checkpoint = result.stop_event.get("checkpoint_step")
    total = result.total_steps
    first = [s for s in result.samples if s.instance == "instance-1"]
    if first:
        rows.append((first[0].time, f"instance 1 trains: first reported step {first[0].step}/{total}"))
    if result.notice_at:
        rows.append(
            (
                result.notice_at,
                "spot interruption notice injected into IMDS (spot/instance-action); "
                f"the trainer had reported step {result.notice_step}/{total}",
            )
        )
    if result.notice_seen_at:
        rows.append((result.notice_seen_at, "the agent's IMDS poll finds the notice and stops the trainer"))
    if result.trainer_stopped_at:
        rows.append(
            (
                result.trainer_stopped_at,
                f"the trainer finishes step {result.trainer_stopped_step}, saves it and exits (75)",
            )
        )
    if result.stop_confirmed_at:
        rows.append(
            (result.stop_confirmed_at, f"checkpoint step {checkpoint} confirmed in S3; instance 1 done")
        )
    if result.instance2_booted_at:
        device = result.devices[1] if len(result.devices) > 1 else "other type"
        rows.append((result.instance2_booted_at, f"instance 2 (replacement: {device}; other AZ) boots"))
    if result.resumed_at:
        rows.append((result.resumed_at, f"instance 2 resumes at step {result.resumed_step}/{total}"))
    second = [s for s in result.samples if s.instance == "instance-2"]
    if second:
        rows.append((second[-1].time, f"instance 2 reaches step {second[-1].step}/{total}"))
    for moment, text in sorted(rows):
        table.add_row(f"{moment - t0:.1f}", text)
    console.print(table)
    summary = Table(show_header=False, box=None)
    summary.add_column("what")
    summary.add_column("value", overflow="fold")
    summary.add_row("steps lost", str(steps_lost(result)))
    for number, device in enumerate(result.devices, start=1):
        summary.add_row(f"instance {number} precision", device)
    if result.resumed_as:
        summary.add_row("resumed as", result.resumed_as)
    if result.stop_confirmed_at:
        summary.add_row(
            "notice → checkpoint confirmed", f"{result.stop_confirmed_at - result.notice_at:.1f}s"
        )
    if result.resumed_at:
        summary.add_row(
            "replacement boot → training resumed", f"{result.resumed_at - result.instance2_booted_at:.1f}s"
        )
        summary.add_row("notice → training resumed", f"{result.resumed_at - result.notice_at:.1f}s")
    if result.job_name is None:
        summary.add_row("final validation accuracy", str(final_accuracy(result)))
    summary.add_row("artifacts", "\n".join(result.artifacts))
    summary.add_row("group desired capacity", str(result.desired_capacity))
    summary.add_row("estimated cost", cost_line(result.ledger))
    console.print(summary)
    console.print(lives_table([("job", result.ledger)]))


def lives_table(ledgers: Sequence[tuple[str, dict[str, Any]]]) -> Table:
    """Every life of each (label, ledger): its instance, how it ended, how long after its start its trainer
    took its first step (what streaming shortens) and its mean data wait; "–" where it measured none (a
    job that reports no progress, a life that never trained)."""
    table = Table(title="lives: time to first step and data wait")
    for column in ("job", "instance", "type", "outcome"):
        table.add_column(column)
    table.add_column("first step after", justify="right")
    table.add_column("data wait", justify="right")
    for label, ledger in ledgers:
        found = ledger.get("lives")
        for life in map(Life.from_json, found if isinstance(found, list) else []):
            if life is None:
                continue
            table.add_row(
                label,
                life.instance_id or "?",
                life.instance_type or "?",
                life.outcome,
                first_step_text(life.first_step_seconds),
                data_wait_text(life.data_wait_fraction),
            )
    return table


def cost_line(ledger: dict[str, Any]) -> str:
    """`$0.0034 for 31 s of instance time at simulated spot prices (g6.xlarge $0.38/h, ...)`."""
    lives = ledger.get("lives") or []
    seconds = sum(_seconds(life) for life in lives)
    prices = {
        life["instance_type"]: life["price_usd_per_hour"]
        for life in lives
        if life.get("price_usd_per_hour") is not None
    }
    listed = ", ".join(f"{name} ${price:.2f}/h" for name, price in prices.items())
    return (
        f"${float(ledger.get('total_cost_usd') or 0):.4f} for {seconds:.0f} s of instance time "
        f"at simulated spot prices ({listed or 'none known'})"
    )


def _seconds(life: dict[str, Any]) -> float:
    try:
        start = datetime.fromisoformat(str(life["started_at"]).replace("Z", "+00:00"))
        end = datetime.fromisoformat(str(life["ended_at"]).replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return 0.0
    return max(0.0, (end - start).total_seconds())


def plot_timeline(result: DemoResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result.started
    figure, axes = plt.subplots(figsize=(9, 4))
    for instance, colour in (("instance-1", "tab:blue"), ("instance-2", "tab:green")):
        steps = [s for s in result.samples if s.instance == instance]
        axes.plot(
            [s.time - t0 for s in steps], [s.step for s in steps], marker=".", color=colour, label=instance
        )
    mark_interruption(
        axes,
        t0,
        notice_at=result.notice_at or None,
        confirmed_at=result.stop_confirmed_at or None,
        checkpoint=result.stop_event.get("checkpoint_step"),
        resumed_at=result.resumed_at or None,
        resumed_step=result.resumed_step,
        resumed_colour="tab:green",
    )
    axes.set_xlabel("seconds since the demo started")
    axes.set_ylabel("training step")
    axes.set_title(f"trainstack demo: steps lost = {steps_lost(result)}")
    axes.legend(loc="lower right")
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def mark_interruption(
    axes: Any,
    t0: float,
    *,
    notice_at: float | None,
    confirmed_at: float | None,
    checkpoint: Any,
    resumed_at: float | None,
    resumed_step: int | None,
    resumed_colour: str,
) -> None:
    """On a steps-over-time plot: the spot notice, the checkpoint confirmed in S3, the step resumed at."""
    if notice_at:
        axes.axvline(notice_at - t0, color="tab:red", linestyle="--", label="spot notice")
    if confirmed_at and checkpoint is not None:
        axes.scatter(
            [confirmed_at - t0],
            [checkpoint],
            color="tab:red",
            zorder=3,
            label=f"checkpoint step {checkpoint} confirmed",
        )
    if resumed_at and resumed_step is not None:
        axes.scatter(
            [resumed_at - t0],
            [resumed_step],
            color=resumed_colour,
            marker="s",
            zorder=3,
            label=f"resumed at step {resumed_step}",
        )
