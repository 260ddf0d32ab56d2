"""`trainstack dev up|down|destroy`: start the dev box from the stack's template, end it, drop its workspace.

The instance is disposable (terminated by `dev down`, by its own idle watcher, or by a spot reclaim); the
workspace volume (trainstack/dev/workspace.py) is not: every `dev up` launches in its zone and attaches it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

from botocore.exceptions import ClientError, WaiterError

from bootstrap.devbox.heartbeat import HEARTBEAT_KEY
from trainstack.aws import Clients, error_code
from trainstack.dev.instances import DEV_TAG, DevInstance, dev_box_name, find_dev_instance
from trainstack.dev.workspace import (
    DEFAULT_WORKSPACE_GB,
    WORKSPACE_TAG,
    Workspace,
    attach_workspace,
    create_workspace,
    delete_workspace,
    find_workspace,
    wait_for_volume,
)
from trainstack.errors import CliError
from trainstack.output import print_json
from trainstack.stack import Stack, StackOutputs
from trainstack_job.contract import StackOutput

# The instance tags the box's own side reads from IMDS (the template enables instance tags in metadata):
# how long it may sit idle, and which volume is its workspace.
IDLE_MINUTES_TAG = "trainstack:idle-minutes"
DEFAULT_IDLE_MINUTES = 60
MAX_IDLE_MINUTES = 7 * 24 * 60
# How long `dev up` waits for the box's SSM agent to register (a DLAMI boots in 2-5 minutes).
SESSION_MANAGER_WAIT_SECONDS = 600.0
COMMANDS = ("up", "down", "destroy", "status")
# EC2's answers that mean "not this type, market or zone now", not a broken request.
_NO_CAPACITY = {
    "InsufficientInstanceCapacity",
    "InsufficientCapacity",
    "SpotMaxPriceTooLow",
    "MaxSpotInstanceCountExceeded",
    "InstanceLimitExceeded",
    "VcpuLimitExceeded",
    "Unsupported",
}

Sleep = Callable[[float], None]


def add_lifecycle_commands(dev_commands: Any, parents: list[argparse.ArgumentParser]) -> None:
    """`dev up/down/destroy/status` under the `dev` group (the editor commands are added beside them)."""
    up = dev_commands.add_parser(
        "up",
        parents=parents,
        help="start the dev box (or say it is up): the stack's GPU, its data, your workspace volume",
        description="Launches one instance from the stack's dev template (no inbound port, IMDSv2, encrypted "
        "disk) in the zone of your workspace volume (created on the first `dev up`, encrypted with the "
        "stack's key), attaches the volume, mounted at /workspace, and waits until Session Manager sees the "
        "box. It stops itself after --idle-minutes with nobody connected, no kernel busy and the GPU idle.",
    )
    up.add_argument("--type", "-t", dest="instance_type", metavar="TYPE", help="instance type (default: the "
                    "stack's first trainstack:instanceTypes)")  # fmt: skip
    market = up.add_mutually_exclusive_group()
    market.add_argument("--spot", dest="spot", action="store_true", default=False,
                        help="spot capacity: cheaper, AWS may reclaim it (the workspace stays)")  # fmt: skip
    market.add_argument("--on-demand", dest="spot", action="store_false",
                        help="on-demand capacity (default): not reclaimed")  # fmt: skip
    up.add_argument(
        "--idle-minutes",
        type=int,
        default=DEFAULT_IDLE_MINUTES,
        metavar="N",
        help=f"stop the box after N idle minutes (default {DEFAULT_IDLE_MINUTES}; 0 = never)",
    )
    up.add_argument(
        "--workspace-gb",
        type=int,
        default=DEFAULT_WORKSPACE_GB,
        metavar="GB",
        help=f"size of the workspace volume when `dev up` creates it (default {DEFAULT_WORKSPACE_GB})",
    )
    up.add_argument(
        "--no-wait", dest="wait", action="store_false", help="return once the instance runs, before SSM"
    )
    dev_commands.add_parser(
        "down",
        parents=parents,
        help="terminate the dev box: compute billing stops; the workspace volume stays for the next `dev up`",
    )
    destroy = dev_commands.add_parser(
        "destroy", parents=parents, help="terminate the dev box and delete its workspace volume (its files)"
    )
    destroy.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    dev_commands.add_parser(
        "status",
        parents=parents,
        help="the dev box: state, type, spot/on-demand, uptime, cost so far, idle time left, workspace",
    )


def run(clients: Clients, stack: Stack, args: argparse.Namespace) -> int:
    """Dispatch one of COMMANDS."""
    as_json = bool(getattr(args, "json", False))
    if args.dev_command == "up":
        return up(
            clients,
            stack,
            instance_type=args.instance_type,
            spot=args.spot,
            idle_minutes=args.idle_minutes,
            workspace_gb=args.workspace_gb,
            wait=args.wait,
            as_json=as_json,
        )
    if args.dev_command == "down":
        return down(clients, stack, as_json=as_json)
    if args.dev_command == "destroy":
        return destroy(clients, stack, yes=args.yes, as_json=as_json)
    # Imported here: status pulls in the price lookups the other commands never need.
    from trainstack.dev import status

    return status.run(clients, stack, as_json=as_json)


def _subnets_by_zone(ec2: Any, outputs: StackOutputs) -> dict[str, str]:
    value = outputs.require(StackOutput.DEV_SUBNET_IDS)
    subnet_ids = [str(s) for s in value] if isinstance(value, list) else [str(value)]
    subnets = ec2.describe_subnets(SubnetIds=subnet_ids)["Subnets"]
    by_zone: dict[str, str] = {}
    # The outputs' order is the stack's zone order: the first subnet of a zone wins.
    for subnet_id in subnet_ids:
        for subnet in subnets:
            if subnet["SubnetId"] == subnet_id:
                by_zone.setdefault(str(subnet["AvailabilityZone"]), subnet_id)
    return by_zone


def _first_zone_offering(ec2: Any, zones: list[str], instance_type: str) -> str:
    offered = {
        str(o["Location"])
        for o in ec2.describe_instance_type_offerings(
            LocationType="availability-zone", Filters=[{"Name": "instance-type", "Values": [instance_type]}]
        )["InstanceTypeOfferings"]
    }
    for zone in zones:
        if zone in offered:
            return zone
    raise CliError(
        f"--type {instance_type}: not offered in the stack's zones ({', '.join(zones)}): pick another type "
        "(`trainstack prices` lists the stack's)"
    )


def _primary_interface(ec2: Any, template_id: str) -> dict[str, Any] | None:
    """The template's primary network interface (its security group and public-address rule): RunInstances
    gets it back with the workspace zone's subnet, so the template stays the one source of the baseline."""
    versions = ec2.describe_launch_template_versions(LaunchTemplateId=template_id, Versions=["$Default"])
    data = versions["LaunchTemplateVersions"][0]["LaunchTemplateData"]
    for interface in data.get("NetworkInterfaces", []):
        if interface.get("DeviceIndex", 0) == 0 and interface.get("NetworkCardIndex", 0) == 0:
            return dict(interface)
    return None


