"""`python -m demo` (make demo): the whole spot story on this machine, no AWS account needed: a stack that
stays up, three jobs submitted with `trainstack run`: the built-in trainer interrupted by a spot notice and
resumed on another GPU type (the checkpoint crosses precisions), an example next on the same instance
without a reboot, interrupted and resumed in turn, a third cancelled before it runs, the group at zero
(demo/queue.py). `--queue` names the same story.

`python -m demo --job DIR`: your own job through one spot notice and a replacement (demo/run.py).

`python -m demo --nodes 2`: the same for one job trained on two instances at once (demo/multinode.py).

`python -m demo --rebalance`: a rebalance recommendation, the group's replacement waits as the job's warm
standby and takes over at a step boundary, one writer at a time (demo/rebalance.py).

`python -m demo --parallel`: two pools (2 lanes of g6.xlarge, 1 of g6e.xlarge); a 4-point sweep trains 2
points at once while 2 wait, a job asking for `--gpus L40S:1` runs on the other pool, a spot notice on one
point is resumed by its replacement while the other trains on, each pool at zero at the end
(demo/parallel.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

from demo.collector import ImportsFrozen

if TYPE_CHECKING:
    from demo.report import Check

# Only the demo's own folder is emptied: the README's trainer example keeps its files in .demo/.
DEFAULT_WORKDIR = Path(".demo/end-to-end")
MULTI_NODE_WORKDIR = Path(".demo/multi-node")
REBALANCE_WORKDIR = Path(".demo/rebalance")
PARALLEL_WORKDIR = Path(".demo/parallel")
# Piped or logged (CI), rich would assume 80 columns: tables get this width instead, and lines never wrap.
PIPED_WIDTH = 160


def demo_console() -> Console:
    """On a terminal: its width, long lines wrapped by the terminal. Piped: lines whole, tables 160 wide."""
    console = Console(soft_wrap=True)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPED_WIDTH
    return console


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__)
    parser.add_argument(
        "--workdir",
        type=Path,
        help=f"the demo's own folder, emptied at each run (default {DEFAULT_WORKDIR}; "
        f"{MULTI_NODE_WORKDIR} with --nodes 2, {REBALANCE_WORKDIR} with --rebalance, {PARALLEL_WORKDIR} "
        "with --parallel)",
    )
    parser.add_argument(
        "--job",
        type=Path,
        help="your own job through one spot notice and a replacement instead of the queue story: its folder "
        "or job file (e.g. examples/charlm)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="instances training the job at once: 1 (default) or 2 (spot notice on one, a replacement joins)",
    )
    parser.add_argument(
        "--rebalance",
        action="store_true",
        help="a rebalance recommendation instead of a spot notice: the group's replacement waits as the "
        "job's warm standby and takes over at a step boundary (built-in trainer, one node)",
    )
    parser.add_argument(
        "--parallel",
        action="store_true",
        help="several jobs at once: two pools, a 4-point sweep on a pool of 2 lanes (2 train, 2 wait), a job "
        "asking for an L40S on the other pool, a spot notice on one point (built-in trainer)",
    )
    parser.add_argument(
        "--queue",
        action="store_true",
        help="the default story, named: jobs submitted with `trainstack run` to a stack that stays up, the "
        "built-in trainer and an example each through a spot notice, a third cancelled",
    )
    args = parser.parse_args(argv)
    # This process serves every AWS call of the story and runs the CLI: its imports stay out of the way of
    # its full garbage collections (demo/collector.py).
    ImportsFrozen().watch()
    console = demo_console()
    refused = (
        _refuse_nodes(args.nodes, args.job)
        or _refuse_rebalance(args.rebalance, args.nodes, args.job)
        or _refuse_queue(args.queue, args.nodes, args.job, args.rebalance)
        or _refuse_parallel(args.parallel, args.nodes, args.job, args.rebalance, args.queue)
    )
    if refused:
        console.print(f"[bold red]error:[/] {escape(refused)}", highlight=False)
        return 2
    multi_node = args.nodes > 1
    job_file = job_file_of(args.job) if args.job is not None else None
    if job_file is not None:
        from trainstack_job.jobfile import JobSpecError, load_job_spec

        try:
            load_job_spec(job_file)
        except JobSpecError as exc:
            for problem in exc.problems:
                console.print(f"[bold red]job error:[/] {escape(problem)}", highlight=False)
            return 2

    from demo.run import ISOLATED_ENV

    # Before boto3 is used anywhere: fake credentials, no profile, nothing but 127.0.0.1.
    os.environ.update(ISOLATED_ENV)
    os.environ.pop("AWS_PROFILE", None)
    from demo.moto_server import moto_server

    default_workdir = (
        PARALLEL_WORKDIR
        if args.parallel
        else REBALANCE_WORKDIR
        if args.rebalance
        else MULTI_NODE_WORKDIR
        if multi_node
        else DEFAULT_WORKDIR
    )
    workdir = (args.workdir or default_workdir).resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    if args.parallel:
        from demo.parallel import ParallelDemo
        from demo.report_parallel import report as parallel_report

        console.rule(
            "trainstack local parallel demo: two pools, several jobs at once, embedded S3/KMS/SNS/Auto "
            "Scaling (moto) + a simulated IMDS per instance"
        )
        try:
            with moto_server() as endpoint:
                os.environ["AWS_ENDPOINT_URL"] = endpoint
                parallel = ParallelDemo(workdir, console).run()
        except Exception as exc:
            console.print(f"[bold red]demo failed:[/] {type(exc).__name__}: {escape(str(exc))}")
            return 1
        return _verdict(parallel_report(parallel, console), console)
    if args.rebalance:
        from demo.rebalance import RebalanceDemo
        from demo.report_rebalance import report as rebalance_report

        console.rule(
            "trainstack local rebalance demo: a warm standby takes over, embedded S3/KMS/SNS/Auto Scaling "
            "(moto) + a simulated IMDS per instance"
        )
        try:
            with moto_server() as endpoint:
                os.environ["AWS_ENDPOINT_URL"] = endpoint
                handed_over = RebalanceDemo(workdir, console).run()
        except Exception as exc:
            console.print(f"[bold red]demo failed:[/] {type(exc).__name__}: {escape(str(exc))}")
            return 1
        return _verdict(rebalance_report(handed_over, console), console)
    if multi_node:
        from demo.multinode import MultiNodeDemo
        from demo.report_multinode import report

        console.rule(
            f"trainstack local multi-node demo: {args.nodes} simulated instances over gloo on 127.0.0.1, "
            "embedded S3/KMS/SNS/Auto Scaling (moto)"
        )
        try:
            with moto_server() as endpoint:
                os.environ["AWS_ENDPOINT_URL"] = endpoint
                multi = MultiNodeDemo(workdir, console).run()
        except Exception as exc:
            console.print(f"[bold red]demo failed:[/] {type(exc).__name__}: {escape(str(exc))}")
            return 1
        return _verdict(report(multi, console), console)
    if job_file is not None:
        from demo.report import checks, plot_timeline, print_timeline
        from demo.run import Demo

        console.rule(
            "trainstack local demo of your job: embedded S3/KMS/SNS/Auto Scaling (moto) + simulated IMDS"
        )
        try:
            with moto_server() as endpoint:
                os.environ["AWS_ENDPOINT_URL"] = endpoint
                result = Demo(workdir, console, job_file).run()
        except Exception as exc:
            console.print(f"[bold red]demo failed:[/] {type(exc).__name__}: {escape(str(exc))}")
            return 1
        console.rule("timeline")
        print_timeline(result, console)
        png = plot_timeline(result, workdir / "timeline.png")
        console.print(f"timeline plot: {png}")
        return _verdict(checks(result), console)
    from demo.queue import QueueDemo
    from demo.report_queue import plot_timeline as plot_queue
    from demo.report_queue import report as queue_report

    console.rule(
        "trainstack local demo: jobs submitted with `trainstack run` to a stack that stays up, "
        "embedded S3/KMS/SNS/Auto Scaling (moto) + a simulated IMDS"
    )
    try:
        with moto_server() as endpoint:
            os.environ["AWS_ENDPOINT_URL"] = endpoint
            queued = QueueDemo(workdir, console).run()
    except Exception as exc:
        console.print(f"[bold red]demo failed:[/] {type(exc).__name__}: {escape(str(exc))}")
        return 1
    found = queue_report(queued, console)
    console.print(f"timeline plot: {plot_queue(queued, workdir / 'timeline.png')}")
    return _verdict(found, console)


def job_file_of(job: Path) -> Path:
    """`--job`: a job file, or a folder holding job.yaml (`--job examples/charlm`)."""
    return job / "job.yaml" if job.is_dir() else job


def _refuse_nodes(nodes: int, job: Path | None) -> str | None:
    """Why `--nodes` cannot run as asked (one line), or None."""
    if nodes < 1:
        return f"--nodes {nodes}: a demo needs at least one node"
    if nodes > 2:
        return f"--nodes {nodes}: the local demo runs 1 or 2 nodes (2 is the multi-node story it tests)"
    if nodes > 1 and job is not None:
        return "multi-node runs the built-in trainer; user jobs on several nodes are not supported yet"
    return None


def _refuse_rebalance(rebalance: bool, nodes: int, job: Path | None) -> str | None:
    """Why `--rebalance` cannot run as asked (one line), or None."""
    if not rebalance:
        return None
    if nodes > 1:
        # A multi-node job has no lease and no standby: its generation record is its single writer.
        return "--rebalance is the single-node story (lease and warm standby); leave out --nodes"
    if job is not None:
        return "--rebalance runs the built-in trainer (its gated start is the warm standby the story shows)"
    return None


def _refuse_queue(queue: bool, nodes: int, job: Path | None, rebalance: bool) -> str | None:
    """Why `--queue` cannot run as asked (one line), or None."""
    if not queue:
        return None
    if job is not None or nodes > 1 or rebalance:
        return (
            "--queue (the default story) submits its own jobs (the built-in trainer and two examples) on one "
            "node: leave out --job, --nodes and --rebalance"
        )
    return None


def _refuse_parallel(
    parallel: bool, nodes: int, job: Path | None, rebalance: bool, queue: bool
) -> str | None:
    """Why `--parallel` cannot run as asked (one line), or None."""
    if parallel and (job is not None or nodes > 1 or rebalance or queue):
        return (
            "--parallel submits its own jobs (a sweep of the built-in trainer and an L40S job) on "
            "one-instance lanes: leave out --job, --nodes, --rebalance and --queue"
        )
    return None


def _verdict(results: list[Check], console: Console) -> int:
    """Print the checks; 0 when every one passed, else 1."""
    console.rule("checks")
    for check in results:
        mark = "[green]PASS[/]" if check.passed else "[bold red]FAIL[/]"
        console.print(f"{mark} {escape(check.name)}: {escape(check.detail)}", highlight=False)
    failed = [c for c in results if not c.passed]
    if failed:
        console.print(f"[bold red]{len(failed)} check(s) failed[/]")
        return 1
    console.print("[bold green]all checks passed[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
