"""The multi-node demo's verdict: its checks, the timeline (time, node, what happened, world size), a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bootstrap.cloud_init import USER_DATA_LIMIT_BYTES
from demo.multinode import COMPLETE_LINE, INTERRUPTED, NODES, STOPPED_LINE, MultiNodeResult
from demo.report import LENGTHEN, MIN_ACCURACY, Check, cost_line, lives_table
from trainstack_job.contract import ExitCode, JobStatus, LifeOutcome

REPLACEMENT = f"node-{NODES + 1}"
# Who should end how: the interrupted node goes, the survivor and the replacement finish the job together.
EXPECTED_LIVES = [
    ("node-1", LifeOutcome.COMPLETED.value),
    (INTERRUPTED, LifeOutcome.PREEMPTED.value),
    (REPLACEMENT, LifeOutcome.COMPLETED.value),
]
EXPECTED_WORLD_SIZES = [NODES, 1, NODES]


def steps_lost(result: MultiNodeResult) -> int | None:
    """The highest step any node reported before the stop minus the step the next generation resumed at."""
    if result.reached_before_stop is None or result.resumed_step is None:
        return None
    return result.reached_before_stop - result.resumed_step


def steps_lost_at_join(result: MultiNodeResult) -> int | None:
    """The same across torch's restart of every rank when the replacement joined the running generation."""
    if result.reached_before_join is None or result.rejoined_step is None:
        return None
    return result.reached_before_join - result.rejoined_step


def interrupted_mid_run(result: MultiNodeResult) -> tuple[bool, str]:
    """The notice came before the last step and every rank stopped early: the interrupted node's trainer
    exited 75 at a step before the end. A job that completed first fails, naming what to change."""
    total, stopped = result.total_steps, result.stopped_step
    # The agent's stop line (bootstrap/supervisor.py) says how the trainer ended: exit 75, 0, a signal.
    event = next(
        (e for e in result.events if e.node == INTERRUPTED and e.stage == "stop" and "exit_code" in e.fields),
        None,
    )
    code = event.fields.get("exit_code") if event is not None else None
    if not result.notice_at:
        return False, f"no notice was injected: the job finished before the demo's point; {LENGTHEN}"
    if total > 0 and result.notice_step >= total:
        return False, f"the notice came at the job's last step ({result.notice_step}/{total}); {LENGTHEN}"
    if code == ExitCode.COMPLETED or (total > 0 and stopped is not None and stopped >= total):
        return False, f"the job finished before the notice: {LENGTHEN} (exit {code}, step {stopped}/{total})"
    if code != ExitCode.STOPPED or stopped is None:
        return False, f"{INTERRUPTED}'s trainer did not stop with exit 75 (exit {code}, step {stopped})"
    return True, f"notice at step {result.notice_step}/{total}, ranks stopped at {stopped}/{total}, exit 75"


def final_accuracy(metrics: dict[str, Any]) -> float | None:
    final = metrics.get("final")
    source = final if isinstance(final, dict) else metrics
    value = source.get("val_accuracy")
    return float(value) if isinstance(value, (int, float)) else None


def world_sizes(result: MultiNodeResult) -> str:
    return " → ".join(str(size) for _, size in result.world_sizes) or "none seen"


def lives_by_node(result: MultiNodeResult) -> list[tuple[str, str]]:
    """(node, outcome) of every life in the ledger, the node found by its instance id, in node order."""
    names = {node.instance_id: node.name for node in result.nodes}
    lives = result.ledger.get("lives") or []
    found = [
        (names.get(life.get("instance_id"), str(life.get("instance_id"))), str(life.get("outcome")))
        for life in lives
    ]
    return sorted(found)


