"""`trainstack data push DIR [--name DATASET]`: any files, sent incrementally, published as one new version.

Only what changed is sent: a file whose size and sha256 match the current manifest (and whose object still
has the ETag recorded there) is skipped, and so is an object that a failed push already uploaded (its
`x-amz-meta-sha256` says what it holds). The new manifest is written only after every upload is confirmed,
so the dataset's version never names files that are not all there; `--delete` removes the objects of files
no longer in DIR after that.
"""

from __future__ import annotations

import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from boto3.s3.transfer import create_transfer_manager
from botocore.exceptions import BotoCoreError, ClientError

from training.dataset_layout import is_hidden
from trainstack.aws import Clients, explain
from trainstack.datasets import IMG_EXTENSIONS, SPLITS, place, read_manifest, validate_image_folder
from trainstack.errors import CliError
from trainstack.output import console, print_json
from trainstack.stack import Stack, StackOutputs
from trainstack.state import (
    current_job_id,
    encryption_args,
    read_group,
    read_job,
    read_json,
    training_runs,
)
from trainstack.transfer import TRANSFER_CONFIG, ProgressSubscriber, list_objects, progress_bar
from trainstack_job.datasets import (
    DEFAULT_DATASET,
    SHA256_METADATA,
    DatasetPlace,
    Manifest,
    ManifestFile,
    label,
    short,
)
from trainstack_job.jobs import LEGACY_JOB_ID, JobPrefixes
from trainstack_job.layout import sha256_file
from trainstack_job.records import is_conflict, write_condition
from trainstack_job.shards import DEFAULT_SHARD_BYTES, write_split

# --layout: auto = checked as ImageFolder when the built-in trainer reads this dataset (below).
LAYOUTS = ("auto", "image-folder", "any")
# --format: files = DIR's files as they are; shards = each split as tar shards plus an index, which the
# built-in trainer streams (`data.mode: stream`) instead of syncing the whole dataset first.
FORMATS = ("files", "shards")
_HEAD_THREADS = 16
_SHOWN = 5


@dataclass(frozen=True)
class LocalFile:
    relative: str  # posix path under DIR: train/cat/1.jpg
    path: Path
    size: int
    sha256: str


def _named(items: list[str]) -> str:
    more = f" and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return ", ".join(items[:_SHOWN]) + more


def _hashed(
    root: Path, found: list[tuple[str, Path]], unreadable: list[str], *, quiet: bool
) -> list[LocalFile]:
    """Each file with its size and sha256 (a progress bar: hashing a large dataset takes a while); a file
    that cannot be read goes to `unreadable` with why."""
    sizes: dict[str, int] = {}
    for relative, path in found:
        try:
            sizes[relative] = path.stat().st_size
        except OSError as error:
            unreadable.append(f"{relative} ({error.strerror or error})")
    files: list[LocalFile] = []
    with progress_bar(f"hash {root}", sum(sizes.values()), quiet=quiet) as advance:
        for relative, path in found:
            if relative not in sizes:
                continue
            try:
                files.append(LocalFile(relative, path, sizes[relative], sha256_file(path)))
            except OSError as error:
                unreadable.append(f"{relative} ({error.strerror or error})")
            advance(sizes[relative])
    return files


