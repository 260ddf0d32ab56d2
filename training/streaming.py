"""A split read from shards (`trainstack data push DIR --format shards`) instead of a synced ImageFolder:
training starts once the first shards are local, not once the whole dataset is.

Why plain tar shards read by offset, not a streaming library: the trainer's exact resume rests on a
map-style dataset keyed by (epoch, sample index) and on ResumableBatchSampler, whose position (epoch, step)
is in every checkpoint. webdataset and s3torchconnector's tar reader are iterable datasets (no random
access: a resume replays or skips the stream, and worker sharding changes the order with the worker count);
litdata brings its own loader, sampler and checkpointable state, which would replace (and re-verify) ours.
So the sampler keeps its design with a shard-aware order (shards shuffled, then samples within a window of
shards, from seed + epoch), and this module fetches each shard whole with boto3's transfer manager (the
parallel ranged GETs s5cmd and s3torchconnector also use) into a bounded local cache, reading ahead of the
sampler. The shards stay in webdataset's layout, so those libraries can read them for jobs of your own.

The cache is content-addressed (the shard's sha256 is its file name): a later life on the same disk, or a
new dataset version sharing shards, reuses what is there. A cached shard is checked against its sha256 once
per cache, not once per process: the check (or the download, checked before its rename) leaves
`<sha256>.ok` beside it, recording the file's identity as stat shows it (size, mtime in ns, inode), and any
process that finds the file still of that identity trusts it without hashing. Without the marker each
persistent loader worker would hash the whole dataset once per life (1.2 TB of sha256 for 150 GB and 8
workers). What the marker does not see is damage that leaves the identity unchanged (the disk's own bit
rot); a copy written over, or a crash before the download reached the disk, has no marker of its identity and
is hashed (the download is fsynced before its rename, and the marker is written after it). The cache's
recency (least recently used evicted first) is the marker's mtime, since the tar's is part of its identity.

A download is checked before its rename. Where the agent placed the shard's ETag in the index (from the
dataset version's manifest), every GET of it carries If-Match: S3 serves the pushed object or refuses it, so
only the size is checked, and the bytes are not read back to hash (that pass was half the download's CPU, on
the cores that decode). An index without ETags (read straight from S3) has each download hashed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast, overload

from PIL import Image

from training.dataset_layout import BadDataError
from trainstack_job.layout import sha256_file
from trainstack_job.records import is_conflict
from trainstack_job.shards import INDEX_NAME, SampleEntry, ShardError, ShardIndex, ShardInfo, read_sample

log = logging.getLogger("training")

# Where shards are cached when data.cache_dir is empty: the agent exports the instance's scratch (NVMe).
CACHE_ENV = "TRAINSTACK_DATA_CACHE"
# How long a shard download keeps retrying through S3 errors (an outage) before the life fails (retried).
OUTAGE_SECONDS = 600.0
# Open shard files kept per process: enough for a shuffle window and the eval split.
_OPEN_SHARDS = 16
# Left free on the cache's disk whatever data.cache_gb says: checkpoints and logs share it.
FREE_DISK_BYTES = 2 * 10**9
# A shard is downloaded as ranged GETs (boto3's transfer manager), at most PARALLEL_PARTS at a time, each on
# its own connection. S3 serves one connection at about 100 MB/s and the read-ahead fetches one shard at a
# time, so it reads at min(parts, PARALLEL_PARTS) x the per-connection rate: a 32 MB shard in one 32 MiB part
# is one connection. Measured (`python -m bench.streaming --throttle-mbps 20 --moto-process`, 2026-12-07):
# streaming 32 MB shards read 207 samples/s (23 MB/s) in 32 MiB parts and 469 (52 MB/s) in 8 MiB parts;
# 16 MB shards 199 and 283-318. So a shard is cut into PARALLEL_PARTS parts where that keeps them at least
# MIN_PART_BYTES (S3's performance guidelines suggest 8-16 MB ranges; smaller ones pay a request's
# first-byte latency for too few bytes), and never into parts above MAX_PART_BYTES: the default 512 MB
# shard keeps its 32 MiB parts (already 8 in flight), a 64 MB one gets 8 parts of 8 MiB, not 2 of 32 MiB.
MIN_PART_BYTES = 8 * 2**20
MAX_PART_BYTES = 32 * 2**20
PARALLEL_PARTS = 8
# Shards the read-ahead fetches at once (data.read_ahead_shards of them, at most this many). One at a
# time, its bandwidth was one shard's parts' (measured at 20 MB/s per connection: the cold stream waited
# 1.6 s of 2.7 s for data, 16 MB shards in 8 MiB parts); N at once, N times that. Four shards of 8 parts
# are 32 connections, about 3 GB/s at S3's 100 MB/s each: more than any loader decodes.
MAX_CONCURRENT_SHARDS = 4
# The transfer manager's read from each part's response, written to the file: 1 MiB, not its default 256 KiB.
# Four times fewer queue hand-offs and writes per byte: the download's CPU fell from 1.38 to 1.07 ms per MB
# (64 MB shards in 8 MiB parts, moto on this machine; 4 MiB measured no better). The loader's cores decode.
IO_CHUNK_BYTES = 2**20
# A marker's temporary file older than this was left by a killed process (a live one lives milliseconds).
_STALE_MARKER_SECONDS = 600.0
_FIX = "push the dataset again with `trainstack data push DIR --format shards`"


def part_size(shard_bytes: int) -> int:
    """The part size a shard of `shard_bytes` is downloaded in: PARALLEL_PARTS parts, within
    MIN_PART_BYTES..MAX_PART_BYTES (see above)."""
    return min(MAX_PART_BYTES, max(MIN_PART_BYTES, -(-shard_bytes // PARALLEL_PARTS)))


def index_location(root: str) -> str | None:
    """The shard index `root` names (an index file, or a folder or S3 prefix holding one), else None."""
    if root.startswith("s3://"):
        return root if root.endswith(".json") else root.rstrip("/") + "/" + INDEX_NAME
    path = Path(root)
    if path.is_file() and path.name.endswith(".json"):
        return str(path)
    if (path / INDEX_NAME).is_file():
        return str(path / INDEX_NAME)
    return None


def _split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    return bucket, key


def _s3_client() -> Any:
    from botocore.config import Config as BotoConfig

    from training.sessions import new_session

    # Adaptive retries ride out throttling; the loop in _download rides out longer outages. The pool holds
    # every connection the read-ahead's concurrent shards open (botocore's default, 10, would cap them).
    # A session of its own: the read-ahead's threads may make clients at once, and boto3's shared default
    # session is not thread-safe. botocore's parsed models are shared (training/sessions.py).
    return new_session().client(
        "s3",
        config=BotoConfig(
            retries={"max_attempts": 5, "mode": "adaptive"},
            max_pool_connections=PARALLEL_PARTS * MAX_CONCURRENT_SHARDS,
        ),
    )


@dataclass(frozen=True)
class CacheSettings:
    """data.cache_dir / data.cache_gb / data.read_ahead_shards / data.shuffle_window_shards."""

    cache_dir: str = ""
    max_bytes: int = 50 * 10**9
    read_ahead: int = 2
    window: int = 4
    part_bytes: int = 0  # a download's part size; 0: part_size(shard). Not a config key: for the bench

    def directory(self, placed: str = "") -> Path:
        """data.cache_dir, else the folder the agent named in the index (`placed`), else the environment's."""
        chosen = (
            self.cache_dir
            or placed
            or os.environ.get(CACHE_ENV)
            or str(Path(tempfile.gettempdir()) / "trainstack-shards")
        )
        return Path(chosen)