def checks(result: MultiNodeResult) -> list[Check]:
    lost, lost_at_join = steps_lost(result), steps_lost_at_join(result)
    accuracy = final_accuracy(result.metrics)
    names = {a.rsplit("/", 1)[-1] for a in result.artifacts}
    completed = [a["Subject"] for a in result.alerts if "training completed" in a["Subject"]]
    lives = lives_by_node(result)
    codes = {node.name: node.exit_code for node in result.nodes}
    mid_run, mid_run_detail = interrupted_mid_run(result)
    return [
        Check(
            "user-data renders, is valid and fits",
            result.user_data_bytes < USER_DATA_LIMIT_BYTES,
            f"{result.user_data_bytes} bytes; {result.user_data_valid}",
        ),
        Check("the notice interrupted the job mid-run", mid_run, mid_run_detail),
        Check(
            f"every agent exited 0 ({NODES + 1} nodes)",
            len(codes) == NODES + 1 and all(code == 0 for code in codes.values()),
            ", ".join(f"{name} {code}" for name, code in codes.items()),
        ),
        Check(
            "the stop was confirmed in S3 at the step every rank stopped at",
            result.stop_confirmed
            and result.stopped_step is not None
            and result.confirmed_step == result.stopped_step,
            f"every rank stopped at {result.stopped_step}; {INTERRUPTED}'s agent saw S3 confirm "
            f"{result.confirmed_step}",
        ),
        Check(
            "steps lost = 0",
            lost == 0,
            f"{lost} (highest step reported {result.reached_before_stop}, next generation resumed at "
            f"{result.resumed_step})",
        ),
        Check(
            "steps lost = 0 when the replacement joined",
            lost_at_join == 0,
            f"{lost_at_join} (highest step reported {result.reached_before_join}, the round of "
            f"{NODES} resumed at {result.rejoined_step})",
        ),
        Check(
            "world sizes 2, then 1, then 2",
            [size for _, size in result.world_sizes] == EXPECTED_WORLD_SIZES,
            world_sizes(result),
        ),
        Check(
            f"final accuracy ≥ {MIN_ACCURACY}",
            accuracy is not None and accuracy >= MIN_ACCURACY,
            f"{accuracy}",
        ),
        Check("results in S3", {"model.pt", "metrics.json"} <= names, ", ".join(sorted(names)) or "none"),
        Check(
            "group scaled to zero",
            result.desired_capacity == 0,
            f"desired capacity {result.desired_capacity}",
        ),
        Check(
            "exactly one 'training completed' notification",
            len(completed) == 1,
            "; ".join(a["Subject"] for a in result.alerts) or "none",
        ),
        Check(
            f"ledger: {NODES + 1} lives (preempted, completed, completed)",
            lives == EXPECTED_LIVES and result.ledger.get("status") == JobStatus.COMPLETED.value,
            ", ".join(f"{name} {outcome}" for name, outcome in lives)
            + f"; job {result.ledger.get('status')}",
        ),
    ]


def _rows(result: MultiNodeResult) -> list[tuple[float, str, str, str]]:
    """(time, node, what happened, world size) for each moment of the story worth a line."""
    total = result.total_steps
    rows: list[tuple[float, str, str, str]] = []
    for node in result.nodes:
        what = "boots (replacement launched by the group)" if node.name == REPLACEMENT else "boots"
        rows.append((node.booted_at, node.name, f"{what}: {node.instance_id}, local-ipv4 127.0.0.1", ""))
        if node.exited_at:
            rows.append((node.exited_at, node.name, f"agent exits {node.exit_code}", ""))
    for event in result.events:
        fields = event.fields
        if event.stage == "rendezvous":
            keys = ("generation", "endpoint", "stopped_step", "world_size")
            detail = ", ".join(f"{k.replace('_', ' ')} {fields[k]}" for k in keys if k in fields)
            rows.append(
                (event.time, event.node, f"{event.message} ({detail})" if detail else event.message, "")
            )
        elif event.stage == "interruption":
            rows.append(
                (
                    event.time,
                    event.node,
                    f"its agent's IMDS poll finds a {event.message}",
                    "",
                )
            )
        elif "trainer stopped" in event.message:
            rows.append(
                (
                    event.time,
                    event.node,
                    f"{event.message}: step {fields.get('checkpoint_step')} "
                    f"(its ranks stopped at {fields.get('newest_local_step')})",
                    "",
                )
            )
        elif event.stage == "end":
            rows.append((event.time, event.node, event.message, ""))
    for moment in result.rounds:
        start = f"resumes at step {moment.resumed_step}" if moment.resumed_step else "starts at step 0"
        rows.append(
            (moment.time, moment.node, f"global rank 0 here: a round {start}", str(moment.world_size))
        )
    for line in result.lines:
        stopped, complete = STOPPED_LINE.search(line.line), COMPLETE_LINE.search(line.line)
        if stopped:
            rows.append(
                (line.time, line.node, f"rank 0 stopped at step {stopped.group(1)} with its checkpoint", "")
            )
        elif complete:
            rows.append((line.time, line.node, f"training complete: {complete.group(1)} steps", ""))
    if result.notice_at:
        rows.append(
            (
                result.notice_at,
                INTERRUPTED,
                "spot interruption notice injected into its IMDS; the group lets it go and launches a "
                f"replacement (rank 0 had reported step {result.notice_step}/{total})",
                "",
            )
        )
    # The first and last progress each node's rank 0 reported in each world size.
    shown: dict[tuple[str, int | None], int] = {}
    for index, sample in enumerate(result.samples):
        shown.setdefault((sample.node, sample.world_size), index)
    last = {(s.node, s.world_size): i for i, s in enumerate(result.samples)}
    for index in sorted({*shown.values(), *last.values()}):
        sample = result.samples[index]
        size = "" if sample.world_size is None else str(sample.world_size)
        rows.append((sample.time, sample.node, f"rank 0 reports step {sample.step}/{total}", size))
    return sorted(rows, key=lambda row: row[0])


