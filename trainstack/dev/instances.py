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
    return DevInstance(
        instance_id=str(described["InstanceId"]),
        state=str(described["State"]["Name"]),
        availability_zone=str(described["Placement"]["AvailabilityZone"]),
        instance_type=str(described["InstanceType"]),
        lifecycle="spot" if described.get("InstanceLifecycle") == "spot" else "on-demand",
        launch_time=launched,
        private_ip=described.get("PrivateIpAddress"),
    )


def find_dev_instance(clients: Clients, outputs: StackOutputs) -> DevInstance | None:
    """The stack's running or pending dev box, or None; the newest if a race ever left two."""
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
    return max(found, key=lambda i: i.launch_time) if found else None


def require_dev_instance(clients: Clients, outputs: StackOutputs) -> DevInstance:
    """The dev box that is up, or the one line that says how to start it."""
    instance = find_dev_instance(clients, outputs)
    if instance is None:
        raise CliError("no dev box is up: `trainstack dev up`")
    return instance
