"""`trainstack results pull`: the trained model down, unchanged files skipped; and the transfer manager set-up
and progress bar `trainstack data push` (trainstack/datapush.py) shares."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from boto3.s3.transfer import TransferConfig, create_transfer_manager
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from s3transfer.subscribers import BaseSubscriber

from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.jobs import queue_note
from trainstack.output import console, print_json
from trainstack.stack import Stack
from trainstack.state import read_job, resolve_job

TRANSFER_CONFIG = TransferConfig(
    multipart_threshold=64 * 1024 * 1024, multipart_chunksize=64 * 1024 * 1024, max_concurrency=16
)
_HASH_CHUNK = 1024 * 1024


def list_objects(clients: Clients, bucket: str, prefix: str) -> dict[str, dict[str, Any]]:
    objects: dict[str, dict[str, Any]] = {}
    for page in clients.s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            objects[item["Key"]] = dict(item)
    return objects


class ProgressSubscriber(BaseSubscriber):
    """Feeds transferred bytes into the progress bar (called from the transfer threads)."""

    def __init__(self, advance: Callable[[int], None]) -> None:
        self._advance = advance

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        self._advance(bytes_transferred)


@contextmanager
def progress_bar(label: str, total: int, *, quiet: bool) -> Iterator[Callable[[int], None]]:
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console(), disable=quiet, transient=False) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.update(task, advance=n)


def pull(
    clients: Clients, stack: Stack, destination: Path, *, quiet: bool, job_id: str | None = None
) -> dict[str, Any]:
    """Download one job's results (default: the current job's)."""
    outputs = stack.outputs
    job = resolve_job(clients, outputs, job_id)
    bucket, prefix = outputs.bucket, job.results
    objects = list_objects(clients, bucket, prefix)
    if not objects:
        # A job no instance has taken yet says so (queued, or cancelled before it ran), not "not started".
        waiting = queue_note(clients, outputs, job.job_id)
        status = waiting[0] if waiting else read_job(clients, outputs, job).status
        raise CliError(
            f"no results yet in s3://{bucket}/{prefix} (job {job.job_id}: training is {status}): they "
            f"appear when it completes; see `trainstack status --job {job.job_id}`, or `trainstack jobs` "
            "for the other jobs"
        )
    root = destination.resolve()
    plan: list[tuple[str, Path, dict[str, Any]]] = []
    for key, item in sorted(objects.items()):
        if key.endswith("/"):
            continue
        target = (root / key[len(prefix) :]).resolve()
        if not target.is_relative_to(root):
            raise CliError(f"s3://{bucket}/{key}: key leaves {root}; remove that object from the bucket")
        plan.append((key, target, item))

    def unchanged(target: Path, item: dict[str, Any]) -> bool:
        # Like `aws s3 sync`: same size and the object's time, which we stamp on every download.
        if not target.is_file():
            return False
        stat = target.stat()
        return stat.st_size == item["Size"] and int(stat.st_mtime) == int(item["LastModified"].timestamp())

    to_fetch = [(k, t, i) for k, t, i in plan if not unchanged(t, i)]
    total = sum(i["Size"] for _, _, i in to_fetch)
    with (
        progress_bar(f"pull ← s3://{bucket}/{prefix}", total, quiet=quiet) as advance,
        create_transfer_manager(clients.s3(), TRANSFER_CONFIG) as manager,
    ):
        futures = []
        for key, target, _ in to_fetch:
            target.parent.mkdir(parents=True, exist_ok=True)
            futures.append(
                manager.download(bucket, key, str(target), subscribers=[ProgressSubscriber(advance)])
            )
        for future in futures:
            future.result()
    for _, target, item in to_fetch:
        stamp = item["LastModified"].timestamp()
        os.utime(target, (stamp, stamp))
    return {
        "job": job.job_id,
        "source": f"s3://{bucket}/{prefix}",
        "destination": str(root),
        "files": [str(t.relative_to(root)) for _, t, _ in plan],
        "downloaded": len(to_fetch),
        "downloaded_bytes": total,
        "unchanged": len(plan) - len(to_fetch),
    }


def run_pull(
    clients: Clients, stack: Stack, destination: Path, *, as_json: bool, job_id: str | None = None
) -> int:
    summary = pull(clients, stack, destination, quiet=as_json, job_id=job_id)
    if as_json:
        print_json(summary)
    else:
        console().print(
            f"job {summary['job']}: {summary['downloaded']} file(s) downloaded "
            f"({summary['downloaded_bytes']:,} bytes), "
            f"{summary['unchanged']} unchanged → {summary['destination']}",
            markup=False,
        )
    return 0
