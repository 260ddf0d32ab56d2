"""What the stack is doing: the Auto Scaling group, and the JSON the agent and trainer keep in `state/`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from botocore.exceptions import ClientError

from trainstack.aws import Clients, is_not_found
from trainstack.errors import CliError
from trainstack.stack import StackOutputs
from trainstack_job.contract import CONTROL, LATEST, LEDGER, PROGRESS, JobStatus, StackOutput
from trainstack_job.jobs import (
    CURRENT_JOB,
    JOBS_PREFIX,
    LEGACY_JOB_ID,
    JobIdError,
    JobPrefixes,
    check_job_id,
    pointer_name,
)
from trainstack_job.launches import Drought, drought, read_launches
from trainstack_job.records import JobPointer, Ledger, Progress
from trainstack_job.slots import Slots

JOBS_COMMAND = "trainstack jobs"


@dataclass(frozen=True)
class GroupInstance:
    """One instance of the group as a user thinks of it."""

    instance_id: str
    instance_type: str
    az: str
    lifecycle: str  # "spot" or "on-demand"
    state: str  # the group's lifecycle state: Pending, InService, Terminating...
    health: str


@dataclass(frozen=True)
class Group:
    """The Auto Scaling group's sizes and members."""

    name: str
    desired: int
    min_size: int
    max_size: int
    instances: list[GroupInstance] = field(default_factory=list)

    @property
    def in_service(self) -> int:
        return sum(1 for i in self.instances if i.state == "InService")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "desired": self.desired,
            "min": self.min_size,
            "max": self.max_size,
            "in_service": self.in_service,
            "instances": [vars(i) for i in self.instances],
        }


def read_drought(clients: Clients, group_name: str, now: datetime) -> Drought | None:
    """The group's launches failing now (trainstack_job/launches.py), from its newest scaling activities:
    one page is the last hour or more of a group that keeps trying. None when the last launch succeeded,
    or when the caller may not read the activities (a reason left out beats `trainstack jobs` failing)."""
    try:
        page = clients.autoscaling().describe_scaling_activities(
            AutoScalingGroupName=group_name, MaxRecords=50
        )
    except ClientError:
        return None
    launches = sorted(read_launches(page.get("Activities", [])), key=lambda x: x.started_at, reverse=True)
    return drought(launches, now)


def read_group(clients: Clients, group_name: str, *, lifecycles: bool = True) -> Group:
    """The group and its instances, each with spot/on-demand from EC2 (the group does not say).
    `lifecycles=False` (their lifecycle then `?`) calls no EC2: `trainstack run` needs only the sizes, and
    the dev box's role, which submits jobs, holds no EC2 action."""
    found = clients.autoscaling().describe_auto_scaling_groups(AutoScalingGroupNames=[group_name])
    groups = found["AutoScalingGroups"]
    if not groups:
        raise CliError(
            f"Auto Scaling group '{group_name}' not found in {clients.region}: the stack may be destroyed or "
            "its outputs stale; run `pulumi up`, or pass the right --stack"
        )
    group = groups[0]
    members = group.get("Instances", [])
    found_lifecycles: dict[str, str] = {}
    ids = [m["InstanceId"] for m in members]
    if ids and lifecycles:
        for reservation in clients.ec2().describe_instances(InstanceIds=ids)["Reservations"]:
            for instance in reservation["Instances"]:
                # EC2 omits InstanceLifecycle for on-demand instances.
                found_lifecycles[instance["InstanceId"]] = (
                    "spot" if instance.get("InstanceLifecycle") == "spot" else "on-demand"
                )
    return Group(
        name=group_name,
        desired=group["DesiredCapacity"],
        min_size=group["MinSize"],
        max_size=group["MaxSize"],
        instances=[
            GroupInstance(
                instance_id=m["InstanceId"],
                instance_type=m.get("InstanceType", "?"),
                az=m["AvailabilityZone"],
                lifecycle=found_lifecycles.get(m["InstanceId"], "on-demand" if lifecycles else "?"),
                state=m["LifecycleState"],
                health=m["HealthStatus"],
            )
            for m in members
        ],
    )