class ShardCache:
    """The local copies of one split's shards: fetched on demand (or ahead), verified, bounded in size."""

    def __init__(self, index_uri: str, index: ShardIndex, settings: CacheSettings) -> None:
        # The agent's copy of an index names where the shards are; an index read where it was pushed has
        # them beside it.
        self.base = (index.source or index_uri.rsplit("/", 1)[0]).rstrip("/")
        self.remote = self.base.startswith("s3://")
        self.index = index
        self.settings = settings
        self._client: Any = None
        # The process that made `_client` (None: given, e.g. by a test). A loader worker forked after the
        # read-ahead made it inherits it, pooled connections and all, which two processes must never share.
        self._client_pid: int | None = None
        self._verified: set[str] = set()  # the sha256 of the shards this process has checked on disk

    def __getstate__(self) -> dict[str, Any]:
        # Sent to loader workers: each makes its own client (boto3 clients do not cross processes).
        return {**self.__dict__, "_client": None, "_client_pid": None}

    def _s3(self) -> Any:
        """This process's S3 client, made on first use (two threads at once may both make one: harmless)."""
        if self._client is None or self._client_pid not in (None, os.getpid()):
            self._client, self._client_pid = _s3_client(), os.getpid()
        return self._client

    def uri(self, shard: int) -> str:
        return f"{self.base}/{self.index.shards[shard].key}"

    def path(self, shard: int) -> Path:
        """The local file of shard number `shard`, fetched first when it is not there yet (or when the
        copy there is not the index's: checked by sha256 once per cache, see `_intact`)."""
        if not self.remote:
            return Path(self.uri(shard))
        info = self.index.shards[shard]
        directory = self.settings.directory(self.index.cache_dir)
        target = directory / f"{info.sha256}.tar"
        if target.exists() and self._intact(target, shard):
            try:
                # Recently used: evicted last. The marker's mtime, not the tar's (part of its identity).
                os.utime(_marker(target))
            except FileNotFoundError:
                pass  # being evicted (the marker goes first), or never marked: looked at under the lock
            else:
                if target.exists():
                    return target
                # Evicted just after its check (the read-ahead made room): fetched again below.
        directory.mkdir(parents=True, exist_ok=True)
        # One download per shard across the read-ahead thread and every loader worker of every rank.
        with (directory / f"{info.sha256}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            # Checked again under the lock: another process may have fetched it again meanwhile. (Absent,
            # or evicted meanwhile, is not damaged: fetched below without a warning.)
            if not self._intact(target, shard) and target.exists():
                # A crash before the shard reached the disk, or the disk's own damage: the name promises
                # the index's bytes, so the copy is fetched again rather than served (or blamed on the
                # dataset: S3's copy is fine).
                log.warning(
                    "shard %s: the cached copy %s is damaged; fetching it again", self.uri(shard), target
                )
                _unlink_shard(target)
            if not target.exists():
                # What a killed process left of this shard is never reused: the download starts over.
                _remove_partials(directory, info.sha256)
                self._download(shard, target)
                self._evict(keep=target)
        return target

    def _intact(self, target: Path, shard: int) -> bool:
        """Whether the cached file holds the index's bytes: its size, then its marker (`<sha256>.ok`, left by
        whichever process last checked or downloaded this very file), else its sha256 (marked when it
        matches). Once true in a process, true there without a stat: a loader worker opening it again trusts
        its own check."""
        info = self.index.shards[shard]
        if info.sha256 in self._verified:
            return True
        try:
            # The identity before the hash: a file replaced or written over while it is hashed then does not
            # match the marker this writes (its inode or mtime differs).
            identity = target.stat()
            if identity.st_size != info.size:
                return False
            if _marked(target, identity):
                self._verified.add(info.sha256)
                return True  # its marker says so already: nothing to write (each worker would, per shard)
            intact = sha256_file(target) == info.sha256
        except FileNotFoundError:
            return False  # evicted meanwhile: fetched again
        if intact:
            self._verified.add(info.sha256)
            _mark(target, identity)
        return intact

    def _download(self, shard: int, target: Path) -> None:
        from boto3.exceptions import RetriesExceededError
        from boto3.s3.transfer import TransferConfig
        from botocore.exceptions import BotoCoreError, ClientError

        info = self.index.shards[shard]
        uri = self.uri(shard)
        bucket, key = _split_s3(uri)
        partial = target.with_suffix(".part")
        deadline = time.monotonic() + OUTAGE_SECONDS
        pause = 1.0
        started = time.monotonic()
        pinned = bool(info.etag) and _can_pin()
        config = TransferConfig(
            max_concurrency=PARALLEL_PARTS,
            multipart_chunksize=self.settings.part_bytes or part_size(info.size),
            io_chunksize=IO_CHUNK_BYTES,
        )
        if pinned:
            config.multipart_threshold = 1  # one-part shards too by the ranged path: its GETs send If-Match
        while True:
            try:
                if pinned:
                    _download_pinned(self._s3(), bucket, key, partial, config, info)
                else:
                    self._s3().download_file(bucket, key, str(partial), Config=config)
                break
            except ClientError as error:
                code = str(error.response.get("Error", {}).get("Code", ""))
                if code in {"404", "NoSuchKey", "NotFound"}:
                    raise BadDataError(f"shard {uri} is missing from S3; {_FIX}") from None
                if pinned and is_conflict(error):  # its If-Match refused (S3 answers 412)
                    raise _changed(uri, info) from None
                if code in {"403", "AccessDenied"} or time.monotonic() > deadline:
                    raise
                problem: Exception = error
            except _PinRefusedError:
                raise _changed(uri, info) from None
            # RetriesExceededError: the connection lost mid-shard after the transfer's own retries (boto3's
            # error, not botocore's): the same outage, waited out too.
            except (BotoCoreError, RetriesExceededError) as error:
                if time.monotonic() > deadline:
                    raise
                problem = error
            except OSError as error:
                # A local disk error is not an outage: waiting 10 minutes would not free the disk.
                raise self._disk_error(error, shard, target.parent) from None
            log.warning("shard %s: %s; retrying in %.0fs (S3 unreachable?)", uri, problem, pause)
            time.sleep(pause)
            pause = min(pause * 2, 30.0)
        # The identity the marker records: stat before the hash; the fsync and the rename keep it.
        identity = partial.stat()
        size = identity.st_size
        # Pinned to the pushed object's ETag, the bytes are the pushed ones (S3 refuses any other object,
        # and a short body fails the transfer): a second pass over them to hash would be half the
        # download's CPU (0.55 ms per MB of sha256 on the loader's cores, against about 1 for the rest).
        if size != info.size or (not pinned and sha256_file(partial) != info.sha256):
            partial.unlink(missing_ok=True)
            raise BadDataError(
                f"shard {uri} is corrupt (its {size} bytes do not match the index's size {info.size} and "
                f"sha256); {_FIX}"
            )
        try:
            # On the disk before its name says it is whole: a crash after the rename leaves no short copy.
            with partial.open("rb") as written:
                os.fsync(written.fileno())
            partial.rename(target)
        except OSError as error:  # the disk filled as the written bytes were flushed, or failed
            raise self._disk_error(error, shard, target.parent) from None
        self._verified.add(info.sha256)
        _mark(target, identity)
        log.debug("shard %s: %d bytes in %.2fs", uri, size, time.monotonic() - started)

    def _disk_error(self, error: OSError, shard: int, directory: Path) -> OSError:
        """What to raise for the disk's `error` while caching `shard`, its partial file deleted (nothing
        cached before is touched): a full disk is one line naming the folder, the shard and the fix (the
        trainer prints `error: FOLDER: LINE`); any other error is itself."""
        info = self.index.shards[shard]
        _remove_partials(directory, info.sha256)
        if error.errno != errno.ENOSPC:
            return error
        free = shutil.disk_usage(directory).free
        return OSError(
            errno.ENOSPC,
            f"disk full while caching shard {self.uri(shard)} ({info.size / 1e9:.1f} GB) in {directory} "
            f"({free / 1e9:.1f} GB free); free space there, lower data.cache_gb or set "
            "data.cache_dir to a larger disk",
            str(directory),
        )

    def _evict(self, keep: Path) -> None:
        """Delete the least recently used shards past the size bound, or past what the disk can hold
        keeping FREE_DISK_BYTES free (data.cache_gb may be larger than a small root volume). A reader
        holding an evicted shard open keeps reading it: the file goes when it closes it. Each download
        evicts once its shard is in place, so the bound is exceeded only by the shards in flight at once
        (the read-ahead's, at most MAX_CONCURRENT_SHARDS), for as long as their downloads end."""
        _remove_stale_partials(keep.parent)
        entries = []
        for path in keep.parent.glob("*.tar"):
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue  # another process evicted it
            try:
                used = _marker(path).stat().st_mtime  # the last use (path() touches the marker)
            except FileNotFoundError:
                try:
                    used = path.stat().st_mtime  # not marked (yet): its download's time
                except FileNotFoundError:
                    continue
            entries.append((used, size, path))
        total = sum(size for _, size, _ in entries)
        fits = total + shutil.disk_usage(keep.parent).free - FREE_DISK_BYTES
        limit = min(self.settings.max_bytes, fits)
        for _, size, path in sorted(entries):
            if total <= limit:
                break
            if path != keep:
                _unlink_shard(path)
                total -= size


def _can_pin() -> bool:
    """Whether this s3transfer sends If-Match with the ETag it is given (0.11 and later; the trainer's
    boto3>=1.34 allows older, whose downloads are hashed as before). The instances' lock has 0.19."""
    from s3transfer.futures import TransferMeta

    return hasattr(TransferMeta, "provide_object_etag")


def _download_pinned(client: Any, bucket: str, key: str, partial: Path, config: Any, info: ShardInfo) -> None:
    """Download `key` into `partial` with every ranged GET conditional on `info.etag` (If-Match: S3 answers
    412 for any other object) and no HEAD first (the index gives the size)."""
    from boto3.exceptions import RetriesExceededError
    from boto3.s3.transfer import create_transfer_manager
    from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceededError
    from s3transfer.exceptions import S3DownloadFailedError
    from s3transfer.subscribers import BaseSubscriber

    class Pin(BaseSubscriber):
        """The object's size and ETag, known before the transfer starts."""

        def on_queued(self, future: Any, **_: Any) -> None:
            future.meta.provide_transfer_size(info.size)
            future.meta.provide_object_etag(info.etag)

    try:
        with create_transfer_manager(client, config) as manager:
            manager.download(bucket, key, str(partial), subscribers=[Pin()]).result()
    except TransferRetriesExceededError as error:
        # What boto3's download_file raises for it (a connection lost mid-shard): the caller waits it out.
        raise RetriesExceededError(cast(Any, error.last_exception)) from None
    except S3DownloadFailedError:
        # s3transfer's word for S3's 412 to If-Match (its only use of this error).
        raise _PinRefusedError from None


class _PinRefusedError(Exception):
    """S3 refused a pinned GET: the object under the shard's key is no longer the pushed one."""


def _changed(uri: str, info: ShardInfo) -> BadDataError:
    return BadDataError(
        f"shard {uri} changed in S3 after this job's dataset version was placed (its ETag is no longer "
        f"{info.etag}: pushed again with --force?); submit the job again to train on the current version"
    )


def _marker(target: Path) -> Path:
    """The verified marker of the cached shard `target` (`<sha256>.tar` -> `<sha256>.ok`)."""
    return target.with_suffix(".ok")


def _identity(stat: os.stat_result) -> dict[str, int]:
    # A rewrite of the file changes its mtime (and a download's rename its inode); the size is checked too.
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}


