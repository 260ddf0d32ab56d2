"""The stack's datasets as the CLI sees them: where each is, its current manifest, `trainstack data list`, and
the ImageFolder check the built-in trainer needs (of a local folder before a push, of a pushed version before
`trainstack run --config`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from botocore.exceptions import ClientError
from rich.table import Table

from training.dataset_layout import is_hidden
from trainstack.aws import Clients, is_not_found
from trainstack.errors import CliError
from trainstack.output import console, print_json
from trainstack.stack import Stack, StackOutputs
from trainstack_job.contract import StackOutput
from trainstack_job.datasets import (
    DATASETS_PREFIX,
    DEFAULT_DATASET,
    NAMED_MANIFESTS,
    DatasetError,
    DatasetPlace,
    Manifest,
    label,
    parse_manifest,
    push_command,
    short,
)
from trainstack_job.shards import INDEX_NAME

# torchvision.datasets.folder.IMG_EXTENSIONS: what ImageFolder will load. Copied because the CLI is
# installed without torch; tests/cli check the two stay equal.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")


def place(outputs: StackOutputs, name: str) -> DatasetPlace:
    """Where dataset `name` lives in this stack's bucket; a bad name is one line."""
    try:
        return DatasetPlace.of(
            name,
            data_prefix=outputs.prefix(StackOutput.DATA_PREFIX),
            state_prefix=outputs.prefix(StackOutput.STATE_PREFIX),
        )
    except DatasetError as error:
        raise CliError(str(error)) from None


def read_manifest(clients: Clients, bucket: str, where: DatasetPlace) -> tuple[Manifest | None, str | None]:
    """The dataset's current version and the manifest object's ETag; (None, None) before its first push."""
    try:
        response = clients.s3().get_object(Bucket=bucket, Key=where.manifest_key)
    except ClientError as error:
        if is_not_found(error):
            return None, None
        raise
    body = response["Body"].read()
    try:
        manifest = parse_manifest(body, where, f"s3://{bucket}/{where.manifest_key}")
    except DatasetError as error:
        raise CliError(str(error)) from None
    return manifest, str(response["ETag"])


# -- the ImageFolder layout ------------------------------------------------------------------------


def _layout_problem(where: str, folders: Mapping[str, Mapping[str, Iterable[str]]]) -> list[str]:
    """The class names, if `folders` ({split: {class: [file names]}}) is an ImageFolder train/val pair."""
    layout = f"expected {where}/train/<class>/<image> and {where}/val/<class>/<image>"
    for split in SPLITS:
        if split not in folders:
            raise CliError(f"dataset {where}: no {split}/ folder; {layout}")
        classes = folders[split]
        if not classes:
            raise CliError(f"dataset {where}/{split}: no class folders; {layout}")
        for name in sorted(classes):
            if not any(PurePosixPath(f).suffix.lower() in IMG_EXTENSIONS for f in classes[name]):
                raise CliError(
                    f"dataset {where}/{split}/{name}: no image files ({', '.join(IMG_EXTENSIONS)}); "
                    "add images or remove the empty class folder"
                )
    train, val = set(folders["train"]), set(folders["val"])
    if train != val:
        raise CliError(
            f"dataset {where}: train/ and val/ must have the same class folders "
            f"(only in train/: {', '.join(sorted(train - val)) or '-'}; "
            f"only in val/: {', '.join(sorted(val - train)) or '-'})"
        )
    return sorted(train)


def validate_image_folder(root: Path) -> list[str]:
    """The class names, if the local folder `root` holds train/<class>/<image> and val/<class>/<image>."""
    if not root.is_dir():
        raise CliError(
            f"dataset {root}: not a directory; expected {root}/train/<class>/<image> and "
            f"{root}/val/<class>/<image>"
        )
    folders: dict[str, dict[str, list[str]]] = {}
    for split in SPLITS:
        if not (root / split).is_dir():
            continue
        classes = folders.setdefault(split, {})
        for folder in (root / split).iterdir():
            if folder.is_dir() and not is_hidden(folder.name):
                classes[folder.name] = [
                    p.name for p in folder.rglob("*") if p.is_file() and not is_hidden(p.relative_to(folder))
                ]
    return _layout_problem(str(root), folders)


def is_sharded(manifest: Manifest) -> bool:
    """Whether the version was pushed with `--format shards`: each split's index is in it."""
    return all(f"{split}/{INDEX_NAME}" in manifest.files for split in SPLITS)