def _launch(
    ec2: Any,
    *,
    template_id: str,
    name: str,
    instance_type: str,
    spot: bool,
    subnet_id: str,
    workspace: Workspace,
    idle_minutes: int,
) -> str:
    tags = {
        "Name": name,
        DEV_TAG: name,
        IDLE_MINUTES_TAG: str(idle_minutes),
        WORKSPACE_TAG: workspace.volume_id,
    }
    request: dict[str, Any] = {
        "LaunchTemplate": {"LaunchTemplateId": template_id, "Version": "$Default"},
        "InstanceType": instance_type,
        "MinCount": 1,
        "MaxCount": 1,
        "TagSpecifications": [
            {"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}
        ],
    }
    interface = _primary_interface(ec2, template_id)
    if interface is None:
        request["SubnetId"] = subnet_id
    else:
        request["NetworkInterfaces"] = [{**interface, "SubnetId": subnet_id}]
    if spot:
        # One-time and terminate: a reclaimed box is gone, never restarted behind the user's back; the
        # workspace is on its own volume, and the next `dev up` starts a fresh box on it.
        request["InstanceMarketOptions"] = {
            "MarketType": "spot",
            "SpotOptions": {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"},
        }
    try:
        launched = ec2.run_instances(**request)
    except ClientError as error:
        if error_code(error) in _NO_CAPACITY:
            market = "spot" if spot else "on-demand"
            other = "--on-demand" if spot else "--spot"
            raise CliError(
                f"no {market} {instance_type} in {workspace.availability_zone} now "
                f"({error_code(error)}): retry later, or try {other} or another --type (the workspace "
                f"{workspace.volume_id} keeps the box in {workspace.availability_zone})"
            ) from None
        raise
    return str(launched["Instances"][0]["InstanceId"])


def _wait_running(ec2: Any, instance_id: str) -> None:
    try:
        ec2.get_waiter("instance_running").wait(
            InstanceIds=[instance_id], WaiterConfig={"Delay": 5, "MaxAttempts": 60}
        )
    except WaiterError as error:
        raise CliError(
            f"dev box {instance_id} did not reach running ({error}): see `trainstack dev status`; a spot box "
            "may be reclaimed at once, try `trainstack dev up --on-demand`"
        ) from None


def wait_for_session_manager(
    ssm: Any, instance_id: str, *, timeout_s: float = SESSION_MANAGER_WAIT_SECONDS, sleep: Sleep = time.sleep
) -> bool:
    """True once the box's SSM agent reports Online; False at the timeout (the box may still be booting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = ssm.describe_instance_information(Filters=[{"Key": "InstanceIds", "Values": [instance_id]}])
        if any(i.get("PingStatus") == "Online" for i in answer.get("InstanceInformationList", [])):
            return True
        if time.monotonic() >= deadline:
            return False
        sleep(5.0)


def _validate(idle_minutes: int, workspace_gb: int) -> None:
    if not 0 <= idle_minutes <= MAX_IDLE_MINUTES:
        raise CliError(
            f"--idle-minutes {idle_minutes}: minutes with nobody on the box before it stops itself, "
            f"0-{MAX_IDLE_MINUTES} (0 = never; default {DEFAULT_IDLE_MINUTES})"
        )
    if not 1 <= workspace_gb <= 16384:
        raise CliError(
            f"--workspace-gb {workspace_gb}: a gp3 volume is 1-16384 GiB (default {DEFAULT_WORKSPACE_GB})"
        )


def _ready_workspace(
    ec2: Any,
    outputs: StackOutputs,
    name: str,
    zones: list[str],
    instance_type: str,
    size_gb: int,
) -> tuple[Workspace, bool]:
    """The workspace, available to attach; created in the first zone offering the type if there is none."""
    workspace = find_workspace(ec2, name)
    if workspace is None:
        zone = _first_zone_offering(ec2, zones, instance_type)
        created = create_workspace(
            ec2,
            name=name,
            availability_zone=zone,
            size_gb=size_gb,
            kms_key_arn=outputs.text(StackOutput.KMS_KEY_ARN),
            tags={DEV_TAG: name},
        )
        return wait_for_volume(ec2, created.volume_id, "available"), True
    if workspace.state != "available":
        # Still attached to a box on its way out (`dev down` a moment ago, a spot reclaim): it detaches when
        # that instance has terminated.
        workspace = wait_for_volume(ec2, workspace.volume_id, "available")
    return workspace, False


def up(
    clients: Clients,
    stack: Stack,
    *,
    instance_type: str | None,
    spot: bool,
    idle_minutes: int,
    workspace_gb: int = DEFAULT_WORKSPACE_GB,
    wait: bool = True,
    as_json: bool = False,
) -> int:
    _validate(idle_minutes, workspace_gb)
    outputs = stack.outputs
    name = dev_box_name(outputs)
    template_id = outputs.text(StackOutput.DEV_TEMPLATE_ID)
    existing = find_dev_instance(clients, outputs)
    if existing is not None:
        _report_up(existing, find_workspace(clients.ec2(), name), clients.region, idle_minutes=None,
                   created=False, already=True, as_json=as_json)  # fmt: skip
        return 0
    ec2 = clients.ec2()
    chosen_type = instance_type or outputs.instance_types[0]
    by_zone = _subnets_by_zone(ec2, outputs)
    workspace, created = _ready_workspace(ec2, outputs, name, list(by_zone), chosen_type, workspace_gb)
    subnet_id = by_zone.get(workspace.availability_zone)
    if subnet_id is None:
        raise CliError(
            f"workspace {workspace.volume_id} is in {workspace.availability_zone}, where the stack has no "
            f"subnet (its zones: {', '.join(by_zone)}): snapshot it and `trainstack dev destroy`, or restore "
            "the zone"
        )
    instance_id = _launch(
        ec2,
        template_id=template_id,
        name=name,
        instance_type=chosen_type,
        spot=spot,
        subnet_id=subnet_id,
        workspace=workspace,
        idle_minutes=idle_minutes,
    )
    _wait_running(ec2, instance_id)
    attach_workspace(ec2, workspace, instance_id)
    if not as_json:
        print(f"dev box {instance_id} running; workspace {workspace.volume_id} attached", flush=True)
    online = wait_for_session_manager(clients.ssm(), instance_id) if wait else None
    instance = find_dev_instance(clients, outputs)
    if instance is None:
        raise CliError(
            f"dev box {instance_id} ended while starting (a spot reclaim?): run `trainstack dev up` again, "
            "or `--on-demand`"
        )
    _report_up(instance, workspace, clients.region, idle_minutes=idle_minutes, created=created, already=False,
               as_json=as_json, online=online)  # fmt: skip
    return 0


def _report_up(
    instance: DevInstance,
    workspace: Workspace | None,
    region: str | None,
    *,
    idle_minutes: int | None,
    created: bool,
    already: bool,
    as_json: bool,
    online: bool | None = None,
) -> None:
    connect = f"aws ssm start-session --target {instance.instance_id}" + (
        f" --region {region}" if region else ""
    )
    if as_json:
        print_json(
            {
                "instance_id": instance.instance_id,
                "state": instance.state,
                "instance_type": instance.instance_type,
                "lifecycle": instance.lifecycle,
                "availability_zone": instance.availability_zone,
                "workspace_volume_id": workspace.volume_id if workspace else None,
                "workspace_created": created,
                "already_up": already,
                "session_manager_online": online,
                "idle_minutes": idle_minutes,
                "connect": connect,
            }
        )
        return
    if already:
        print(
            f"dev box {instance.instance_id} is already up ({instance.state}, {instance.instance_type} "
            f"{instance.lifecycle}, {instance.availability_zone}); `trainstack dev down` ends it"
        )
    else:
        stops = (
            "never stops by itself"
            if idle_minutes == 0
            else f"stops itself after {idle_minutes} idle minutes"
        )
        space = (
            f"workspace {workspace.volume_id} ({'new, ' if created else ''}{workspace.size_gb} GiB)"
            if workspace
            else ""
        )
        print(
            f"dev box {instance.instance_id} up: {instance.instance_type} {instance.lifecycle} in "
            f"{instance.availability_zone}, {space} at /workspace; {stops}"
        )
        if online is False:
            print(
                "note: Session Manager does not see the box yet (it may still be booting): retry the connect "
                "command in a minute"
            )
    print(f"connect: `trainstack dev ssh-config` (VS Code, PyCharm, ssh), or `{connect}`")


def down(clients: Clients, stack: Stack, *, as_json: bool = False) -> int:
    outputs = stack.outputs
    name = dev_box_name(outputs)
    instance = find_dev_instance(clients, outputs)
    workspace = find_workspace(clients.ec2(), name)
    if instance is not None:
        clients.ec2().terminate_instances(InstanceIds=[instance.instance_id])
    kept = workspace.volume_id if workspace else None
    if as_json:
        print_json({"terminated": instance.instance_id if instance else None, "workspace_volume_id": kept})
        return 0
    if instance is None:
        print("no dev box is up: nothing bills for compute" + (f"; workspace {kept} kept" if kept else ""))
        return 0
    print(
        f"terminating dev box {instance.instance_id}: compute billing stops"
        + (
            f"; workspace {kept} kept for the next `trainstack dev up` (`dev destroy` deletes it)"
            if kept
            else ""
        )
    )
    return 0


def _confirm(workspace: Workspace) -> None:
    what = f"workspace volume {workspace.volume_id} ({workspace.size_gb} GiB) and every file on it"
    if not sys.stdin.isatty():
        raise CliError(f"`dev destroy` deletes {what}: pass --yes to confirm")
    answer = input(f"delete {what}? type 'yes': ")
    if answer.strip().lower() != "yes":
        raise CliError("dev destroy cancelled: nothing was deleted")


def destroy(
    clients: Clients, stack: Stack, *, yes: bool, as_json: bool = False, sleep: Sleep = time.sleep
) -> int:
    outputs = stack.outputs
    name = dev_box_name(outputs)
    ec2 = clients.ec2()
    workspace = find_workspace(ec2, name)
    instance = find_dev_instance(clients, outputs)
    if workspace is not None and not yes:
        _confirm(workspace)
    if instance is not None:
        ec2.terminate_instances(InstanceIds=[instance.instance_id])
    if workspace is not None:
        if workspace.state != "available":
            workspace = wait_for_volume(ec2, workspace.volume_id, "available", sleep=sleep)
        delete_workspace(ec2, workspace)
        # The box's last heartbeat would describe an instance that no longer exists.
        clients.s3().delete_object(Bucket=outputs.bucket, Key=HEARTBEAT_KEY)
    deleted = workspace.volume_id if workspace else None
    if as_json:
        print_json({"terminated": instance.instance_id if instance else None, "deleted_volume_id": deleted})
    elif instance is None and workspace is None:
        print("no dev box and no workspace: nothing to destroy")
    else:
        done = [
            f"terminated {instance.instance_id}" if instance else "",
            f"deleted workspace {deleted}" if deleted else "",
        ]
        print("dev box destroyed: " + ", ".join(part for part in done if part))
    return 0