def _marked(target: Path, identity: os.stat_result) -> bool:
    """Whether `target`'s marker records exactly this identity. A marker missing, unreadable, not JSON or
    of another file is no marker: the file is hashed (never an error)."""
    try:
        recorded = json.loads(_marker(target).read_bytes())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and recorded == _identity(identity)


def _mark(target: Path, identity: os.stat_result) -> None:
    """Record that `target`, of this identity, holds its sha256's bytes: a temporary file renamed over the
    marker, so a reader sees a whole marker or none. Best effort: a marker that cannot be written (a
    read-only or full disk) only means the next process hashes the file again."""
    temporary: Path | None = None
    try:
        handle, name = tempfile.mkstemp(dir=target.parent, prefix=f"{target.stem}.ok-", suffix=".tmp")
        temporary = Path(name)
        with os.fdopen(handle, "w") as written:
            json.dump(_identity(identity), written)
        temporary.replace(_marker(target))
    except OSError as error:
        log.debug("shard cache: no marker for %s: %s", target, error)
        if temporary is not None:
            temporary.unlink(missing_ok=True)


def _unlink_shard(target: Path) -> None:
    """Delete a cached shard and its marker, the marker first: a marker never outlives its file's deletion
    for a reader to find (one of an older file would not match the identity anyway)."""
    _marker(target).unlink(missing_ok=True)
    target.unlink(missing_ok=True)


