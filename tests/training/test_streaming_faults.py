"""The shard cache under faults (issue 35): a disk that fills during a download, a trainer killed
mid-download, a cached copy damaged on disk, two fetchers of one shard at once. In-process against moto; each
fault is made by a stand-in for one call (the transfer's write to disk, a dead process's leftovers, another
process's lock), never by sleeping."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import boto3
import pytest
from s3transfer.download import IOWriteTask

import training.streaming
from tests.conftest import MotoServer
from tests.training.conftest import Dataset
from tests.waiting import join_all, wait_until
from training.data import SeededImageFolder, train_transform
from training.dataset_layout import BadDataError
from training.streaming import CacheSettings, ShardFolder
from trainstack.datapush import write_shards
from trainstack_job.shards import INDEX_NAME

SHARD_BYTES = 20_000  # a few KB images: ~10 shards
BUCKET = "shard-faults"


@pytest.fixture(scope="module")
def shards(image_folders: Dataset, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fault-shards")
    classes = sorted(p.name for p in image_folders.train_dir.iterdir())
    write_shards(image_folders.train_dir.parent, out, classes, SHARD_BYTES)
    return out


@pytest.fixture()
def index_uri(aws: MotoServer, shards: Path) -> str:
    """The train split's shards in the moto bucket; its index's URI."""
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    for path in sorted((shards / "train").iterdir()):
        s3.upload_file(str(path), BUCKET, f"images/train/{path.name}")
    return f"s3://{BUCKET}/images/train/{INDEX_NAME}"


class CountingClient:
    """The real (moto) client, counting downloads; `before_download` runs first (a fault, a rendezvous)."""

    def __init__(self, calls: list[str], before_download: Any = None) -> None:
        self._real = boto3.client("s3")
        self._calls = calls
        self._before = before_download

    def download_file(self, bucket: str, key: str, filename: str, **kwargs: Any) -> None:
        self._calls.append(key)
        if self._before is not None:
            self._before(len(self._calls))
        self._real.download_file(bucket, key, filename, **kwargs)


def new_life(index_uri: str, cache: Path, calls: list[str], before_download: Any = None) -> ShardFolder:
    """The split as a new trainer process (or loader worker) sees it: nothing checked yet in this process."""
    folder = ShardFolder(index_uri, CacheSettings(str(cache), max_bytes=10**9))
    folder.cache._client = CountingClient(calls, before_download)
    return folder


def s3_bytes(folder: ShardFolder, shard: int) -> bytes:
    key = f"images/train/{folder.index.shards[shard].key}"
    body: bytes = boto3.client("s3").get_object(Bucket=BUCKET, Key=key)["Body"].read()
    return body


def partials(cache: Path) -> list[str]:
    return sorted(path.name for path in cache.glob("*.part*"))


def first_sample_of(folder: ShardFolder, shard: int) -> str:
    return next(name for name, _ in folder.samples if folder.entry(name).shard == shard)


def test_a_full_disk_mid_download_is_one_line_naming_the_cache_the_shard_and_the_fix(
    index_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The transfer's write fails with ENOSPC half-way: the trainer gets one OSError line (it prints
    `error: FOLDER: LINE`, exit 1) naming the cache folder, the shard and the fix, at once (no outage's
    10-minute wait), the partial file is gone and the shard already cached is untouched."""
    cache = tmp_path / "cache"
    calls: list[str] = []
    folder = new_life(index_uri, cache, calls)
    kept = folder.cache.path(0)
    kept_bytes = kept.read_bytes()
    pauses: list[float] = []
    # The module's clock only: a retry would show as a pause (moto's and boto3's threads keep theirs).
    monkeypatch.setattr(
        training.streaming, "time", SimpleNamespace(monotonic=time.monotonic, sleep=pauses.append)
    )

    # A loader's dataset, opened (its index read into memory) before the disk fills.
    dataset = SeededImageFolder(index_uri, train_transform(16), seed=0)
    assert isinstance(dataset.folder, ShardFolder)
    dataset.folder.configure(folder.cache.settings)
    second = next(
        i for i, (name, _) in enumerate(dataset.folder.samples) if name.startswith(folder.cache.uri(1))
    )

    with monkeypatch.context() as disk:

        def full_disk(_task: IOWriteTask, fileobj: Any, data: bytes, offset: int) -> None:
            fileobj.seek(offset)
            fileobj.write(data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        disk.setattr(IOWriteTask, "_main", full_disk)
        with pytest.raises(OSError) as raised:
            folder.cache.path(1)
        # What a sample read meets: the disk's error, never a skipped "bad image".
        with pytest.raises(OSError) as read:
            dataset[(0, second)]

    error = raised.value
    assert error.errno == errno.ENOSPC and error.filename == str(cache)
    line = str(error.strerror)
    assert "\n" not in line
    assert line.startswith(f"disk full while caching shard {folder.cache.uri(1)} (")
    assert f" in {cache} (" in line and "GB free); free space there, lower data.cache_gb" in line
    assert read.value.errno == errno.ENOSPC
    assert pauses == [] and len(calls) == 2  # one try each: not waited out as an S3 outage
    assert partials(cache) == []
    assert sorted(cache.glob("*.tar")) == [kept] and kept.read_bytes() == kept_bytes
    # Space freed: the next read fetches it whole.
    assert folder.cache.path(1).read_bytes() == s3_bytes(folder, 1)
    # The disk fills as the downloaded shard is flushed (a filesystem that allocates late): the same line.
    with monkeypatch.context() as disk:

        def full_at_flush(_fd: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        disk.setattr(os, "fsync", full_at_flush)
        with pytest.raises(OSError) as flushed:
            folder.cache.path(2)
    assert flushed.value.errno == errno.ENOSPC and flushed.value.filename == str(cache)
    assert str(flushed.value.strerror).startswith(f"disk full while caching shard {folder.cache.uri(2)} (")
    assert partials(cache) == [] and not (cache / f"{folder.index.shards[2].sha256}.tar").exists()


def test_what_a_killed_download_left_is_never_reused_and_is_cleared_once_no_one_holds_it(
    index_uri: str, tmp_path: Path
) -> None:
    """A trainer killed mid-download leaves `<sha>.part` (whole but unchecked) or boto3's own
    `<sha>.part.XXXXXXXX` (cut short). The next life downloads the shard again, checks it and serves the
    index's bytes; leftovers of shards no process is downloading go, one still being downloaded by another
    process (its lock held) stays until that process is done."""
    cache = tmp_path / "cache"
    cache.mkdir()
    calls: list[str] = []
    folder = new_life(index_uri, cache, calls)
    shards = folder.index.shards
    mine, running, dead = shards[0].sha256, shards[2].sha256, shards[3].sha256
    real = s3_bytes(folder, 0)
    (cache / f"{mine}.part").write_bytes(bytes(len(real)))  # the right size, the wrong bytes
    (cache / f"{mine}.part.a1B2c3D4").write_bytes(real[: len(real) // 2])
    (cache / f"{running}.part.e5F6g7H8").write_bytes(b"still coming")
    (cache / f"{dead}.part").write_bytes(b"nobody is coming back for this")
    with (cache / f"{running}.lock").open("w") as other_process:
        fcntl.flock(other_process, fcntl.LOCK_EX)  # a separate open file: flock treats it as another process

        path = folder.cache.path(0)

        assert path.read_bytes() == real and hashlib.sha256(real).hexdigest() == mine
        assert calls == [f"images/train/{shards[0].key}"]
        assert partials(cache) == [f"{running}.part.e5F6g7H8"]
    folder.cache.path(1)  # the other process is gone: the next download clears what it left
    assert partials(cache) == []
    name = first_sample_of(folder, 0)  # the image read is the one a clean cache gives
    assert folder.loader(name).tobytes() == new_life(index_uri, tmp_path / "other", []).loader(name).tobytes()


@pytest.mark.parametrize("damage", ["truncated", "bytes flipped"])
def test_a_damaged_cached_shard_is_fetched_again_once_and_never_served(
    index_uri: str, tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A cached copy that is not the index's (a crash before it reached the disk) is found by its sha256
    when a process first opens it, fetched again once, and the sample read is the right image."""
    cache = tmp_path / "cache"
    folder = new_life(index_uri, cache, [])
    name = first_sample_of(folder, 0)
    entry = folder.entry(name)
    expected = folder.loader(name).tobytes()
    cached = folder.cache.path(0)
    data = bytearray(cached.read_bytes())
    middle = entry.offset + entry.size // 2  # inside the image read below
    if damage == "truncated":
        del data[middle:]
    else:
        data[middle] ^= 0xFF
    cached.write_bytes(bytes(data))
    calls: list[str] = []
    later = new_life(index_uri, cache, calls)

    with caplog.at_level(logging.WARNING, logger="training"):
        image = later.loader(name)

    assert image.tobytes() == expected
    assert cached.read_bytes() == s3_bytes(later, 0)
    assert len(calls) == 1
    assert (
        f"shard {later.cache.uri(0)}: the cached copy {cached} is damaged; fetching it again"
        in caplog.messages
    )
    later.loader(first_sample_of(later, 0))
    assert len(calls) == 1  # checked once per process, fetched once


def test_a_damaged_cached_shard_whose_s3_copy_is_damaged_too_is_refused_after_one_fetch(
    index_uri: str, tmp_path: Path
) -> None:
    """Fetched again once only: when S3's copy is not the index's either, the dataset is the problem."""
    cache = tmp_path / "cache"
    folder = new_life(index_uri, cache, [])
    cached = folder.cache.path(0)
    cached.write_bytes(b"damaged")
    boto3.client("s3").put_object(
        Bucket=BUCKET, Key=f"images/train/{folder.index.shards[0].key}", Body=b"bad"
    )
    calls: list[str] = []
    later = new_life(index_uri, cache, calls)

    with pytest.raises(
        BadDataError, match=r"^shard s3://shard-faults/images/train/shard-\d+\.tar is corrupt "
    ):
        later.cache.path(0)

    assert len(calls) == 1 and not cached.exists() and partials(cache) == []


def _waiting_on_lock(lock: Path) -> bool:
    """Whether some open file is blocked on `lock`'s flock: Linux lists waiters in /proc/locks with `->`."""
    inode = f":{lock.stat().st_ino}"
    return any(
        "->" in fields and any(field.endswith(inode) for field in fields)
        for fields in (line.split() for line in Path("/proc/locks").read_text().splitlines())
    )


def test_two_fetchers_of_one_shard_download_it_once_and_both_read_it(index_uri: str, tmp_path: Path) -> None:
    """Two processes (loader workers, ranks) want the same shard at once: the second waits on the shard's
    lock while the first downloads (the download does not finish until it does wait), then reads the
    first's copy."""
    cache = tmp_path / "cache"
    calls: list[str] = []
    downloading = threading.Event()
    first: ShardFolder | None = None

    def hold_until_the_second_waits(number: int) -> None:
        if number == 1:
            downloading.set()
            assert first is not None
            lock = cache / f"{first.index.shards[0].sha256}.lock"
            wait_until(
                lambda: _waiting_on_lock(lock), timeout=30, what="the second fetcher waiting on the lock"
            )

    first = new_life(index_uri, cache, calls, hold_until_the_second_waits)
    second = new_life(index_uri, cache, calls)  # its own client and checks, as another process has
    got: dict[str, Path | BaseException] = {}

    def fetch(name: str, folder: ShardFolder) -> None:
        try:
            got[name] = folder.cache.path(0)
        except BaseException as error:  # reported by the asserts below
            got[name] = error

    threads = [threading.Thread(target=fetch, args=("first", first))]
    threads[0].start()
    assert downloading.wait(timeout=30), "the first fetcher never started its download"
    threads.append(threading.Thread(target=fetch, args=("second", second)))
    threads[1].start()
    join_all(threads, timeout=60, what="both fetchers")

    assert got["first"] == got["second"] == cache / f"{first.index.shards[0].sha256}.tar", got
    assert calls == [f"images/train/{first.index.shards[0].key}"]
    name = first_sample_of(first, 0)
    assert first.loader(name).tobytes() == second.loader(name).tobytes()
    assert partials(cache) == []


def test_a_connection_lost_mid_shard_past_the_transfers_own_retries_is_waited_out_as_an_outage(
    index_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shard's body stops coming on every one of the transfer manager's own attempts (boto3 then raises
    its RetriesExceededError, not a botocore error): an S3 outage all the same, waited out and the shard
    fetched whole once S3 answers again."""
    from s3transfer.download import DownloadChunkIterator

    cache = tmp_path / "cache"
    calls: list[str] = []
    folder = new_life(index_uri, cache, calls)
    outage = [True]
    read_chunk = DownloadChunkIterator.__next__

    def lost_connection(chunks: DownloadChunkIterator) -> bytes:
        if outage[0]:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return cast(bytes, read_chunk(chunks))  # (s3transfer's stubs say str: it is the body's bytes)

    def wait(seconds: float) -> None:
        pauses.append(seconds)
        outage[0] = False  # S3 is back after the first pause

    pauses: list[float] = []
    monkeypatch.setattr(DownloadChunkIterator, "__next__", lost_connection)
    monkeypatch.setattr(training.streaming, "time", SimpleNamespace(monotonic=time.monotonic, sleep=wait))

    path = folder.cache.path(0)

    assert pauses == [1.0] and len(calls) == 2
    assert path.read_bytes() == s3_bytes(folder, 0)
    assert partials(cache) == []


def test_a_pinned_download_losing_its_connection_past_the_transfers_retries_is_waited_out_too(
    index_uri: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same outage when the shard's ETag was placed (its GETs conditional, through the transfer manager
    itself, whose own RetriesExceededError is not boto3's): waited out, not a failed life."""
    import dataclasses

    from s3transfer.download import DownloadChunkIterator

    cache = tmp_path / "cache"
    folder = ShardFolder(index_uri, CacheSettings(str(cache), max_bytes=10**9))
    info = folder.index.shards[0]
    etag = boto3.client("s3").head_object(Bucket=BUCKET, Key=f"images/train/{info.key}")["ETag"]
    folder.index.shards[0] = dataclasses.replace(info, etag=etag)  # as the agent places it
    outage = [True]
    read_chunk = DownloadChunkIterator.__next__

    def lost_connection(chunks: DownloadChunkIterator) -> bytes:
        if outage[0]:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
        return cast(bytes, read_chunk(chunks))

    def wait(seconds: float) -> None:
        pauses.append(seconds)
        outage[0] = False

    pauses: list[float] = []
    monkeypatch.setattr(DownloadChunkIterator, "__next__", lost_connection)
    monkeypatch.setattr(training.streaming, "time", SimpleNamespace(monotonic=time.monotonic, sleep=wait))

    path = folder.cache.path(0)

    assert pauses == [1.0]
    assert path.read_bytes() == s3_bytes(folder, 0)
    assert partials(cache) == []

    # Past the outage's deadline the life fails with boto3's error, carrying what the connection last did.
    from boto3.exceptions import RetriesExceededError

    info = folder.index.shards[1]
    etag = boto3.client("s3").head_object(Bucket=BUCKET, Key=f"images/train/{info.key}")["ETag"]
    folder.index.shards[1] = dataclasses.replace(info, etag=etag)
    outage[0] = True
    reads = iter([0.0])  # the start; every later read is past the deadline
    clock = SimpleNamespace(monotonic=lambda: next(reads, 1e9), sleep=wait)
    monkeypatch.setattr(training.streaming, "time", clock)
    with pytest.raises(RetriesExceededError) as raised:
        folder.cache.path(1)
    assert isinstance(getattr(raised.value, "last_exception", None), ConnectionResetError)
    assert pauses == [1.0] and partials(cache) == []


def test_a_loader_workers_error_is_reported_in_the_one_line_it_was_raised_with() -> None:
    """With DataLoader workers (the default on a GPU), torch re-raises a worker's error in the trainer with
    the worker's traceback in its message: the trainer's report keeps only the original line."""
    from torch._utils import ExceptionWrapper

    from training.__main__ import one_line

    problem = "shard s3://b/d/train/shard-000001.tar is corrupt; push the dataset again"
    for raised in (BadDataError(problem), OSError(errno.ENOSPC, problem)):
        try:
            raise raised
        except Exception:
            wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
        with pytest.raises(type(raised)) as reraised:
            wrapped.reraise()
        assert "Traceback" in str(reraised.value)
        assert one_line(reraised.value) in (problem, f"[Errno {errno.ENOSPC}] {problem}")
    assert one_line(BadDataError(problem)) == problem, "the trainer's own error is left as it is"
