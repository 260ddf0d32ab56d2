"""The dev box's workspace: one encrypted EBS volume per stack, kept across `dev down` and spot loss.

Why a volume of its own rather than stop/start of one instance: a spot instance cannot be relied on to stop
(AWS may terminate it, and a one-time spot request never restarts), and an instance's root volume dies with
it. A separate volume outlives any instance; the next `dev up` launches in its zone and attaches it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainstack.errors import CliError

# The workspace carries its own tag key: the box's root volume (tagged by the template) must never match it.
WORKSPACE_TAG = "trainstack:dev-workspace"
# The device name the CLI attaches it as; on Nitro instances it shows as an NVMe disk whose serial is the
# volume id, which is how the box finds it (bootstrap/devbox/instance/mount-workspace.sh).
WORKSPACE_DEVICE = "/dev/sdf"
DEFAULT_WORKSPACE_GB = 100
# creating/available/in-use: a workspace; deleting/deleted/error ones are not reused.
_USABLE_STATES = ("creating", "available", "in-use")


@dataclass(frozen=True)
class Workspace:
    volume_id: str
    availability_zone: str
    size_gb: int
    state: str  # creating | available | in-use
    attached_to: str | None = None


def _workspace(described: dict[str, Any]) -> Workspace:
    attachments = [a for a in described.get("Attachments", []) if a.get("State") in ("attaching", "attached")]
    return Workspace(
        volume_id=str(described["VolumeId"]),
        availability_zone=str(described["AvailabilityZone"]),
        size_gb=int(described["Size"]),
        state=str(described["State"]),
        attached_to=str(attachments[0]["InstanceId"]) if attachments else None,
    )


def find_workspace(ec2: Any, name: str) -> Workspace | None:
    """The stack's workspace volume, or None before the first `dev up` (or after `dev destroy`)."""
    volumes = ec2.describe_volumes(
        Filters=[
            {"Name": f"tag:{WORKSPACE_TAG}", "Values": [name]},
            {"Name": "status", "Values": list(_USABLE_STATES)},
        ]
    )["Volumes"]
    if len(volumes) > 1:
        listed = ", ".join(sorted(v["VolumeId"] for v in volumes))
        raise CliError(
            f"{len(volumes)} volumes carry the tag {WORKSPACE_TAG}={name} ({listed}): keep the one with "
            "your files and untag the others (`aws ec2 delete-tags --resources VOL --tags "
            f"Key={WORKSPACE_TAG}`)"
        )
    return _workspace(dict(volumes[0])) if volumes else None


def create_workspace(
    ec2: Any, *, name: str, availability_zone: str, size_gb: int, kms_key_arn: str, tags: dict[str, str]
) -> Workspace:
    """An empty gp3 volume encrypted with the stack's key; the box formats it on first mount."""
    all_tags = {**tags, WORKSPACE_TAG: name, "Name": f"{name}-workspace"}
    created = ec2.create_volume(
        AvailabilityZone=availability_zone,
        Size=size_gb,
        VolumeType="gp3",
        Encrypted=True,
        KmsKeyId=kms_key_arn,
        TagSpecifications=[
            {"ResourceType": "volume", "Tags": [{"Key": k, "Value": v} for k, v in all_tags.items()]}
        ],
    )
    return _workspace(dict(created))


def wait_for_volume(
    ec2: Any,
    volume_id: str,
    state: str,
    *,
    timeout_s: float = 300.0,
    sleep: Callable[[float], None] = time.sleep,
) -> Workspace:
    """Poll until the volume reaches `state` (available after create or after its instance ended)."""
    deadline = time.monotonic() + timeout_s
    while True:
        volumes = ec2.describe_volumes(VolumeIds=[volume_id])["Volumes"]
        if not volumes:
            raise CliError(f"workspace volume {volume_id} vanished: run `trainstack dev up` again")
        current = _workspace(dict(volumes[0]))
        if current.state == state:
            return current
        if current.state == "error":
            raise CliError(
                f"workspace volume {volume_id} is in state error: see the EC2 console; `trainstack dev "
                "destroy` removes it"
            )
        if time.monotonic() >= deadline:
            raise CliError(
                f"workspace volume {volume_id} still {current.state} after {timeout_s:.0f} s (wanted "
                f"{state}): retry in a minute"
            )
        sleep(2.0)


def attach_workspace(ec2: Any, workspace: Workspace, instance_id: str) -> None:
    ec2.attach_volume(VolumeId=workspace.volume_id, InstanceId=instance_id, Device=WORKSPACE_DEVICE)


def delete_workspace(ec2: Any, workspace: Workspace) -> None:
    ec2.delete_volume(VolumeId=workspace.volume_id)