def print_timeline(result: MultiNodeResult, console: Console) -> None:
    table = Table(title="Two nodes, one job: spot notice on one, regroup, a replacement joins")
    table.add_column("t (s)", justify="right")
    table.add_column("node")
    table.add_column("what happened", overflow="fold")
    table.add_column("world size", justify="right")
    for moment, node, what, size in _rows(result):
        table.add_row(f"{moment - result.started:.1f}", node, escape(what), size)
    console.print(table)
    summary = Table(show_header=False, box=None)
    summary.add_column("what")
    summary.add_column("value", overflow="fold")
    summary.add_row("steps lost", str(steps_lost(result)))
    summary.add_row("steps lost when the replacement joined", str(steps_lost_at_join(result)))
    summary.add_row("world sizes over time", world_sizes(result))
    if result.stop_confirmed_at and result.notice_at:
        summary.add_row(
            "notice → stop confirmed in S3", f"{result.stop_confirmed_at - result.notice_at:.1f}s"
        )
    if result.resumed_at and result.notice_at:
        summary.add_row(
            "notice → training resumed on the survivor", f"{result.resumed_at - result.notice_at:.1f}s"
        )
    replacement = result.node(REPLACEMENT)
    if replacement and result.rejoined_at:
        summary.add_row(
            "replacement boot → training with it", f"{result.rejoined_at - replacement.booted_at:.1f}s"
        )
    summary.add_row("final validation accuracy", str(final_accuracy(result.metrics)))
    summary.add_row("artifacts", "\n".join(result.artifacts))
    summary.add_row("group desired capacity", str(result.desired_capacity))
    summary.add_row("estimated cost", cost_line(result.ledger))
    console.print(summary)
    console.print(lives_table([("job", result.ledger)]))


def plot_timeline(result: MultiNodeResult, path: Path) -> Path:
    """Steps over time per node above, the world size below, the notice as a line across both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result.started
    figure, (steps, sizes) = plt.subplots(
        2, 1, figsize=(9, 5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    colours = {"node-1": "tab:blue", INTERRUPTED: "tab:orange", REPLACEMENT: "tab:green"}
    for node in result.nodes:
        mine = [s for s in result.samples if s.node == node.name]
        if mine:
            steps.plot(
                [s.time - t0 for s in mine],
                [s.step for s in mine],
                marker=".",
                linestyle="none",
                color=colours.get(node.name),
                label=f"rank 0 on {node.name}",
            )
    for moment in result.rounds:
        steps.scatter([moment.time - t0], [moment.resumed_step], marker="s", color="black", zorder=3)
    if result.world_sizes:
        end = max([s.time for s in result.samples] or [result.world_sizes[-1][0]])
        times = [t - t0 for t, _ in result.world_sizes] + [end - t0]
        values = [size for _, size in result.world_sizes]
        sizes.step(times, [*values, values[-1]], where="post", color="tab:purple")
    for axes in (steps, sizes):
        if result.notice_at:
            axes.axvline(result.notice_at - t0, color="tab:red", linestyle="--")
        axes.grid(alpha=0.3)
    steps.set_ylabel("training step")
    steps.set_title(
        f"trainstack multi-node demo: steps lost = {steps_lost(result)}, world {world_sizes(result)}"
    )
    steps.legend(loc="lower right")
    sizes.set_ylabel("world size")
    sizes.set_yticks(range(1, NODES + 1))
    sizes.set_xlabel("seconds since the demo started (dashed: spot notice; squares: a round resumes)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def report(result: MultiNodeResult, console: Console) -> list[Check]:
    """Print the timeline and the summary, write the PNG; the checks, for the caller to print and judge."""
    console.rule("timeline")
    print_timeline(result, console)
    png = plot_timeline(result, result.workdir / "timeline.png")
    console.print(f"timeline plot: {png}")
    return checks(result)