def _remove_partials(directory: Path, sha256: str) -> None:
    """Delete what a download of shard `sha256` left: `.part`, and boto3's own temporary `.part.XXXXXXXX`
    of a process killed mid-transfer. Only with the shard's lock held (no download of it is running)."""
    for partial in directory.glob(f"{sha256}.part*"):
        partial.unlink(missing_ok=True)


def _remove_stale_partials(directory: Path) -> None:
    """Delete the partial downloads no process is running any more (killed mid-download): they take disk
    space the cache's bound cannot see, and no later download reuses them. Likewise a marker's temporary
    file a killed process left, and a marker left without its shard. A marker of a cached shard stays."""
    for sha256 in {path.name.split(".", 1)[0] for path in directory.glob("*.part*")}:
        with (directory / f"{sha256}.lock").open("w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its download is running in another process or thread
            _remove_partials(directory, sha256)
    for marker in directory.glob("*.ok"):
        # A marker whose shard is gone (written by a check that the shard's eviction overtook): a download
        # renames its shard into place before it marks it, so no live shard is without its file here.
        if not marker.with_suffix(".tar").exists():
            marker.unlink(missing_ok=True)
    for temporary in directory.glob("*.ok-*.tmp"):
        with contextlib.suppress(OSError):
            if time.time() - temporary.stat().st_mtime > _STALE_MARKER_SECONDS:
                temporary.unlink()


def _fetch_index(uri: str) -> bytes:
    """The index's bytes from S3, in parallel ranges like a shard (ImageNet's is about 70 MB, most of a
    second on one connection, before the first step). An outage is waited out as a shard's download is, for
    up to OUTAGE_SECONDS; a missing index is the dataset's problem, named."""
    from boto3.exceptions import RetriesExceededError
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _split_s3(uri)
    config = TransferConfig(
        max_concurrency=PARALLEL_PARTS, multipart_chunksize=MIN_PART_BYTES, io_chunksize=IO_CHUNK_BYTES
    )
    deadline = time.monotonic() + OUTAGE_SECONDS
    pause = 1.0
    while True:
        received = io.BytesIO()
        try:
            _s3_client().download_fileobj(bucket, key, received, Config=config)
            return received.getvalue()
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in {"404", "NoSuchKey", "NotFound"}:
                raise BadDataError(f"shard index {uri} is missing from S3; {_FIX}") from None
            if code in {"403", "AccessDenied"} or time.monotonic() > deadline:
                raise
            problem: Exception = error
        except (BotoCoreError, RetriesExceededError) as error:
            if time.monotonic() > deadline:
                raise
            problem = error
        log.warning("shard index %s: %s; retrying in %.0fs (S3 unreachable?)", uri, problem, pause)
        time.sleep(pause)
        pause = min(pause * 2, 30.0)


def load_index(uri: str) -> ShardIndex:
    """A split's index from S3 or the local disk; one line naming it when it cannot be used. S3 being
    unreachable is not the dataset's fault: waited out, then raised as S3's error (the life fails and is
    retried), never as bad data (which stops the job)."""
    if uri.startswith("s3://"):
        body = _fetch_index(uri)
    else:
        try:
            body = Path(uri).read_bytes()
        except OSError as error:
            raise BadDataError(
                f"shard index {uri}: cannot be read ({type(error).__name__}: {error}); {_FIX}"
            ) from None
    try:
        return ShardIndex.from_json(body, uri)
    except ShardError as error:
        raise BadDataError(str(error)) from None


class NamedSamples(Sequence[tuple[str, int]]):
    """A ShardFolder's `samples`: (name, label) of each, made when asked for (an ImageFolder's is a list)."""

    def __init__(self, folder: ShardFolder) -> None:
        self._folder = folder

    def __len__(self) -> int:
        return len(self._folder.index.samples)

    @overload
    def __getitem__(self, position: int) -> tuple[str, int]: ...

    @overload
    def __getitem__(self, position: slice) -> list[tuple[str, int]]: ...

    def __getitem__(self, position: int | slice) -> tuple[str, int] | list[tuple[str, int]]:
        if isinstance(position, slice):
            return [self[i] for i in range(*position.indices(len(self)))]
        entry = self._folder.index.samples[position]
        return f"{self._folder.cache.uri(entry.shard)}:{entry.name}", entry.label


class ShardFolder:
    """One split's samples from its shards, with what SeededImageFolder and EvalDataset use of an
    ImageFolder: `classes`, `samples` [(name, label)] and `loader(name)`. A sample's name says where it is:
    `s3://bucket/data/train/shard-000003.tar:cat/1.jpg`, so a bad image is named and skipped as before.

    Opening one costs the index's columns, not an object per sample (the first step waits for it): names
    are made as samples are asked for, and a shard's names are looked up the first time this process reads
    from that shard."""

    def __init__(self, index_uri: str, settings: CacheSettings | None = None) -> None:
        self.index_uri = index_uri
        self.index = load_index(index_uri)
        self.cache = ShardCache(index_uri, self.index, settings or CacheSettings())
        self.classes = list(self.index.classes)
        self.samples = NamedSamples(self)
        self._shard_of_key = {info.key: number for number, info in enumerate(self.index.shards)}
        self._positions: dict[int, dict[str, int]] = {}  # per shard read here: a sample's name -> position
        self._open: dict[int, IO[bytes]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": {}}

    def entry(self, name: str) -> SampleEntry:
        """The sample `name` (as `samples` names it); KeyError when this split has no such sample."""
        # `<base>/<key>:<name>`: a shard's key never holds a colon (write_split names them shard-N.tar).
        key, _, sample = name.removeprefix(self.cache.base + "/").partition(":")
        shard = self._shard_of_key.get(key)
        if shard is None or not name.startswith(self.cache.base + "/"):
            raise KeyError(name)
        positions = self._positions.get(shard)
        if positions is None:
            table = self.index.table
            span = range(table.starts[shard], table.starts[shard + 1])
            positions = self._positions[shard] = {str(table.names[i]): i for i in span}
        position = positions.get(sample)
        if position is None:
            raise KeyError(name)
        return self.index.samples[position]

    def configure(self, settings: CacheSettings) -> None:
        self.cache.settings = settings

    def shard_sizes(self) -> list[int]:
        return self.index.shard_sizes()

    def __len__(self) -> int:
        return len(self.samples)

    def _stream(self, shard: int) -> IO[bytes]:
        stream = self._open.get(shard)
        if stream is None:
            if len(self._open) >= _OPEN_SHARDS:
                oldest = next(iter(self._open))
                self._open.pop(oldest).close()
            try:
                stream = self.cache.path(shard).open("rb")
            except FileNotFoundError:  # evicted between its fetch and this open: fetched again
                stream = self.cache.path(shard).open("rb")
            self._open[shard] = stream
        return stream

    def loader(self, name: str) -> Image.Image:
        entry = self.entry(name)
        try:
            data = read_sample(self._stream(entry.shard), entry)
        except ShardError:
            uri = self.cache.uri(entry.shard)
            problem = f"shard {uri} ends before sample {entry.name}: it is truncated; {_FIX}"
            raise BadDataError(problem) from None
        if not data:
            raise ValueError("empty file (0 bytes)")
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")

    def decode_problem(self, name: str, error: Exception) -> str | None:
        """Why a sample is not a usable image, or None when the error is not the sample's fault (a disk
        error while reading its shard: the life fails and is retried)."""
        if isinstance(error, OSError) and error.errno is not None:
            return None
        # An empty image reads as it does from a synced folder (data.decode_problem), not as the loader's
        # ValueError: the split's list of skipped files says the same whichever way the data came.
        with contextlib.suppress(KeyError):
            if self.entry(name).size == 0:
                return "empty file (0 bytes)"
        return f"{type(error).__name__}: {error}".replace("\n", " ")


class ReadAhead:
    """Fetches the shards the sampler will need next, in the order it will need them, while the loader
    reads the current ones: `plan` with this epoch's shard of each upcoming sample, `advance` as samples
    are handed out. It stays `read_ahead` shards ahead, no more (the cache is bounded), and fetches those
    shards at once, on up to MAX_CONCURRENT_SHARDS daemon threads per loader, each taking the first wanted
    shard no other has taken: the one needed soonest starts first."""

    def __init__(self, fetch: Callable[[int], object], read_ahead: int) -> None:
        self._fetch = fetch
        self._read_ahead = read_ahead
        self._lock = threading.Condition()
        self._sequence: list[int] = []  # distinct shards in order of first use
        self._first_use: list[int] = []  # the sample position of each one's first use
        self._position = 0
        self._generation = 0
        # (generation, shard) of every fetch started: one fetch per shard and plan, whichever thread.
        self._taken: set[tuple[int, int]] = set()
        self.error: BaseException | None = None
        self._threads = [
            threading.Thread(target=self._run, name=f"shard-read-ahead-{n}", daemon=True)
            for n in range(max(1, min(read_ahead, MAX_CONCURRENT_SHARDS)))
        ]
        for thread in self._threads:
            thread.start()

    def plan(self, shards: list[int]) -> None:
        sequence: list[int] = []
        first_use: list[int] = []
        seen: set[int] = set()
        for position, shard in enumerate(shards):
            if shard not in seen:
                seen.add(shard)
                sequence.append(shard)
                first_use.append(position)
        with self._lock:
            self._sequence, self._first_use, self._position = sequence, first_use, 0
            self._generation += 1
            self._lock.notify_all()

    def advance(self, position: int) -> None:
        with self._lock:
            self._position = position
            self._lock.notify_all()

    def _wanted(self) -> list[int]:
        # The shards in use at the current position plus the next `read_ahead` ones.
        current = sum(1 for use in self._first_use if use <= self._position)
        return self._sequence[: current + self._read_ahead]

    def _take(self) -> int | None:
        """The first wanted shard no thread has taken in this plan, now taken; None when there is none.
        Called with the lock held."""
        for shard in self._wanted():
            if (self._generation, shard) not in self._taken:
                self._taken.add((self._generation, shard))
                return shard
        return None

    def _run(self) -> None:
        while True:
            with self._lock:
                shard = self._take()
                while shard is None:
                    self._lock.wait()
                    shard = self._take()
            try:
                self._fetch(shard)
            except Exception as error:  # the worker that needs the shard fetches it again and reports it
                log.warning("read-ahead of shard %d failed: %s", shard, error)
                self.error = error