def check_image_folder(manifest: Manifest, where: str) -> list[str]:
    """The class names, if a pushed dataset version is an ImageFolder train/val pair (what the built-in
    trainer reads) or its shards; `trainstack run --config` calls it before a job is queued.
    Raises CliError."""
    if is_sharded(manifest):
        if not manifest.classes:
            raise CliError(
                f"dataset {where}: shards without classes in its manifest; push it again with "
                "`trainstack data push DIR --format shards`"
            )
        return list(manifest.classes)
    folders: dict[str, dict[str, list[str]]] = {}
    for path in manifest.files:
        parts = PurePosixPath(path).parts
        if len(parts) >= 3 and parts[0] in SPLITS and not is_hidden(path):
            folders.setdefault(parts[0], {}).setdefault(parts[1], []).append(parts[-1])
    return _layout_problem(where, folders)


def require_pushed(clients: Clients, outputs: StackOutputs, name: str = DEFAULT_DATASET) -> Manifest:
    """The current version of dataset `name` (what `trainstack run` records as the job's `dataset_version`):
    one line when it was never pushed."""
    where = place(outputs, name)
    manifest, _ = read_manifest(clients, outputs.bucket, where)
    if manifest is None:
        raise CliError(
            f"{label(name)} has no pushed version (s3://{outputs.bucket}/{where.prefix} has no manifest): "
            f"push it first with `{push_command(name)}`"
        )
    return manifest


def require_image_folder(clients: Clients, outputs: StackOutputs, name: str = DEFAULT_DATASET) -> Manifest:
    """The current version of dataset `name`, checked as the built-in trainer's ImageFolder (`trainstack run
    --config`): one line when it was never pushed or is not one."""
    manifest = require_pushed(clients, outputs, name)
    check_image_folder(manifest, f"s3://{outputs.bucket}/{place(outputs, name).prefix.rstrip('/')}")
    return manifest


# -- trainstack data list ----------------------------------------------------------------------------


def list_datasets(clients: Clients, outputs: StackOutputs) -> list[dict[str, Any]]:
    """Every dataset with a manifest, the default one first; the default one also when it was uploaded
    without one (`aws s3 sync`): unversioned."""
    bucket = outputs.bucket
    names = [DEFAULT_DATASET]
    named_prefix = outputs.prefix(StackOutput.STATE_PREFIX) + NAMED_MANIFESTS
    pages = clients.s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=named_prefix)
    for page in pages:
        for item in page.get("Contents", []):
            stem = str(item["Key"])[len(named_prefix) :]
            if stem.endswith(".json") and "/" not in stem:
                names.append(stem.removesuffix(".json"))
    rows = []
    for name in names:
        where = place(outputs, name)
        manifest, _ = read_manifest(clients, bucket, where)
        if manifest is None:
            found = clients.s3().list_objects_v2(Bucket=bucket, Prefix=where.prefix, MaxKeys=1)
            if not found.get("KeyCount"):
                continue
        rows.append(
            {
                "name": name,
                "prefix": f"s3://{bucket}/{where.prefix}",
                "version": manifest.version if manifest else None,
                "files": len(manifest.files) if manifest else None,
                "bytes": manifest.total_bytes if manifest else None,
                "pushed_at": manifest.pushed_at if manifest else None,
            }
        )
    return rows


def run_list(clients: Clients, stack: Stack, *, as_json: bool) -> int:
    rows = list_datasets(clients, stack.outputs)
    if as_json:
        print_json(rows)
        return 0
    if not rows:
        console().print(
            f"no datasets in s3://{stack.outputs.bucket}/ yet: `trainstack data push DIR` (the default, "
            f"under data/) or `trainstack data push DIR --name NAME` (under {DATASETS_PREFIX}NAME/)",
            markup=False,
        )
        return 0
    table = Table("dataset", "version", "files", "size", "pushed at", "where")
    for row in rows:
        unversioned = row["version"] is None
        table.add_row(
            row["name"] or "(default)",
            "unversioned (no manifest: pushed without trainstack)" if unversioned else short(row["version"]),
            "-" if unversioned else f"{row['files']:,}",
            "-" if unversioned else _size(row["bytes"]),
            row["pushed_at"] or "-",
            row["prefix"],
        )
    console().print(table)
    return 0


def _size(size: int) -> str:
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"
