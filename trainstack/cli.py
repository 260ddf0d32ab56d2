"""Command line: parse arguments, pick stack and region, dispatch, and turn every failure into one line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from trainstack import (
    control,
    doctor,
    drill,
    estimate,
    jobs,
    logs,
    prices,
    secrets,
    session,
    status,
    transfer,
)
from trainstack.aws import Clients, explain
from trainstack.errors import CliError
from trainstack.output import print_error
from trainstack.stack import Stack

# Commands that run before `pulumi up` read only the stack config; the rest need its outputs.
_CONFIG_ONLY = {"doctor", "prices", "estimate"}


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
        help="stack outputs saved by `pulumi stack output --json > FILE`",
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
        description="Check, watch, feed and stop a trainstack spot-GPU training environment.",
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
    commands.add_parser(
        "jobs",
        parents=both,
        help="every job in the stack's bucket: status, step, cost, age, which is current",
    )
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

    data = commands.add_parser("data", help="the training dataset in the stack's bucket")
    data_commands = data.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    push = data_commands.add_parser(
        "push", parents=both, help="upload an ImageFolder dataset (train/ and val/)"
    )
    push.add_argument(
        "dir",
        type=Path,
        metavar="DIR",
        help="the dataset folder: DIR/train/<class>/<image> and DIR/val/<class>/<image>, same classes",
    )
    push.add_argument("--force", action="store_true", help="replace the dataset even while training runs")
    push.add_argument(
        "--delete", action="store_true", help="remove objects under data/ that DIR does not have"
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
        "--days", type=float, default=1.0, help="price history window in days (default 1)"
    )

    estimate_parser = commands.add_parser(
        "estimate",
        parents=both,
        help="projected job cost per instance type, spot and on-demand, beside maxCostUsd",
        description="Before `pulumi up`: instance count x expected hours (trainstack:expectedHours) x "
        "today's spot price (cheapest AZ) and on-demand price of each configured type, the cheapest and the "
        "most expensive, beside the cost cap trainstack:maxCostUsd.",
    )
    estimate_parser.add_argument(
        "--hours", type=float, metavar="H", help="expected job hours (default: trainstack:expectedHours)"
    )
    estimate_parser.add_argument(
        "--markdown", action="store_true", help="a Markdown table (the pull-request comment)"
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
        return jobs.run(clients, stack, as_json=as_json)
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
    if command == "data":
        return transfer.run_push(
            clients, stack, args.dir, force=args.force, delete=args.delete, as_json=as_json
        )
    if command == "results":
        return transfer.run_pull(clients, stack, args.dir, as_json=as_json, job_id=args.job)
    if command == "estimate":
        return estimate.run(clients, stack, hours=args.hours, as_json=as_json, as_markdown=args.markdown)
    if command == "prices":
        return prices.run(clients, stack, types=args.types, days=args.days, as_json=as_json)
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
    if command == "drill":
        return drill.run(clients, stack, wait=args.wait, as_json=as_json, timeout_minutes=args.timeout)
    raise CliError(f"unknown command {command!r}: see `trainstack --help`")


def main(argv: Sequence[str] | None = None, *, clients: Clients | None = None) -> int:
    """Entry point; `clients` lets tests hand in a factory with stubbed services."""
    args = build_parser().parse_args(argv)
    stack = Stack(args.stack, project_dir=args.cwd, outputs_file=args.outputs)
    try:
        factory = clients or Clients(None)
        return dispatch(args, stack, factory.with_region(_region(args, stack)))
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
