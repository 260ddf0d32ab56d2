"""Which instance is the stack's dev box: found by its `trainstack:dev` tag, never by a name typed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.stack import StackOutputs
from trainstack_job.contract import StackOutput

# The tag `trainstack dev up` puts on the dev box's instance and its workspace volume; its value is the
# stack's dev box name (stack output `dev_box_name`), so two stacks in one account never see each other's.
DEV_TAG = "trainstack:dev"
# A dev box in these states is up (or about to be) and billing; stopping/shutting-down ones are on their way
# out and `dev up` may start the next one.
LIVE_STATES = ("pending", "running")
# EC2 tags every instance launched from a launch template with these; nobody can set a tag with the `aws:`
# prefix, so unlike DEV_TAG they say which template (and version) the instance really came from.
TEMPLATE_ID_TAG = "aws:ec2launchtemplate:id"
TEMPLATE_VERSION_TAG = "aws:ec2launchtemplate:version"
ENABLE_DEV_BOX = "`pulumi config set trainstack:devBox true && pulumi up`"


@dataclass(frozen=True)
class DevInstance:
    """The dev box's instance as EC2 describes it."""

    instance_id: str
    state: str  # pending | running
    availability_zone: str
    instance_type: str
    lifecycle: str  # spot | on-demand
    launch_time: datetime
    private_ip: str | None = None
    # What says where the instance came from (trainstack/dev/identity.py checks them against the stack):
    # EC2's own `aws:ec2launchtemplate:*` tags, its instance profile, network and image.
    template_id: str | None = None
    template_version: str | None = None
    profile_arn: str | None = None
    vpc_id: str | None = None
    subnet_id: str | None = None
    image_id: str | None = None

    @property
    def spot(self) -> bool:
        return self.lifecycle == "spot"


def dev_box_name(outputs: StackOutputs) -> str:
    """The stack's dev box name; a stack deployed with trainstack:devBox off has none."""
    value = outputs.values.get(StackOutput.DEV_BOX_NAME.value)
    if not value or not outputs.values.get(StackOutput.DEV_TEMPLATE_ID.value):
        raise CliError(
            f"stack has no dev box template (outputs '{StackOutput.DEV_TEMPLATE_ID.value}' and "
            f"'{StackOutput.DEV_BOX_NAME.value}' missing from {outputs.source}): {ENABLE_DEV_BOX}"
        )
    return str(value)


def _dev_instance(described: dict[str, Any]) -> DevInstance:
    launched = described["LaunchTime"]
    if launched.tzinfo is None:
        launched = launched.replace(tzinfo=timezone.utc)
    tags = {str(t["Key"]): str(t["Value"]) for t in described.get("Tags") or []}
    profile = described.get("IamInstanceProfile") or {}
    return DevInstance(
        instance_id=str(described["InstanceId"]),
        state=str(described["State"]["Name"]),
        availability_zone=str(described["Placement"]["AvailabilityZone"]),
        instance_type=str(described["InstanceType"]),
        lifecycle="spot" if described.get("InstanceLifecycle") == "spot" else "on-demand",
        launch_time=launched,
        private_ip=described.get("PrivateIpAddress"),
        template_id=tags.get(TEMPLATE_ID_TAG),
        template_version=tags.get(TEMPLATE_VERSION_TAG),
        profile_arn=profile.get("Arn"),
        vpc_id=described.get("VpcId"),
        subnet_id=described.get("SubnetId"),
        image_id=described.get("ImageId"),
    )


def find_dev_instances(clients: Clients, outputs: StackOutputs) -> list[DevInstance]:
    """Every running or pending instance with the stack's dev tag, newest launched first (the instance id
    breaks a tie, so two calls always agree). The tag is anyone's to set: see trainstack/dev/identity.py."""
    name = dev_box_name(outputs)
    paginator = clients.ec2().get_paginator("describe_instances")
    found = [
        _dev_instance(dict(instance))
        for page in paginator.paginate(
            Filters=[
                {"Name": f"tag:{DEV_TAG}", "Values": [name]},
                {"Name": "instance-state-name", "Values": list(LIVE_STATES)},
            ]
        )
        for reservation in page["Reservations"]
        for instance in reservation["Instances"]
    ]
    return sorted(found, key=lambda i: (i.launch_time, i.instance_id), reverse=True)


def find_dev_instance(clients: Clients, outputs: StackOutputs) -> DevInstance | None:
    """The stack's running or pending dev box by its tag alone, or None; the newest if a race ever left two.
    Enough to start, end or report the box; whatever connects to it uses identity.require_trusted_dev_box."""
    found = find_dev_instances(clients, outputs)
    return found[0] if found else None


def require_dev_instance(clients: Clients, outputs: StackOutputs) -> DevInstance:
    """The dev box that is up, or the one line that says how to start it."""
    instance = find_dev_instance(clients, outputs)
    if instance is None:
        raise CliError("no dev box is up: `trainstack dev up`")
    return instance
