"""`trainstack data push` / `results pull`: dataset up, trained model down, unchanged files skipped."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
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

from training.dataset_layout import is_hidden
from trainstack.aws import Clients
from trainstack.errors import CliError
from trainstack.output import console, print_json
from trainstack.stack import Stack
from trainstack.state import encryption_args, read_group, read_job, read_json, resolve_job, training_runs
from trainstack_job.contract import DATA_MANIFEST, StackOutput

# torchvision.datasets.folder.IMG_EXTENSIONS: what ImageFolder will load. Copied because the CLI is
# installed without torch; tests/cli check the two stay equal.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")
TRANSFER_CONFIG = TransferConfig(
    multipart_threshold=64 * 1024 * 1024, multipart_chunksize=64 * 1024 * 1024, max_concurrency=16
)
_HASH_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class LocalFile:
    relative: str  # posix path under the dataset root: train/cat/1.jpg
    path: Path
    size: int
    sha256: str


def validate_image_folder(root: Path) -> list[str]:
    """The class names, if `root` holds train/<class>/<image> and val/<class>/<image>, same classes."""
    layout = f"expected {root}/train/<class>/<image> and {root}/val/<class>/<image>"
    if not root.is_dir():
        raise CliError(f"dataset {root}: not a directory; {layout}")
    classes: dict[str, set[str]] = {}
    for split in SPLITS:
        folder = root / split
        if not folder.is_dir():
            raise CliError(f"dataset {root}: no {split}/ folder; {layout}")
        names = {p.name for p in folder.iterdir() if p.is_dir() and not is_hidden(p.name)}
        if not names:
            raise CliError(f"dataset {folder}: no class folders; {layout}")
        for name in sorted(names):
            if not any(
                _is_image(p) and not is_hidden(p.relative_to(folder)) for p in (folder / name).rglob("*")
            ):
                raise CliError(
                    f"dataset {folder / name}: no image files ({', '.join(IMG_EXTENSIONS)}); "
                    "add images or remove the empty class folder"
                )
        classes[split] = names
    if classes["train"] != classes["val"]:
        only_train = sorted(classes["train"] - classes["val"])
        only_val = sorted(classes["val"] - classes["train"])
        raise CliError(
            f"dataset {root}: train/ and val/ must have the same class folders "
            f"(only in train/: {', '.join(only_train) or '-'}; only in val/: {', '.join(only_val) or '-'})"
        )
    return sorted(classes["train"])


def _is_image(path: Path) -> bool:
    return path.is_file() and path.suffix.lower() in IMG_EXTENSIONS


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(_HASH_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def scan_dataset(root: Path) -> list[LocalFile]:
    """Every file of train/ and val/, without hidden ones (.DS_Store, .ipynb_checkpoints/, __MACOSX/): the
    instance would not download them, nor the trainer read them."""
    files = []
    for split in SPLITS:
        for path in sorted((root / split).rglob("*")):
            relative = path.relative_to(root)
            if path.is_file() and not is_hidden(relative):
                files.append(LocalFile(relative.as_posix(), path, path.stat().st_size, _sha256(path)))
    return files


def list_objects(clients: Clients, bucket: str, prefix: str) -> dict[str, dict[str, Any]]:
    objects: dict[str, dict[str, Any]] = {}
    for page in clients.s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            objects[item["Key"]] = dict(item)
    return objects


class _ProgressSubscriber(BaseSubscriber):
    """Feeds transferred bytes into the progress bar (called from the transfer threads)."""

    def __init__(self, advance: Callable[[int], None]) -> None:
        self._advance = advance

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        self._advance(bytes_transferred)


@contextmanager
def _progress(label: str, total: int, *, quiet: bool) -> Iterator[Callable[[int], None]]:
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


def push(
    clients: Clients, stack: Stack, root: Path, *, force: bool, delete: bool, quiet: bool
) -> dict[str, Any]:
    classes = validate_image_folder(root)
    outputs = stack.outputs
    bucket, prefix = outputs.bucket, outputs.prefix(StackOutput.DATA_PREFIX)
    group = read_group(clients, outputs.group_name)
    # The dataset is the stack's: what matters is whether the stack's current job is training on it.
    job = read_job(clients, outputs)
    if training_runs(group, job) and not force:
        raise CliError(
            f"training is running on {group.in_service} instance(s) of {group.name} (job {job.job_id}): "
            "replacing its dataset "
            "mid-run would mix two datasets; run `trainstack stop` first, or pass --force"
        )
    manifest_key = outputs.prefix(StackOutput.STATE_PREFIX) + DATA_MANIFEST
    manifest = (read_json(clients, bucket, manifest_key) or {}).get("files", {})
    remote = list_objects(clients, bucket, prefix)
    files = scan_dataset(root)

    def unchanged(file: LocalFile) -> bool:
        # S3 ETags are not content hashes under SSE-KMS: compare our recorded sha256, and the ETag only
        # to prove the object was not replaced since we recorded it.
        key = prefix + file.relative
        known, current = manifest.get(key), remote.get(key)
        return bool(
            known
            and current
            and known.get("sha256") == file.sha256
            and known.get("etag") == current["ETag"]
            and current["Size"] == file.size
        )

    to_upload = [f for f in files if not unchanged(f)]
    extra = encryption_args(outputs)
    total = sum(f.size for f in to_upload)
    with (
        _progress(f"push → s3://{bucket}/{prefix}", total, quiet=quiet) as advance,
        create_transfer_manager(clients.s3(), TRANSFER_CONFIG) as manager,
    ):
        futures = [
            manager.upload(
                str(f.path),
                bucket,
                prefix + f.relative,
                extra_args=extra,
                subscribers=[_ProgressSubscriber(advance)],
            )
            for f in to_upload
        ]
        for future in futures:
            future.result()
    local_keys = {prefix + f.relative for f in files}
    stale = sorted(set(remote) - local_keys) if delete else []
    s3 = clients.s3()
    for start in range(0, len(stale), 1000):
        s3.delete_objects(
            Bucket=bucket,
            Delete={"Objects": [{"Key": k} for k in stale[start : start + 1000]], "Quiet": True},
        )
    etags = {k: v["ETag"] for k, v in list_objects(clients, bucket, prefix).items()}
    new_manifest = {
        "files": {
            prefix + f.relative: {"size": f.size, "sha256": f.sha256, "etag": etags.get(prefix + f.relative)}
            for f in files
        },
        "classes": classes,
        "pushed_at": datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    s3.put_object(
        Bucket=bucket,
        Key=manifest_key,
        Body=json.dumps(new_manifest, indent=1).encode(),
        ContentType="application/json",
        **extra,
    )
    return {
        "destination": f"s3://{bucket}/{prefix}",
        "classes": classes,
        "files": len(files),
        "uploaded": len(to_upload),
        "uploaded_bytes": total,
        "unchanged": len(files) - len(to_upload),
        "deleted": len(stale),
        "left_in_bucket": len(set(remote) - local_keys) - len(stale),
    }


def pull(
    clients: Clients, stack: Stack, destination: Path, *, quiet: bool, job_id: str | None = None
) -> dict[str, Any]:
    """Download one job's results (default: the current job's)."""
    outputs = stack.outputs
    job = resolve_job(clients, outputs, job_id)
    bucket, prefix = outputs.bucket, job.results
    objects = list_objects(clients, bucket, prefix)
    if not objects:
        status = read_job(clients, outputs, job).status
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
        _progress(f"pull ← s3://{bucket}/{prefix}", total, quiet=quiet) as advance,
        create_transfer_manager(clients.s3(), TRANSFER_CONFIG) as manager,
    ):
        futures = []
        for key, target, _ in to_fetch:
            target.parent.mkdir(parents=True, exist_ok=True)
            futures.append(
                manager.download(bucket, key, str(target), subscribers=[_ProgressSubscriber(advance)])
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


def run_push(clients: Clients, stack: Stack, root: Path, *, force: bool, delete: bool, as_json: bool) -> int:
    summary = push(clients, stack, root, force=force, delete=delete, quiet=as_json)
    if as_json:
        print_json(summary)
    else:
        extra = (
            f", {summary['left_in_bucket']} extra object(s) kept (--delete removes them)"
            if summary["left_in_bucket"]
            else ""
        )
        console().print(
            f"{summary['uploaded']} file(s) uploaded ({summary['uploaded_bytes']:,} bytes), "
            f"{summary['unchanged']} unchanged, {summary['deleted']} deleted{extra} "
            f"→ {summary['destination']} "
            f"({len(summary['classes'])} classes)",
            markup=False,
        )
    return 0


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