def scan(root: Path, *, quiet: bool = True) -> list[LocalFile]:
    """Every file under `root` but hidden ones (.DS_Store, .ipynb_checkpoints/, __MACOSX/: the instance
    would not download them), hashed. A linked file inside `root` is pushed with the content it links to; a
    link that leaves `root`, and any file that cannot be read, is refused by name before anything is sent."""
    base = root.resolve()
    escaping: list[str] = []
    unreadable: list[str] = []
    found: list[tuple[str, Path]] = []
    # Linked folders are never walked into (no loops): one leaving DIR is refused, one inside it is skipped,
    # its files being pushed once, under their own path.
    for current, dirs, names in os.walk(root):
        folder = Path(current)
        kept = []
        for name in sorted(dirs):
            path = folder / name
            relative = path.relative_to(root).as_posix()
            if is_hidden(relative):
                continue
            if path.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(base):
                    escaping.append(f"{relative} -> {target}")
                continue
            kept.append(name)
        dirs[:] = kept
        for name in sorted(names):
            path = folder / name
            relative = path.relative_to(root).as_posix()
            if is_hidden(relative):
                continue
            target = path.resolve()
            if path.is_symlink() and not target.is_relative_to(base):
                escaping.append(f"{relative} -> {target}")
            elif not path.exists():
                unreadable.append(f"{relative} (broken link)")
            elif not path.is_file():
                unreadable.append(f"{relative} (not a regular file)")
            else:
                found.append((relative, path))
    if escaping:
        raise CliError(
            f"{root}: {len(escaping)} symbolic link(s) lead outside it: {_named(escaping)}; copy those "
            "files into the folder or remove the links (a push sends only what is inside DIR)"
        )
    files = _hashed(root, found, unreadable, quiet=quiet)
    if unreadable:
        raise CliError(
            f"{root}: cannot read {len(unreadable)} file(s): {_named(unreadable)}; fix their "
            "permissions or remove them, then push again"
        )
    return files


def _job_reading(clients: Clients, outputs: StackOutputs) -> tuple[str, dict[str, Any] | None]:
    """The current job and its record's agent fields (None: the legacy job, or a job without a record)."""
    job_id = current_job_id(clients, outputs)
    if job_id == LEGACY_JOB_ID:
        return job_id, None
    record = read_json(clients, outputs.bucket, str(JobPrefixes.of(job_id).record))
    agent = record.get("agent") if record else None
    return job_id, agent if isinstance(agent, dict) else None


def _builtin_trainer_reads(agent: dict[str, Any] | None, name: str) -> bool:
    """Whether the stack's current job is the built-in trainer reading this dataset. A named dataset is
    checked when a job names it (`trainstack run --config`); the default one is the built-in trainer's unless
    the current job's record says it runs a job of the user's own (a stack without records: the trainer)."""
    if name != DEFAULT_DATASET:
        return False
    if agent is None:
        return True
    return agent.get("user_job") is None and not agent.get("dataset")


def _refuse_while_training(
    clients: Clients, outputs: StackOutputs, job_id: str, agent: Any, name: str
) -> None:
    reads = str((agent or {}).get("dataset") or DEFAULT_DATASET)
    if reads != name:
        return
    group = read_group(clients, outputs.group_name)
    job = read_job(clients, outputs, JobPrefixes.of(job_id))
    if training_runs(group, job):
        raise CliError(
            f"training is running on {group.in_service} instance(s) of {group.name} (job {job_id}) on "
            f"{label(name)}: a new version mid-run would not match its checkpoints; run `trainstack stop` "
            "first, or pass --force"
        )


def _already_there(clients: Clients, bucket: str, keys: dict[str, LocalFile]) -> set[str]:
    """The keys whose object holds the local file already (its sha256 metadata): an upload of a push that
    failed later, or the same files pushed by hand before a manifest existed."""

    def holds(key: str) -> bool:
        try:
            head = clients.s3().head_object(Bucket=bucket, Key=key)
        except ClientError:
            return False
        return bool(head.get("Metadata", {}).get(SHA256_METADATA) == keys[key].sha256)

    with ThreadPoolExecutor(_HEAD_THREADS) as pool:
        return {key for key, yes in zip(keys, pool.map(holds, keys), strict=True) if yes}