def read_json(clients: Clients, bucket: str, key: str) -> dict[str, Any] | None:
    """A JSON object from the bucket, or None when it is not there yet."""
    try:
        body = clients.s3().get_object(Bucket=bucket, Key=key)["Body"].read()
    except ClientError as error:
        if is_not_found(error):
            return None
        raise
    try:
        document = json.loads(body)
    except json.JSONDecodeError:
        raise CliError(
            f"s3://{bucket}/{key} is not valid JSON; it is rewritten by the agent, retry shortly"
        ) from None
    return document if isinstance(document, dict) else None


def read_ledger(clients: Clients, bucket: str, job: JobPrefixes) -> Ledger | None:
    """The job's ledger; None while there is none (no instance has taken the job yet)."""
    raw = read_json(clients, bucket, job.state + LEDGER)
    return None if raw is None else Ledger.from_json(raw)


def read_progress(clients: Clients, bucket: str, job: JobPrefixes) -> Progress | None:
    """The job's progress; None until its trainer first reported a step."""
    return Progress.from_json(read_json(clients, bucket, job.state + PROGRESS))


def read_pointer(clients: Clients, outputs: StackOutputs, pool: str = "", lane: int = 0) -> JobPointer | None:
    """The job a pool's lane serves (`pool`: "" = the default pool); None while its pointer names none."""
    state = outputs.prefix(StackOutput.STATE_PREFIX)
    return JobPointer.from_json(read_json(clients, outputs.bucket, state + pointer_name(pool, lane)))


def running_in_slots(clients: Clients, outputs: StackOutputs, now: datetime) -> int | None:
    """How many of the stack's `maxConcurrentJobs` run slots hold a job now (trainstack_job/slots.py); None
    when the stack sets no limit."""
    limit = outputs.max_concurrent_jobs
    if not limit:
        return None

    def status_of(job_id: str) -> str | None:
        ledger = read_ledger(clients, outputs.bucket, JobPrefixes.of(job_id))
        return None if ledger is None else ledger.status

    slots = Slots(clients.s3(), outputs.bucket, outputs.prefix(StackOutput.STATE_PREFIX), limit, status_of)
    try:
        return len(slots.running(now))
    except ClientError:  # a caller who may not read them: the other reasons still show
        return None


@dataclass(frozen=True)
class JobState:
    """The training job as the bucket records it; each part is None until first written (the ledger: until an
    instance first took the job)."""

    ledger: Ledger | None
    progress: Progress | None
    checkpoint: dict[str, Any] | None
    control: dict[str, Any] | None
    job_id: str = LEGACY_JOB_ID

    @property
    def status(self) -> str:
        return "not started" if self.ledger is None else self.ledger.status


def has_objects(clients: Clients, bucket: str, prefix: str) -> bool:
    """Whether any key starts with `prefix` (one listing call, at most one key)."""
    found = clients.s3().list_objects_v2(Bucket=bucket, Prefix=prefix, MaxKeys=1)
    return bool(found.get("KeyCount") or found.get("Contents"))


def current_job_id(clients: Clients, outputs: StackOutputs) -> str:
    """The job the stack runs now (docs/internals.md, "Jobs, the lease and the standby").

    `state/current-job.json`'s `job_id`; without it a `state/ledger.json` means a stack from before jobs
    (the legacy job); with neither, no instance has started one yet: the job the last `pulumi up` defined
    (the `job_id` output; a stack deployed before jobs has none, so its job is the legacy one).
    """
    bucket, state = outputs.bucket, outputs.prefix(StackOutput.STATE_PREFIX)
    raw = read_json(clients, bucket, state + CURRENT_JOB)
    if raw is not None:
        pointer = JobPointer.from_json(raw)
        job_id = pointer.job_id if pointer is not None else None
        try:
            if job_id is None:
                raise JobIdError("the pointer names no job")
            return LEGACY_JOB_ID if job_id == LEGACY_JOB_ID else check_job_id(job_id)
        except JobIdError:
            raise CliError(
                f"s3://{bucket}/{state}{CURRENT_JOB} names {job_id!r}, not a job id; pass --job ID "
                f"(`{JOBS_COMMAND}` lists them)"
            ) from None
    if has_objects(clients, bucket, state + LEDGER):
        return LEGACY_JOB_ID
    defined = outputs.values.get(StackOutput.JOB_ID.value)
    return str(defined) if defined else LEGACY_JOB_ID


