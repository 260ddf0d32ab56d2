"""`trainstack cancel ID`: write a job's cancel request; a queued job never runs, a running one checkpoints
and stops (its agent writes `cancelled` to its ledger)."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.jobs import CANCELLED, ENDED, NOT_STARTED, QUEUED, describe, still_waiting
from trainstack.output import console, print_json
from trainstack.stack import Stack, StackOutputs
from trainstack.state import (
    current_job_id,
    encryption_args,
    free_lanes,
    read_group,
    read_job,
    read_json,
    read_pointer,
)
from trainstack_job.contract import JobStatus
from trainstack_job.jobs import LEGACY_JOB_ID, JobIdError, JobPrefixes, check_job_id
from trainstack_job.queue import cancel_key, scan_queue

REQUESTED_BY = "trainstack cancel"


def cancel(clients: Clients, stack: Stack, job_id: str) -> dict[str, Any]:
    """Write `jobs/<id>/state/cancel.json` unless the job is over; returns what was done."""
    if job_id == LEGACY_JOB_ID:
        raise CliError(
            f"cancel {LEGACY_JOB_ID}: the job from before jobs has no queue; `trainstack stop` checkpoints "
            "it and scales the group to zero"
        )
    try:
        check_job_id(job_id, f"cancel {job_id}")
    except JobIdError as error:
        raise CliError(str(error)) from None
    outputs = stack.outputs
    row = describe(clients, outputs, job_id)
    status = row["status"]
    if status == NOT_STARTED and row["name"] is None:
        raise CliError(f"cancel {job_id}: no such job in s3://{outputs.bucket}; `trainstack jobs` lists them")
    if status in ENDED:
        raise CliError(f"cancel {job_id}: the job is already {status}; nothing to cancel")
    request = {"requested_at": datetime.now(timezone.utc).isoformat(timespec="seconds"), "by": REQUESTED_BY}
    key = cancel_key(job_id)
    clients.s3().put_object(
        Bucket=outputs.bucket,
        Key=key,
        Body=json.dumps(request).encode(),
        ContentType="application/json",
        **encryption_args(outputs),
    )
    waiting = status in {QUEUED, NOT_STARTED}
    return {
        "job": job_id,
        "was": status,
        "status": CANCELLED if waiting else status,
        "request": f"s3://{outputs.bucket}/{key}",
        "stops_after_checkpoint": not waiting,
        "scaled_to_zero_now": waiting and _sleep_if_idle(clients, outputs, job_id),
    }


def _sleep_if_idle(clients: Clients, outputs: StackOutputs, job_id: str) -> bool:
    """A pool woken for nothing but cancelled jobs goes back to zero now, rather than after its instances
    boot (and bill) only to find the queue empty: no job of the pool waiting, none of its lanes' jobs
    training or waiting for its data (an agent taking a job writes its ledger before it trains). The
    cancelled job's own pool, as its record names it."""
    record = read_json(clients, outputs.bucket, JobPrefixes.of(job_id).record) or {}
    pool = str(record.get("pool") or "")
    pools = outputs.pools
    name = pool or next((n for n, v in pools.items() if v.get("default")), next(iter(pools)))
    info = pools.get(name) or {}
    group = read_group(clients, str(info.get("group_name") or outputs.group_name))
    if group.desired == 0:
        return False
    bucket = outputs.bucket
    # The good entries only: a damaged queue object must not keep the group up, nor stop the cancel.
    entries = [entry for entry in scan_queue(clients.s3(), bucket).entries if entry.pool == pool]
    if any(still_waiting(clients, bucket, entry.job_id) for entry in entries):
        return False
    lanes = int(info.get("max_jobs") or 1)
    if lanes > 1:
        if free_lanes(clients, outputs, pool, lanes) < lanes:
            return False
    else:
        pointer = read_pointer(clients, outputs, pool)
        current = (pointer.job_id if pointer is not None else "") or current_job_id(clients, outputs)
        if read_job(clients, outputs, JobPrefixes.of(current)).status in (
            JobStatus.RUNNING,
            JobStatus.WAITING_FOR_DATA,
        ):
            return False
    clients.autoscaling().update_auto_scaling_group(AutoScalingGroupName=group.name, DesiredCapacity=0)
    return True


def run(clients: Clients, stack: Stack, job_id: str, *, as_json: bool) -> int:
    result = cancel(clients, stack, job_id)
    if as_json:
        print_json(result)
        return 0
    if result["stops_after_checkpoint"]:
        line = (
            f"cancel requested for job {job_id} ({result['was']}): its agent checkpoints, then stops it "
            f"(status {CANCELLED}); `trainstack status --job {job_id}` shows when"
        )
    else:
        line = f"cancelled job {job_id}: it leaves the queue and will never run"
        if result["scaled_to_zero_now"]:
            line += "; nothing else is queued, so the group is back at zero"
    console().print(line, markup=False)
    return 0