def _unchanged(
    clients: Clients,
    bucket: str,
    where: DatasetPlace,
    files: list[LocalFile],
    previous: Manifest | None,
    remote: dict[str, dict[str, Any]],
) -> dict[str, str]:
    """{relative path: the ETag of the object that already holds it} for the files not to send again: the
    manifest knows the file and its object was not replaced since, or the object's sha256 metadata says so."""
    known = previous.files if previous else {}
    unchanged: dict[str, str] = {}
    maybe: dict[str, LocalFile] = {}
    for file in files:
        key = where.prefix + file.relative
        current, entry = remote.get(key), known.get(file.relative)
        if current is None or current["Size"] != file.size:
            continue
        if entry is not None and entry.sha256 == file.sha256 and entry.etag == current["ETag"]:
            unchanged[file.relative] = current["ETag"]
        else:
            maybe[key] = file
    for key in _already_there(clients, bucket, maybe) if maybe else set():
        unchanged[maybe[key].relative] = remote[key]["ETag"]
    return unchanged


def _upload(
    clients: Clients,
    bucket: str,
    where: DatasetPlace,
    files: list[LocalFile],
    extra: dict[str, Any],
    *,
    quiet: bool,
) -> list[str]:
    """Upload `files` with the transfer manager (multipart, concurrent); the relative paths that failed,
    each with its one-line reason."""
    failed: list[str] = []
    total = sum(f.size for f in files)
    with (
        progress_bar(f"push → s3://{bucket}/{where.prefix}", total, quiet=quiet) as advance,
        create_transfer_manager(clients.s3(), TRANSFER_CONFIG) as manager,
    ):
        futures = [
            manager.upload(
                str(f.path),
                bucket,
                where.prefix + f.relative,
                extra_args={**extra, "Metadata": {SHA256_METADATA: f.sha256}},
                subscribers=[ProgressSubscriber(advance)],
            )
            for f in files
        ]
        for file, future in zip(files, futures, strict=True):
            try:
                future.result()
            except (BotoCoreError, ClientError) as error:
                failed.append(f"{file.relative} ({explain(error)})")
            except OSError as error:
                failed.append(f"{file.relative} ({error.strerror or error})")
    return failed


def _confirmed(
    bucket: str,
    where: DatasetPlace,
    files: list[LocalFile],
    listed: dict[str, dict[str, Any]],
    *,
    dry_run: bool,
) -> dict[str, ManifestFile]:
    """The new version's entries, once every file is listed at its size (with the ETag the manifest records,
    which the agent checks before it syncs); a dry run records what it has."""
    entries: dict[str, ManifestFile] = {}
    for file in files:
        item = listed.get(where.prefix + file.relative)
        if not dry_run and (item is None or item["Size"] != file.size):
            raise CliError(
                f"s3://{bucket}/{where.prefix}{file.relative} is missing or not {file.size} bytes after its "
                f"upload (changed by someone else?): push again; {label(where.name)} was not changed"
            )
        entries[file.relative] = ManifestFile(file.size, file.sha256, item["ETag"] if item else None)
    return entries


def _delete(clients: Clients, bucket: str, keys: list[str]) -> None:
    """After the new manifest: the old version loses files, the new one never names them."""
    for start in range(0, len(keys), 1000):
        clients.s3().delete_objects(
            Bucket=bucket,
            Delete={"Objects": [{"Key": k} for k in keys[start : start + 1000]], "Quiet": True},
        )


def _write_manifest(
    clients: Clients,
    bucket: str,
    where: DatasetPlace,
    manifest: Manifest,
    etag: str | None,
    extra: dict[str, Any],
) -> None:
    """Publish the new version; conditional on the manifest read at the start, so two pushes of one dataset
    at once never leave a manifest that lists the other's files."""
    # Typed loosely: the stubs want each keyword's own literal type, and these are S3's condition headers.
    condition: dict[str, Any] = write_condition(etag)
    try:
        clients.s3().put_object(
            Bucket=bucket,
            Key=where.manifest_key,
            Body=json.dumps(manifest.to_json(where.prefix), indent=1).encode(),
            ContentType="application/json",
            **condition,
            **extra,
        )
    except ClientError as error:
        if is_conflict(error):
            raise CliError(
                f"s3://{bucket}/{where.manifest_key} changed during this push (another push of "
                f"{label(where.name)}?): push again; files already sent are not sent again"
            ) from None
        raise