def job_exists(clients: Clients, outputs: StackOutputs, job: JobPrefixes) -> bool:
    """Whether the bucket holds anything of the job (the legacy job: its ledger, checkpoints or results)."""
    bucket = outputs.bucket
    if job.job_id == LEGACY_JOB_ID:
        return any(
            has_objects(clients, bucket, p) for p in (job.state + LEDGER, job.checkpoints, job.results)
        )
    return has_objects(clients, bucket, job.root)


def resolve_job(clients: Clients, outputs: StackOutputs, requested: str | None = None) -> JobPrefixes:
    """The prefixes of the job a command acts on: `--job ID` when given, else the current job.

    A requested id must name a job the bucket holds, or the stack's defined or current job (which may not
    have written anything yet).
    """
    if requested is None:
        return JobPrefixes.of(current_job_id(clients, outputs))
    bucket = outputs.bucket
    if requested != LEGACY_JOB_ID:
        try:
            check_job_id(requested, f"--job {requested}")
        except JobIdError as error:
            raise CliError(str(error)) from None
    job = JobPrefixes.of(requested)
    known = {outputs.values.get(StackOutput.JOB_ID.value)}
    if requested in known or job_exists(clients, outputs, job):
        return job
    if requested == current_job_id(clients, outputs):
        return job
    if requested == LEGACY_JOB_ID:
        raise CliError(
            f"--job {LEGACY_JOB_ID}: s3://{bucket} holds no job from before jobs (no state/ledger.json, "
            f"checkpoints/ or results/); `{JOBS_COMMAND}` lists the jobs it holds"
        )
    raise CliError(
        f"--job {requested}: no such job in s3://{bucket}/{JOBS_PREFIX}; `{JOBS_COMMAND}` lists them"
    )


def read_job(clients: Clients, outputs: StackOutputs, job: JobPrefixes | None = None) -> JobState:
    """What the bucket records of `job` (default: the current job)."""
    job = job or resolve_job(clients, outputs)
    bucket = outputs.bucket
    return JobState(
        ledger=read_ledger(clients, bucket, job),
        progress=read_progress(clients, bucket, job),
        checkpoint=read_json(clients, bucket, job.checkpoints + LATEST),
        control=read_json(clients, bucket, job.state + CONTROL),
        job_id=job.job_id,
    )


def training_runs(group: Group, job: JobState) -> bool:
    """The agent says it is training and the group has (or is launching) an instance for it."""
    # desired > 0 covers the gap after a spot interruption, when the replacement is not in service yet.
    return job.status == JobStatus.RUNNING and (group.in_service > 0 or group.desired > 0)


def encryption_args(outputs: StackOutputs) -> dict[str, Any]:
    """S3 write arguments that satisfy the bucket's deny-unencrypted policy with the stack's own key."""
    # No BucketKeyEnabled: the transfer manager refuses it, and the bucket's own bucket-key setting applies.
    args: dict[str, Any] = {"ServerSideEncryption": "aws:kms"}
    if outputs.values.get(StackOutput.KMS_KEY_ARN.value):
        # Naming only aws:kms would make S3 use the AWS-managed aws/s3 key instead of the stack's CMK.
        args["SSEKMSKeyId"] = outputs.text(StackOutput.KMS_KEY_ARN)
    return args


def free_lanes(clients: Clients, outputs: StackOutputs, pool: str, lanes: int) -> int:
    """How many of a pool's lanes (`pool`: "" = the default pool) run no job now: a lane whose pointer
    names no job, or one that is over. A pool of one lane: 0 (its one job runs, or the group is at zero)."""
    if lanes <= 1:
        return 0
    free = 0
    for lane in range(lanes):
        pointer = read_pointer(clients, outputs, pool, lane)
        if pointer is None or not pointer.job_id:
            free += 1
            continue
        ledger = read_ledger(clients, outputs.bucket, JobPrefixes.of(pointer.job_id))
        if ledger is not None and ledger.ended:
            free += 1
    return free
