"""Command line: parse arguments, pick stack and region, dispatch, and turn every failure into one line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from trainstack import (
    cancel,
    control,
    datapush,
    datasets,
    doctor,
    drill,
    estimate,
    jobs,
    logs,
    prices,
    run,
    secrets,
    session,
    status,
    top,
    transfer,
    weights,
)
from trainstack.aws import Clients, explain
from trainstack.dev import connect as dev_connect
from trainstack.dev import lifecycle as dev_lifecycle
from trainstack.errors import CliError
from trainstack.output import print_error
from trainstack.stack import Stack
from trainstack.sweep import DEFAULT_METRIC

# Commands that run before `pulumi up` read only the stack config; the rest need its outputs.
_CONFIG_ONLY = {"doctor", "prices", "estimate"}
# The default of --outputs: the dev box's `trainstack` (bootstrap/devbox/instance/install-cli.sh) names the
# outputs its user-data wrote, as the box has no Pulumi CLI.
OUTPUTS_ENV = "TRAINSTACK_OUTPUTS"


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_argument_group("stack")
    where.add_argument("--stack", "-s", help="Pulumi stack name (default: the selected stack)")
    where.add_argument(
        "--cwd", type=Path, default=Path(), help="directory holding Pulumi.yaml (default: the current one)"
    )
    where.add_argument(
        "--outputs",
        type=Path,
        metavar="FILE",
        default=Path(os.environ[OUTPUTS_ENV]) if os.environ.get(OUTPUTS_ENV) else None,
        help=f"stack outputs saved by `pulumi stack output --json > FILE` (default: ${OUTPUTS_ENV} if set)",
    )
    where.add_argument("--region", help="AWS region (default: the stack's)")
    json_flag = argparse.ArgumentParser(add_help=False)
    json_flag.add_argument("--json", action="store_true", help="machine-readable JSON on stdout")
    job_flag = argparse.ArgumentParser(add_help=False)
    job_flag.add_argument(
        "--job",
        metavar="ID",
        help="the job to read (default: the current one; `trainstack jobs` lists them, 'legacy' = from "
        "before jobs)",
    )

    parser = argparse.ArgumentParser(
        prog="trainstack",
        description="Run jobs on a trainstack spot-GPU training environment; check, watch, feed and stop it.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    both = [common, json_flag]
    commands.add_parser(
        "doctor",
        parents=both,
        help="check tools, credentials, region, quotas, AZs and AMI before `pulumi up`",
        description="Before the first `pulumi up`: checks the Pulumi CLI, the AWS CLI v2 and the Session "
        "Manager plugin (for shell/forward), AWS credentials, the stack's region, its instance types, the "
        "spot vCPU quota per GPU family, the AZs that offer the types and the AMI. One line per check with "
        "the fix; every check runs; exit 1 if any required one fails.",
    )
    commands.add_parser(
        "status", parents=[*both, job_flag], help="group, the job's progress, latest checkpoint and cost"
    )
    jobs_parser = commands.add_parser(
        "jobs",
        parents=both,
        help="every job of the stack: queued (with its place), running, ended; step, cost, age",
    )
    jobs_parser.add_argument(
        "--sweep", metavar="NAME", help="a sweep's jobs side by side, best final metric first"
    )
    jobs_parser.add_argument(
        "--metric",
        default=DEFAULT_METRIC,
        metavar="KEY",
        help=f"dotted key of each job's results/metrics.json to rank a sweep by (default {DEFAULT_METRIC}, "
        "the built-in trainer's validation accuracy)",
    )
    jobs_parser.add_argument(
        "--lower-is-better", action="store_true", help="rank the sweep by the lowest --metric (e.g. a loss)"
    )
    run_parser = commands.add_parser(
        "run",
        parents=both,
        help="submit a job to the running stack (no `pulumi up`) and follow it",
        description="Validates the job here (every problem, one line each), uploads its code bundle "
        "(content-addressed: once per code), writes its record and queue entry to the stack's bucket, scales "
        "the group up if it is at zero, then follows the job: a status line and its logs until it ends "
        "(exit 0 when it completed). Ctrl-C stops following, never the job. Never changes the launch "
        "template or Pulumi state.",
    )
    run_parser.add_argument(
        "job_file", nargs="?", type=Path, metavar="JOB.yaml", help="a user's job file (docs/job-contract.md)"
    )
    run_parser.add_argument(
        "--config", type=Path, metavar="TRAINING.yaml", help="run the built-in trainer with this config"
    )
    run_parser.add_argument(
        "--name", metavar="NAME", help="the job's name (default: the job file's, else the config's file name)"
    )
    run_parser.add_argument(
        "--detach", action="store_true", help="print the job id and return (--json implies it)"
    )
    run_parser.add_argument(
        "--now",
        action="store_true",
        help="ahead of the queue: a live instance runs it after its current job checkpoints and yields",
    )
    run_parser.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="queue one job per point of the grid (repeatable): dotted trainer-config keys "
        "(train.lr=0.1,0.03) or, for a user's job, environment variables (LR=0.1,0.03)",
    )
    run_parser.add_argument(
        "--data",
        metavar="DATASET",
        help="a dataset pushed with `trainstack data push DIR --name DATASET`: the job trains on its current "
        "version (default: the default dataset, the version current when the job starts)",
    )
    run_parser.add_argument(
        "--instances",
        type=int,
        metavar="N",
        help="instances the built-in trainer's job trains on (default: trainstack:instanceCount; at most the "
        "group's maximum)",
    )
    run_parser.add_argument(
        "--pool",
        metavar="POOL",
        help="run on this pool of trainstack:pools (default: the pool that serves the job's resources, else "
        "the default pool)",
    )
    run_parser.add_argument(
        "--gpus",
        metavar="MODEL:N",
        help="GPUs per instance, e.g. L4:1 or A100:8 (or a count, any model): the job runs on a pool whose "
        "every instance type has them; over the job file's `resources: gpus`",
    )
    run_parser.add_argument(
        "--priority",
        type=int,
        default=0,
        metavar="N",
        help="higher runs first in its pool's queue, FIFO within one priority (default 0; --now goes first)",
    )
    run_parser.add_argument(
        "--parallel",
        type=int,
        metavar="K",
        help="with --sweep: at most K of its points train at once (default: as many as its pool's lanes)",
    )
    run_parser.add_argument(
        "--min-gpu-memory-gb",
        type=float,
        metavar="GB",
        help="memory each GPU needs at least, e.g. 24 (over the job file's `resources: min_gpu_memory_gb`)",
    )
    cancel_parser = commands.add_parser(
        "cancel",
        parents=both,
        help="cancel a job: a queued one never runs, a running one checkpoints then stops",
    )
    cancel_parser.add_argument("job_id", metavar="ID", help="the job's id (`trainstack jobs` lists them)")
    logs_parser = commands.add_parser("logs", parents=[*both, job_flag], help="the job's CloudWatch logs")
    logs_parser.add_argument(
        "-f", "--follow", action="store_true", help="keep printing new events until Ctrl-C"
    )
    logs_parser.add_argument(
        "--since", default="1h", help="how far back to start: 30s, 10m, 2h, 1d (default 1h)"
    )
    logs_parser.add_argument(
        "--stream", metavar="PREFIX", help="only the job's streams starting with PREFIX (e.g. an instance id)"
    )

    data = commands.add_parser("data", help="the stack's datasets: push a folder as a new version, list them")
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    push = data_commands.add_parser(
        "push",
        parents=both,
        help="upload a folder of any files as a dataset's next version (only what changed is sent)",
        description="Sends the files of DIR whose size or sha256 differ from the dataset's current "
        "manifest, then writes the new manifest: the dataset's version is the hash of its files. Checked as "
        "an ImageFolder (DIR/train/<class>/<image>, DIR/val/<class>/<image>) only when the built-in trainer "
        "reads it.",
    )
    push.add_argument("dir", type=Path, metavar="DIR", help="the folder whose files make the dataset")
    push.add_argument(
        "--name",
        default="",
        metavar="DATASET",
        help="a named dataset under datasets/DATASET/ (default: the stack's dataset under data/)",
    )
    push.add_argument(
        "--delete", action="store_true", help="remove the dataset's objects for files DIR no longer has"
    )
    push.add_argument(
        "--dry-run", action="store_true", help="say what would be uploaded and deleted; change nothing"
    )
    push.add_argument("--force", action="store_true", help="push even while a job trains on this dataset")
    push.add_argument(
        "--layout",
        choices=datapush.LAYOUTS,
        default="auto",
        help="check DIR as an ImageFolder: auto (when the built-in trainer reads the dataset), "
        "image-folder (always) or any (never)",
    )
    push.add_argument(
        "--format",
        choices=datapush.FORMATS,
        default="files",
        help="files: DIR's files as they are; shards: an ImageFolder as tar shards plus an index, which the "
        "built-in trainer streams instead of syncing the whole dataset first",
    )
    data_commands.add_parser(
        "list", parents=both, help="the stack's datasets: version, files, size, when pushed"
    )

    results = commands.add_parser("results", help="the trained model, metrics and plots")
    results_commands = results.add_subparsers(dest="results_command", required=True, metavar="ACTION")
    pull = results_commands.add_parser(
        "pull", parents=[*both, job_flag], help="download the job's results (default into ./results)"
    )
    pull.add_argument("dir", type=Path, nargs="?", default=Path("results"), metavar="DIR")

    prices_parser = commands.add_parser(
        "prices", parents=both, help="spot price per AZ beside on-demand, cheapest first"
    )
    prices_parser.add_argument(
        "--type",
        "-t",
        action="append",
        dest="types",
        metavar="TYPE",
        help="instance type (repeatable; default: trainstack:instanceTypes)",
    )
    prices_parser.add_argument(
        "--days", type=float, default=1.0, help="price history window in days, at most 90 (default 1)"
    )
    estimate_parser = commands.add_parser(
        "estimate",
        parents=both,
        help="projected job cost per instance type, and the types ranked by $ per 1,000 useful steps",
        description="Before `pulumi up`: instance count x expected hours (trainstack:expectedHours) x "
        "today's spot price (cheapest AZ) and on-demand price of each configured type, the cheapest and the "
        "most expensive, beside the cost cap trainstack:maxCostUsd; then the types ranked by expected $ per "
        "1,000 useful steps: spot price / throughput, less the work interruptions waste at the trainer's "
        "Young/Daly checkpoint interval.",
    )
    for priced in (prices_parser, estimate_parser):
        priced.add_argument(
            "--offline",
            action="store_true",
            help="the shipped offline catalogue's dated prices, not AWS's (also used with no credentials)",
        )
        priced.add_argument(
            "--placement-scores",
            action="store_true",
            dest="placement_scores",
            help="also read GetSpotPlacementScores as each type's interruption risk "
            "(needs ec2:GetSpotPlacementScores)",
        )

    estimate_parser.add_argument(
        "job",
        nargs="?",
        type=Path,
        metavar="JOB",
        help="a job file or training config (as for `trainstack run`): rank the types of the pool it "
        "would run on, for its model and batch (default: the stack's default pool)",
    )
    estimate_parser.add_argument(
        "--hours", type=float, metavar="H", help="expected job hours (default: trainstack:expectedHours)"
    )
    estimate_parser.add_argument(
        "--markdown", action="store_true", help="a Markdown table (the pull-request comment)"
    )
    estimate_parser.add_argument(
        "--throughput",
        action="append",
        default=[],
        metavar="TYPE=STEPS_PER_S",
        help="a type's training steps per second (repeatable; default: trainstack_job/throughput.py)",
    )
    estimate_parser.add_argument(
        "--samples-per-step",
        type=float,
        metavar="N",
        help="samples per step, to turn the throughput module's samples/s into steps/s",
    )
    estimate_parser.add_argument(
        "--mtbi-hours",
        type=float,
        metavar="H",
        help="mean hours between interruptions for every type (default: $TRAINSTACK_MTBI_HOURS, else each "
        "type's placement score or catalogue band, else the 5-10%%/month band)",
    )
    estimate_parser.add_argument(
        "--checkpoint-seconds", type=float, metavar="S", help="what one checkpoint blocks training for (30)"
    )
    estimate_parser.add_argument(
        "--restart-seconds", type=float, metavar="S", help="an interruption's replacement and restore (480)"
    )

    secrets_parser = commands.add_parser(
        "secrets",
        help="the job's secrets: SSM SecureString parameters under /trainstack/<stack>/",
        description="A job names its secrets in job.yaml (`secrets: {HF_TOKEN: hf-token}`); the agent reads "
        "them into the job's environment only. Values come from stdin, never the command line, and are never "
        "shown (docs/job-contract.md, Secrets).",
    )
    secrets_commands = secrets_parser.add_subparsers(dest="secrets_command", required=True, metavar="ACTION")
    secret_set = secrets_commands.add_parser(
        "set",
        parents=both,
        help="store NAME's value, read from stdin, as a SecureString with the stack's KMS key",
    )
    secret_set.add_argument("name", metavar="NAME", help="the secret's name under /trainstack/<stack>/")
    secret_set.add_argument("--overwrite", action="store_true", help="replace an existing value")
    secrets_commands.add_parser("list", parents=both, help="names and last-modified dates, never values")
    secret_delete = secrets_commands.add_parser("delete", parents=both, help="delete NAME's parameter")
    secret_delete.add_argument("name", metavar="NAME", help="the secret's name under /trainstack/<stack>/")

    shell = commands.add_parser("shell", parents=[common], help="SSM Session Manager shell on an instance")
    shell.add_argument("--instance", metavar="ID", help="instance id (default: the first in service)")
    forward = commands.add_parser(
        "forward", parents=[common], help="forward a local port to an instance (SSM)"
    )
    forward.add_argument(
        "port", type=int, metavar="PORT", help="port on the instance (Jupyter 8888, TensorBoard 6006)"
    )
    forward.add_argument("--local-port", type=int, metavar="PORT", help="local port (default: PORT)")
    forward.add_argument("--instance", metavar="ID", help="instance id (default: the first in service)")

    commands.add_parser("stop", parents=both, help="checkpoint the current job, then scale the group to zero")
    commands.add_parser(
        "resume",
        parents=both,
        help="withdraw the current job's stop and scale the group back to trainstack:instanceCount",
    )
    dev = commands.add_parser(
        "dev",
        help="a GPU dev box in the stack's VPC: up/down/destroy/status, editors over Session Manager",
        description="One interactive instance from the stack's dev template (no inbound port, IMDSv2, "
        "encrypted disk) with a workspace volume that outlives it; it stops itself when idle.",
    )
    dev_commands = dev.add_subparsers(dest="dev_command", required=True, metavar="ACTION")
    dev_lifecycle.add_lifecycle_commands(dev_commands, parents=both)
    dev_connect.add_dev_connect_commands(dev_commands, parents=[common])
    top.add_top_command(commands, parents=both)
    weights.add_weights_command(commands, parents=both)
    drill_parser = commands.add_parser(
        "drill",
        parents=both,
        help="a real spot interruption of the job's instance (AWS FIS), then the timeline of its recovery",
        description="Starts the stack's AWS Fault Injection Service experiment (`pulumi config set "
        "trainstack:drill true && pulumi up` declares it): one of the group's running spot instances gets "
        "the two-minute interruption notice and is then interrupted, for real. Then it reads the job's own "
        "state and the agent's events and prints the timeline: notice → checkpoint confirmed → replacement "
        "(or standby) → resumed, the steps lost and the drill's cost. Exit 1 if the job did not keep its "
        "promise.",
    )
    drill_parser.add_argument(
        "--wait",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="wait for the interruption and the resume, then print the timeline (default); --no-wait starts "
        "the experiment and returns",
    )
    drill_parser.add_argument(
        "--timeout",
        type=float,
        default=drill.DEFAULT_TIMEOUT_MINUTES,
        metavar="MINUTES",
        help=f"how long to wait for training to resume (default {drill.DEFAULT_TIMEOUT_MINUTES:g})",
    )
    return parser


def _region(args: argparse.Namespace, stack: Stack) -> str | None:
    if args.region:
        return str(args.region)
    if args.command in _CONFIG_ONLY:
        return stack.config.region
    return stack.outputs.region or stack.config.region


def dispatch(args: argparse.Namespace, stack: Stack, clients: Clients) -> int:
    as_json = bool(getattr(args, "json", False))
    command = args.command
    if command == "doctor":
        return doctor.run(clients, stack, as_json=as_json)
    if command == "status":
        return status.run(clients, stack, as_json=as_json, job_id=args.job)
    if command == "jobs":
        return jobs.run(
            clients,
            stack,
            as_json=as_json,
            sweep=args.sweep,
            metric=args.metric,
            higher_is_better=not args.lower_is_better,
        )
    if command == "run":
        return run.run(clients, stack, args.prepared, as_json=as_json)
    if command == "cancel":
        return cancel.run(clients, stack, args.job_id, as_json=as_json)
    if command == "logs":
        return logs.run(
            clients,
            stack,
            since=args.since,
            stream=args.stream,
            follow_=args.follow,
            as_json=as_json,
            job_id=args.job,
        )
    if command == "data" and args.data_command == "list":
        return datasets.run_list(clients, stack, as_json=as_json)
    if command == "data":
        return datapush.run_push(
            clients,
            stack,
            args.dir,
            name=args.name,
            delete=args.delete,
            dry_run=args.dry_run,
            force=args.force,
            layout=args.layout,
            format=args.format,
            as_json=as_json,
        )
    if command == "results":
        return transfer.run_pull(clients, stack, args.dir, as_json=as_json, job_id=args.job)
    if command == "estimate":
        job = estimate.read_job(args.job, stack.config) if args.job is not None else None
        ranking = estimate.RankingInputs.from_flags(
            job.types if job else stack.config.instance_types,
            throughput=args.throughput,
            samples_per_step=args.samples_per_step
            if args.samples_per_step is not None or job is None
            else job.samples_per_step,
            family=job.family if job else None,
            mtbi_hours=args.mtbi_hours,
            checkpoint_seconds=args.checkpoint_seconds,
            restart_seconds=args.restart_seconds,
        )
        return estimate.run(
            clients,
            stack,
            hours=args.hours,
            as_json=as_json,
            as_markdown=args.markdown,
            offline=args.offline,
            scores=args.placement_scores,
            ranking=ranking,
            job=job,
        )
    if command == "prices":
        return prices.run(
            clients,
            stack,
            types=args.types,
            days=args.days,
            as_json=as_json,
            offline=args.offline,
            scores=args.placement_scores,
        )
    if command == "secrets":
        return secrets.run(
            clients,
            stack,
            args.secrets_command,
            name=getattr(args, "name", None),
            overwrite=bool(getattr(args, "overwrite", False)),
            as_json=as_json,
        )
    if command == "shell":
        return session.run(clients, stack, instance=args.instance)
    if command == "forward":
        return session.run(clients, stack, instance=args.instance, port=args.port, local_port=args.local_port)
    if command == "stop":
        return control.run_stop(clients, stack, as_json=as_json)
    if command == "resume":
        return control.run_resume(clients, stack, as_json=as_json)
    if command == "dev" and args.dev_command in dev_lifecycle.COMMANDS:
        return dev_lifecycle.run(clients, stack, args)
    if command == "dev" and args.dev_command in dev_connect.COMMANDS:
        return dev_connect.dispatch(args, stack, clients)
    if command == "top":
        return top.run(
            clients,
            stack,
            job_id=args.job,
            dev=args.dev,
            once=args.once,
            interval=args.interval,
            as_json=as_json,
        )
    if command == "weights":
        return weights.run(
            clients, stack, family=args.family, job=args.job, do_apply=args.apply, as_json=as_json
        )
    if command == "drill":
        return drill.run(clients, stack, wait=args.wait, as_json=as_json, timeout_minutes=args.timeout)
    raise CliError(f"unknown command {command!r}: see `trainstack --help`")


def _run_request(args: argparse.Namespace) -> run.RunRequest:
    return run.RunRequest(
        job_file=args.job_file,
        config_file=args.config,
        name=args.name,
        detach=args.detach or bool(args.json),
        now=args.now,
        sweeps=tuple(args.sweep),
        dataset=args.data,
        instances=args.instances,
        pool=args.pool,
        gpus=args.gpus,
        min_gpu_memory_gb=args.min_gpu_memory_gb,
        priority=args.priority,
        parallel=args.parallel,
    )


def main(argv: Sequence[str] | None = None, *, clients: Clients | None = None) -> int:
    """Entry point; `clients` lets tests hand in a factory with stubbed services."""
    args = build_parser().parse_args(argv)
    stack = Stack(args.stack, project_dir=args.cwd, outputs_file=args.outputs)
    try:
        if args.command == "run":
            # The job is checked before the stack's outputs or AWS are read: a typo needs neither.
            args.prepared = run.read_job(_run_request(args))
        factory = clients or Clients(None)
        return dispatch(args, stack, factory.with_region(_region(args, stack)))
    except run.InvalidJobError as invalid:
        return run.report_invalid(invalid)
    except CliError as error:
        print_error(str(error))
    except (BotoCoreError, ClientError) as error:
        print_error(str(explain(error)))
    except KeyboardInterrupt:
        print_error("interrupted")
        return 130
    except BrokenPipeError:
        # `trainstack logs | head`: the reader left; nothing to report.
        sys.stderr.close()
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