def write_shards(root: Path, out: Path, classes: list[str], shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Each split of the ImageFolder `root` as shards plus `shards.json` under `out/<split>/`: the images the
    trainer's ImageFolder would load (visible, an image extension, any depth under their class folder)."""
    labels = {name: number for number, name in enumerate(classes)}
    for split in SPLITS:
        split_dir = root / split
        files: list[tuple[str, int]] = []
        for name in classes:
            for current, dirs, names in os.walk(split_dir / name, followlinks=True):
                dirs[:] = sorted(d for d in dirs if not is_hidden(d))
                for file in sorted(names):
                    path = Path(current) / file
                    relative = path.relative_to(split_dir).as_posix()
                    if not is_hidden(relative) and path.suffix.lower() in IMG_EXTENSIONS:
                        files.append((relative, labels[name]))
        write_split(split_dir, classes, files, out / split, shard_bytes)


def push(
    clients: Clients,
    stack: Stack,
    root: Path,
    *,
    name: str = DEFAULT_DATASET,
    delete: bool = False,
    dry_run: bool = False,
    force: bool = False,
    layout: str = "auto",
    quiet: bool = False,
    format: str = "files",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> dict[str, Any]:
    """Push `root` as dataset `name`'s next version; returns what was done (the --json summary). With
    `format="shards"` the version holds the ImageFolder's splits as shards (trainstack_job/shards.py) rather
    than its files; the shards are written byte-identical for identical images, so a re-push sends only the
    shards whose images changed."""
    if format not in FORMATS:
        raise CliError(f"--format {format}: not one of {', '.join(FORMATS)}; use files (default) or shards")
    if format == "shards":
        if layout == "any":
            raise CliError(
                "--format shards needs an ImageFolder (DIR/train/<class>/<image>): drop --layout any"
            )
        if not root.is_dir():
            raise CliError(f"{root}: not a directory; pass the folder that holds the dataset's files")
        classes = validate_image_folder(root)
        with tempfile.TemporaryDirectory(prefix="trainstack-shards-") as staging:
            write_shards(root, Path(staging), classes, shard_bytes)
            summary = _push(
                clients, stack, Path(staging), name, delete, dry_run, force, "any", quiet, classes
            )
        summary["format"] = "shards"
        return summary
    return {
        **_push(clients, stack, root, name, delete, dry_run, force, layout, quiet, None),
        "format": "files",
    }


def _push(
    clients: Clients,
    stack: Stack,
    root: Path,
    name: str,
    delete: bool,
    dry_run: bool,
    force: bool,
    layout: str,
    quiet: bool,
    shard_classes: list[str] | None,
) -> dict[str, Any]:
    outputs = stack.outputs
    where = place(outputs, name)
    bucket = outputs.bucket
    if not root.is_dir():
        raise CliError(f"{root}: not a directory; pass the folder that holds the dataset's files")
    job_id, agent = _job_reading(clients, outputs)
    classes = shard_classes
    if layout == "image-folder" or (layout == "auto" and _builtin_trainer_reads(agent, name)):
        try:
            classes = validate_image_folder(root)
        except CliError as error:
            raise CliError(
                f"{error} (checked because the built-in trainer reads {label(name)}; "
                "a job of your own reads any files: pass --layout any)"
            ) from None
    if not force and not dry_run:
        _refuse_while_training(clients, outputs, job_id, agent, name)
    files = scan(root, quiet=quiet)
    if not files:
        raise CliError(f"{root}: no files to push (hidden files and folders are left out)")
    previous, manifest_etag = read_manifest(clients, bucket, where)
    remote = list_objects(clients, bucket, where.prefix)
    unchanged = _unchanged(clients, bucket, where, files, previous, remote)
    to_upload = [f for f in files if f.relative not in unchanged]
    local_keys = {where.prefix + f.relative for f in files}
    not_local = sorted(set(remote) - local_keys)
    summary: dict[str, Any] = {
        "dataset": name,
        "destination": f"s3://{bucket}/{where.prefix}",
        "classes": classes,
        "files": len(files),
        "bytes": sum(f.size for f in files),
        "uploaded": len(to_upload),
        "uploaded_bytes": sum(f.size for f in to_upload),
        "unchanged": len(unchanged),
        "deleted": len(not_local) if delete else 0,
        "not_local": 0 if delete else len(not_local),
        "previous_version": previous.version if previous else None,
        "dry_run": dry_run,
    }
    extra = encryption_args(outputs)
    if to_upload and not dry_run:
        failed = _upload(clients, bucket, where, to_upload, extra, quiet=quiet)
        if failed:
            kept = f"version {short(previous.version)}" if previous else "no version (none pushed yet)"
            raise CliError(
                f"push to s3://{bucket}/{where.prefix}: {len(failed)} of {len(to_upload)} upload(s) failed: "
                f"{_named(failed)}; {label(name)} stays at {kept}; run the same push again to send "
                "the rest (what arrived is not sent again)"
            )
    listed = list_objects(clients, bucket, where.prefix) if to_upload and not dry_run else remote
    entries = _confirmed(bucket, where, files, listed, dry_run=dry_run)
    manifest = Manifest(
        name, entries, pushed_at=datetime.now().astimezone().isoformat(timespec="seconds"), classes=classes
    )
    summary["version"] = manifest.version
    changed = previous is None or previous.version != manifest.version or previous.files != entries
    summary["changed"] = changed
    if dry_run:
        return summary
    if changed:
        _write_manifest(clients, bucket, where, manifest, manifest_etag, extra)
    if delete:
        _delete(clients, bucket, not_local)
    return summary


def run_push(
    clients: Clients,
    stack: Stack,
    root: Path,
    *,
    name: str = DEFAULT_DATASET,
    delete: bool = False,
    dry_run: bool = False,
    force: bool = False,
    layout: str = "auto",
    as_json: bool = False,
    format: str = "files",
) -> int:
    summary = push(
        clients,
        stack,
        root,
        name=name,
        delete=delete,
        dry_run=dry_run,
        force=force,
        layout=layout,
        quiet=as_json,
        format=format,
    )
    if as_json:
        print_json(summary)
        return 0
    console().print(_describe(summary), markup=False, soft_wrap=True)
    return 0


def _describe(summary: dict[str, Any]) -> str:
    name = summary["dataset"]
    version = short(summary["version"])
    would = "would be " if summary["dry_run"] else ""
    if not summary["uploaded"] and not summary["deleted"] and not summary["changed"]:
        line = (
            f"{label(name)} is unchanged at version {version}: nothing to upload "
            f"({summary['files']} file(s) already in {summary['destination']})"
        )
    else:
        line = (
            f"{summary['uploaded']} file(s) {would}uploaded ({summary['uploaded_bytes']:,} bytes), "
            f"{summary['unchanged']} unchanged, {summary['deleted']} {would}deleted "
            f"→ {summary['destination']}: "
            f"{label(name)} {'would be' if summary['dry_run'] else 'is now'} version {version}"
        )
        if summary["previous_version"]:
            line += f" (was {short(summary['previous_version'])})"
    if summary["classes"]:
        line += f"; {len(summary['classes'])} classes"
    if summary.get("format") == "shards":
        line += "; as shards (the built-in trainer streams them with data.mode: stream)"
    if summary["not_local"]:
        line += (
            f"; {summary['not_local']} remote file(s) not in DIR kept, outside the version "
            "(--delete removes them)"
        )
    return line
