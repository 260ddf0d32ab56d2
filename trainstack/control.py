"""`trainstack stop` / `resume`: ask the agent to checkpoint and scale to zero, or bring the group back."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from trainstack.aws import Clients
from trainstack.output import console, print_json
from trainstack.stack import Stack
from trainstack.state import encryption_args, read_group, read_job, resolve_job
from trainstack_job.contract import CONTROL, JobStatus, StackOutput
from trainstack_job.records import ENDED_STATUSES


def stop(clients: Clients, stack: Stack) -> dict[str, Any]:
    """Write the current job's stop request; with nothing in service no agent would read it, so scale to
    zero here. The current job is the one the group's instances run (state/current-job.json)."""
    outputs = stack.outputs
    job = resolve_job(clients, outputs)
    bucket, key = outputs.bucket, job.state + CONTROL
    request = {"action": "stop", "requested_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    clients.s3().put_object(
        Bucket=bucket,
        Key=key,
        Body=json.dumps(request).encode(),
        ContentType="application/json",
        **encryption_args(outputs),
    )
    group = read_group(clients, outputs.group_name)
    scaled = False
    if group.in_service == 0 and group.desired > 0:
        clients.autoscaling().update_auto_scaling_group(
            AutoScalingGroupName=group.name, MinSize=0, DesiredCapacity=0
        )
        scaled = True
    return {
        "job": job.job_id,
        "control": f"s3://{bucket}/{key}",
        "request": request,
        "group": group.name,
        "in_service": group.in_service,
        "scaled_to_zero_now": scaled,
    }


def resume(clients: Clients, stack: Stack) -> dict[str, Any]:
    """Withdraw the current job's stop request and set the group back to the stack's instance count."""
    outputs = stack.outputs
    job_prefixes = resolve_job(clients, outputs)
    bucket, key = outputs.bucket, job_prefixes.state + CONTROL
    # Delete first: an agent booting before the delete would read the old request and stop again.
    clients.s3().delete_object(Bucket=bucket, Key=key)
    group = read_group(clients, outputs.group_name)
    count = outputs.instance_count
    clients.autoscaling().update_auto_scaling_group(
        AutoScalingGroupName=group.name, DesiredCapacity=count, MaxSize=max(group.max_size, count)
    )
    job = read_job(clients, outputs, job_prefixes)
    notes = []
    defined = outputs.values.get(StackOutput.JOB_ID.value)
    if defined and defined != job.job_id and job.status in ENDED_STATUSES:
        # The agent makes the stack's defined job current once the current one has ended.
        notes.append(
            f"job {job.job_id} has ended ({job.status}): the new instance starts the stack's job {defined}"
        )
    elif job.status == JobStatus.COMPLETED:
        notes.append("training already completed: the new instance restores the final checkpoint and ends")
    failures = job.ledger.consecutive_failures if job.ledger is not None else 0
    if failures:
        notes.append(f"the last {failures} lives failed: check `trainstack logs` before it burns more time")
    return {
        "job": job.job_id,
        "group": group.name,
        "desired": count,
        "previous_desired": group.desired,
        "status": job.status,
        "notes": notes,
    }


def run_stop(clients: Clients, stack: Stack, *, as_json: bool) -> int:
    result = stop(clients, stack)
    if as_json:
        print_json(result)
    elif result["scaled_to_zero_now"]:
        console().print(
            f"job {result['job']}: no instance in service: {result['group']} scaled to zero now; stop "
            "request left in "
            f"{result['control']}",
            markup=False,
        )
    elif result["in_service"]:
        console().print(
            f"job {result['job']}: stop requested ({result['control']}): the agent checkpoints, then scales "
            f"{result['group']} "
            "to zero; "
            "watch it with `trainstack status`",
            markup=False,
        )
    else:
        console().print(
            f"job {result['job']}: {result['group']} is already at zero; stop request left in "
            f"{result['control']}",
            markup=False,
        )
    return 0


def run_resume(clients: Clients, stack: Stack, *, as_json: bool) -> int:
    result = resume(clients, stack)
    if as_json:
        print_json(result)
        return 0
    out = console()
    out.print(
        f"job {result['job']}: {result['group']}: desired {result['previous_desired']} → "
        f"{result['desired']}; training resumes from the latest checkpoint once an instance boots "
        "(`trainstack status`)",
        markup=False,
    )
    for note in result["notes"]:
        out.print(f"note: {note}", markup=False)
    return 0
