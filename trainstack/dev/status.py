"""`trainstack dev status`: the dev box's state, uptime, cost so far and idle time left; its workspace."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timezone

from botocore.exceptions import BotoCoreError, ClientError

from bootstrap.devbox.heartbeat import HEARTBEAT_KEY, Heartbeat
from bootstrap.pricing import ON_DEMAND_FALLBACK_USD_PER_HOUR, on_demand_price, spot_cost_usd, spot_history
from trainstack.aws import Clients, explain, is_not_found
from trainstack.dev.instances import DevInstance, dev_box_name, find_dev_instance
from trainstack.dev.workspace import Workspace, find_workspace
from trainstack.output import format_duration, format_usd, print_json
from trainstack.stack import Stack

# A watcher samples every 30 s and writes each verdict: a heartbeat older than this means it is not running.
HEARTBEAT_STALE_SECONDS = 180.0


@dataclass
class DevStatus:
    instance: DevInstance | None
    workspace: Workspace | None
    uptime_seconds: float | None = None
    cost_usd: float | None = None
    usd_per_hour: float | None = None
    heartbeat: Heartbeat | None = None
    idle_left_seconds: float | None = None
    notes: list[str] = field(default_factory=list)


def _cost(
    clients: Clients, instance: DevInstance, now: datetime, notes: list[str]
) -> tuple[float | None, float | None]:
    """(cost so far, current USD/hour) at the box's market: the spot prices in effect over its life, else
    the on-demand price, from the catalogue or the agent's built-in table (bootstrap/pricing.py)."""
    hours = (now - instance.launch_time).total_seconds() / 3600
    try:
        if instance.spot:
            points = spot_history(
                clients.ec2(), instance.instance_type, instance.availability_zone, instance.launch_time, now
            )
            if points:
                return spot_cost_usd(points, instance.launch_time, now), points[-1][1]
            notes.append(f"no spot price for {instance.instance_type} in {instance.availability_zone}")
            return None, None
        region = clients.region or instance.availability_zone[:-1]
        price = on_demand_price(clients.pricing(), instance.instance_type, region)
    except (BotoCoreError, ClientError) as error:
        notes.append(f"price of {instance.instance_type} unavailable: {explain(error)}")
        price = None
    if price is None:
        price = ON_DEMAND_FALLBACK_USD_PER_HOUR.get(instance.instance_type)
        if price is None:
            notes.append(f"no on-demand price for {instance.instance_type}: cost unknown")
            return None, None
        notes.append(f"cost at the built-in on-demand price of {instance.instance_type} (us-east-1)")
    return hours * price, price


def _heartbeat(clients: Clients, bucket: str, instance: DevInstance, notes: list[str]) -> Heartbeat | None:
    try:
        body = clients.s3().get_object(Bucket=bucket, Key=HEARTBEAT_KEY)["Body"].read()
    except ClientError as error:
        if is_not_found(error):
            notes.append("the box's idle watcher has not reported yet (it starts a few minutes after boot)")
            return None
        raise
    try:
        heartbeat = Heartbeat.from_json(body)
    except ValueError as error:
        notes.append(f"s3://{bucket}/{error}: idle time unknown until the watcher writes it again")
        return None
    if heartbeat.instance_id != instance.instance_id:
        notes.append("the box's idle watcher has not reported yet (the heartbeat is an earlier box's)")
        return None
    return heartbeat


def collect(clients: Clients, stack: Stack, now: datetime | None = None) -> DevStatus:
    outputs = stack.outputs
    name = dev_box_name(outputs)
    now = now or datetime.now(timezone.utc)
    status = DevStatus(find_dev_instance(clients, outputs), find_workspace(clients.ec2(), name))
    instance = status.instance
    if instance is None:
        return status
    status.uptime_seconds = max(0.0, (now - instance.launch_time).total_seconds())
    status.cost_usd, status.usd_per_hour = _cost(clients, instance, now, status.notes)
    status.heartbeat = _heartbeat(clients, outputs.bucket, instance, status.notes)
    if status.heartbeat is not None:
        age = (now - status.heartbeat.sampled_at).total_seconds()
        if age > HEARTBEAT_STALE_SECONDS:
            status.notes.append(
                f"the idle watcher last reported {format_duration(age)} ago: it may have stopped "
                "(`journalctl -u trainstack-devidle` on the box)"
            )
        status.idle_left_seconds = status.heartbeat.idle_left_seconds(now)
    return status


def _idle_line(status: DevStatus) -> str:
    heartbeat = status.heartbeat
    if heartbeat is None:
        return "-"
    if heartbeat.state == "shutting-down":
        return "idle limit reached: shutting down"
    if heartbeat.state == "interrupted":
        return "spot interruption notice: the box ends within 2 minutes"
    if heartbeat.busy:
        busy = f"busy ({', '.join(heartbeat.busy)})"
        return (
            busy
            if heartbeat.idle_limit_minutes <= 0
            else f"{busy}; stops after {heartbeat.idle_limit_minutes} idle min"
        )
    if heartbeat.idle_limit_minutes <= 0:
        return f"idle {format_duration(heartbeat.idle_seconds)}; never stops by itself (--idle-minutes 0)"
    left = format_duration(status.idle_left_seconds)
    return f"idle {format_duration(heartbeat.idle_seconds)}; stops in {left}"


def run(clients: Clients, stack: Stack, *, as_json: bool = False) -> int:
    status = collect(clients, stack)
    instance, workspace = status.instance, status.workspace
    if as_json:
        print_json(
            {
                "instance": None
                if instance is None
                else {
                    "instance_id": instance.instance_id,
                    "state": instance.state,
                    "instance_type": instance.instance_type,
                    "lifecycle": instance.lifecycle,
                    "availability_zone": instance.availability_zone,
                    "launch_time": instance.launch_time.isoformat(),
                },
                "uptime_seconds": status.uptime_seconds,
                "cost_usd": status.cost_usd,
                "usd_per_hour": status.usd_per_hour,
                "idle_seconds": status.heartbeat.idle_seconds if status.heartbeat else None,
                "idle_left_seconds": status.idle_left_seconds,
                "idle_limit_minutes": status.heartbeat.idle_limit_minutes if status.heartbeat else None,
                "busy": status.heartbeat.busy if status.heartbeat else None,
                "workspace": None
                if workspace is None
                else {
                    "volume_id": workspace.volume_id,
                    "size_gb": workspace.size_gb,
                    "availability_zone": workspace.availability_zone,
                    "state": workspace.state,
                    "attached_to": workspace.attached_to,
                },
                "notes": status.notes,
            }
        )
        return 0
    space = (
        f"{workspace.volume_id} ({workspace.size_gb} GiB, {workspace.availability_zone}, {workspace.state})"
        if workspace
        else "none yet (the first `trainstack dev up` creates it)"
    )
    if instance is None:
        print(f"dev box: not up (no compute billing); `trainstack dev up` starts it\nworkspace: {space}")
        return 0
    rate = f" at {format_usd(status.usd_per_hour, 4)}/h" if status.usd_per_hour is not None else ""
    print(
        f"dev box: {instance.instance_id} {instance.state}, {instance.instance_type} {instance.lifecycle} in "
        f"{instance.availability_zone}\n"
        f"uptime: {format_duration(status.uptime_seconds)}; "
        f"cost so far: {format_usd(status.cost_usd)}{rate}\n"
        f"idle: {_idle_line(status)}\n"
        f"workspace: {space}"
    )
    for note in status.notes:
        print(f"note: {note}")
    return 0
