"""The streaming loader's own promises, function by function: which file is fetched from where and kept under
which name, what the cache keeps and evicts (its bound, the disk's free-space margin, the least recently
used first, never the shard just fetched), the lock that makes one download per shard, the outage retry and
its deadline, the one-line errors naming the shard and the fix, the S3 client's settings, what goes to the
loader workers, and the read-ahead's order and bound. Small shards written here, S3 a fake client (what it
was asked for is what is checked), the module's clock a fake: retries and deadlines run at once. The
streamed training runs themselves (moto, resume, bitwise equality) are tests/training/test_streaming.py."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.conftest import MotoServer
from tests.training.conftest import hash_counter
from tests.waiting import wait_until
from training.dataset_layout import BadDataError
from training.streaming import CacheSettings, ShardFolder, index_location
from trainstack_job.shards import INDEX_NAME, ShardIndex

REMOTE = "s3://bucket/data/train"


def png(shade: int, mode: str = "L") -> bytes:
    from io import BytesIO

    from PIL import Image

    out = BytesIO()
    Image.new(mode, (2, 2), shade).save(out, format="PNG")
    return out.getvalue()


def shard_index(folder: Path, shards: list[list[bytes]], source: str = "", cache_dir: str = "") -> ShardIndex:
    """`shards` (each a list of sample bytes) as files in `folder` plus their index (`shards.json`)."""
    import hashlib
    import json

    from trainstack_job.shards import SampleEntry, ShardInfo

    folder.mkdir(parents=True, exist_ok=True)
    infos, samples = [], []
    for number, members in enumerate(shards):
        body, key = b"", f"shard-{number:06d}.tar"
        for position, data in enumerate(members):
            samples.append(
                SampleEntry(
                    number, len(body), len(data), position % 2, f"c{position % 2}/{number}-{position}.png"
                )
            )
            body += data
        (folder / key).write_bytes(body)
        infos.append(ShardInfo(key, len(body), hashlib.sha256(body).hexdigest()))
    index = ShardIndex(["c0", "c1"], infos, samples, source, cache_dir)
    (folder / INDEX_NAME).write_text(json.dumps(index.to_json()), encoding="utf-8")
    return index


class FakeS3:
    """download_file from a folder standing for s3://bucket/data/train; each call recorded; `failures` raised
    first, one per call (a callable is called first, e.g. to move the clock)."""

    def __init__(self, folder: Path, failures: list[Exception] | None = None) -> None:
        self.folder, self.failures = folder, failures or []
        self.calls: list[tuple[str, str, str, Any]] = []
        self.during: Any = None

    def download_file(self, bucket: str, key: str, filename: str, Config: Any) -> None:  # noqa: N803
        self.calls.append((bucket, key, filename, Config))
        if self.during is not None:
            self.during(filename)
        if self.failures:
            raise self.failures.pop(0)
        shutil.copyfile(self.folder / key.removeprefix("data/train/"), filename)


class Clock:
    """The module's `time`: monotonic reads `now`; sleep records the pause and moves `now` on."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now
        self.pauses: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, pause: float) -> None:
        self.pauses.append(pause)
        self.now += pause


def remote_cache(tmp_path: Path, shards: list[list[bytes]], max_bytes: int = 10**9) -> tuple[Any, FakeS3]:
    from training.streaming import ShardCache

    index = shard_index(tmp_path / "bucket", shards, source=REMOTE + "/")
    cache = ShardCache("/data/train/shards.json", index, CacheSettings(str(tmp_path / "c" / "d"), max_bytes))
    cache._client = FakeS3(tmp_path / "bucket")
    return cache, cache._client


def client_error(code: str | None) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code}} if code is not None else {}, "GetObject")


def test_index_location_names_the_index_of_a_file_a_folder_or_an_s3_prefix(tmp_path: Path) -> None:
    assert index_location("s3://b/data/train") == f"s3://b/data/train/{INDEX_NAME}"
    assert index_location("s3://b/data/train/") == f"s3://b/data/train/{INDEX_NAME}"
    assert index_location("s3://b/data/MAX/") == f"s3://b/data/MAX/{INDEX_NAME}"  # only slashes go
    assert index_location("s3://b/data/mine.json") == "s3://b/data/mine.json"
    (tmp_path / "mine.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("{}")
    assert index_location(str(tmp_path / "mine.json")) == str(tmp_path / "mine.json")
    assert index_location(str(tmp_path / "notes.txt")) is None
    assert index_location(str(tmp_path / "gone.json")) is None  # not there: an ImageFolder's problem
    assert index_location(str(tmp_path)) is None
    (tmp_path / INDEX_NAME).write_text("{}")
    assert index_location(str(tmp_path)) == str(tmp_path / INDEX_NAME)


def test_the_s3_client_retries_adaptively_and_goes_to_the_configured_endpoint(aws: MotoServer) -> None:
    from training.streaming import _s3_client, _split_s3

    client = _s3_client()
    assert client.meta.service_model.service_name == "s3"
    assert client.meta.endpoint_url == aws.endpoint_url
    # max_attempts 5 (retries after the first try), which botocore keeps as 6 tries in all.
    assert client.meta.config.retries == {"total_max_attempts": 6, "mode": "adaptive"}
    assert _split_s3("s3://bucket/data/train/shard-000001.tar") == ("bucket", "data/train/shard-000001.tar")


def test_the_cache_folder_is_the_configs_then_the_agents_then_the_environments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tempfile

    from training.streaming import CACHE_ENV

    assert CacheSettings() == CacheSettings("", 50 * 10**9, read_ahead=2, window=4)
    monkeypatch.delenv(CACHE_ENV, raising=False)
    assert CacheSettings().directory() == Path(tempfile.gettempdir()) / "trainstack-shards"
    assert CacheSettings().directory("/nvme/agent") == Path("/nvme/agent")
    assert CacheSettings("/mine").directory("/nvme/agent") == Path("/mine")
    monkeypatch.setenv(CACHE_ENV, "/scratch")
    assert CacheSettings().directory() == Path("/scratch")
    assert CacheSettings().directory("/nvme/agent") == Path("/nvme/agent")


def test_a_shard_is_fetched_once_into_the_cache_under_its_sha256_and_reused(tmp_path: Path) -> None:
    cache, s3 = remote_cache(tmp_path, [[b"a" * 10], [b"b" * 20]])
    info = cache.index.shards[1]
    directory = tmp_path / "c" / "d"
    assert cache.base == REMOTE and cache.remote and cache.uri(1) == f"{REMOTE}/shard-000001.tar"

    assert cache.path(1) == directory / f"{info.sha256}.tar"
    ((bucket, key, filename, config),) = s3.calls
    assert (bucket, key, filename) == (
        "bucket",
        "data/train/shard-000001.tar",
        str(directory / f"{info.sha256}.part"),
    )
    assert (config.max_concurrency, config.multipart_chunksize) == (8, 2**23)  # parallel 8 MiB ranges
    assert config.io_chunksize == 2**20  # each part read and written 1 MiB at a time: less CPU per byte
    assert (directory / f"{info.sha256}.tar").read_bytes() == b"b" * 20
    # The download was checked before its rename: marked verified for the other processes.
    names = [f"{info.sha256}.{suffix}" for suffix in ("lock", "ok", "tar")]
    assert sorted(p.name for p in directory.iterdir()) == names
    tar_mtime = (directory / f"{info.sha256}.tar").stat().st_mtime_ns
    os.utime(directory / f"{info.sha256}.ok", (1, 1))
    assert cache.path(1) == directory / f"{info.sha256}.tar" and len(s3.calls) == 1
    assert (directory / f"{info.sha256}.ok").stat().st_mtime > 1  # used now: evicted last
    assert (directory / f"{info.sha256}.tar").stat().st_mtime_ns == tar_mtime  # its identity untouched
    assert cache.path(0).read_bytes() == b"a" * 10 and len(s3.calls) == 2


def test_a_shard_is_cut_into_8_parts_of_8_to_32_mib_and_the_settings_may_say_otherwise(
    tmp_path: Path,
) -> None:
    from training.streaming import part_size

    mib = 2**20
    # Small shards in 8 MiB parts (more than one connection where they can); 64-256 MB ones in 8 parts; the
    # default 512 MB shards in 32 MiB parts, at most 8 at a time either way.
    assert [part_size(size) for size in (10, 16 * 10**6, 64 * 2**20, 200 * 10**6, 512 * 10**6)] == [
        8 * mib,
        8 * mib,
        8 * mib,
        25 * 10**6,
        32 * mib,
    ]
    # A shard whose size 8 does not divide: parts rounded up to whole bytes (8 of them cover it), an int.
    odd = part_size(100 * mib + 1)
    assert odd == 100 * mib // 8 + 1 and isinstance(odd, int)
    cache, s3 = remote_cache(tmp_path, [[b"a" * 10]])
    cache.settings = CacheSettings(cache.settings.cache_dir, part_bytes=5 * mib)
    cache.path(0)
    assert s3.calls[0][3].multipart_chunksize == 5 * mib


def test_a_local_index_reads_its_shards_in_place_and_an_agents_copy_where_it_says(tmp_path: Path) -> None:
    from training.streaming import ShardCache

    index = shard_index(tmp_path / "train", [[b"x"]])
    cache = ShardCache(str(tmp_path / "train" / INDEX_NAME), index, CacheSettings(str(tmp_path / "cache")))
    assert not cache.remote and cache.path(0) == tmp_path / "train" / "shard-000000.tar"
    assert not (tmp_path / "cache").exists()
    placed = ShardIndex(index.classes, index.shards, index.samples, "s3://b/x/trainX/", "/nvme")
    cache = ShardCache("/job/data/train/shards.json", placed, CacheSettings())
    assert cache.uri(0) == "s3://b/x/trainX/shard-000000.tar" and cache.remote
    assert cache.settings.directory(cache.index.cache_dir) == Path("/nvme")
    unplaced = ShardCache("s3://b/y/train/shards.json", index, CacheSettings())
    assert unplaced.uri(0) == "s3://b/y/train/shard-000000.tar" and unplaced._client is None


def test_without_data_cache_dir_shards_go_to_the_folder_the_agent_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.streaming import CACHE_ENV, ShardCache

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "environment"))
    index = shard_index(tmp_path / "bucket", [[b"a"]], source=REMOTE, cache_dir=str(tmp_path / "nvme"))
    cache = ShardCache("", index, CacheSettings())
    cache._client = FakeS3(tmp_path / "bucket")
    assert cache.path(0) == tmp_path / "nvme" / f"{index.shards[0].sha256}.tar"


def test_the_s3_client_is_made_on_the_first_download_once_and_not_sent_to_loader_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    import training.streaming

    cache, s3 = remote_cache(tmp_path, [[b"a"], [b"b"]])
    cache._client = None
    made: list[FakeS3] = []

    def make() -> FakeS3:
        made.append(s3)
        return s3

    monkeypatch.setattr(training.streaming, "_s3_client", make)
    cache.path(0)
    cache.path(1)
    assert made == [s3] and len(s3.calls) == 2
    cache._client = threading.Lock()  # like a boto3 client: not picklable
    copy = pickle.loads(pickle.dumps(cache))
    assert copy._client is None and copy.base == cache.base and copy.index == cache.index


def test_the_download_holds_the_shards_lock_so_one_process_fetches_it(tmp_path: Path) -> None:
    import fcntl

    cache, s3 = remote_cache(tmp_path, [[b"a"]])
    lock = tmp_path / "c" / "d" / f"{cache.index.shards[0].sha256}.lock"

    def held(_filename: str) -> None:
        with lock.open("w") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)

    s3.during = held
    cache.path(0)
    assert len(s3.calls) == 1
    with lock.open("w") as other:  # released afterwards
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.parametrize("code", ["404", "NoSuchKey", "NotFound"])
def test_a_missing_shard_is_one_line_naming_it_and_the_fix_without_retrying(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    import training.streaming

    clock = Clock()
    monkeypatch.setattr(training.streaming, "time", clock)
    cache, s3 = remote_cache(tmp_path, [[b"a"]])
    s3.failures = [client_error(code)]
    with pytest.raises(BadDataError) as raised:
        cache.path(0)
    assert str(raised.value) == (
        f"shard {REMOTE}/shard-000000.tar is missing from S3; push the dataset again with "
        "`trainstack data push DIR --format shards`"
    )
    assert raised.value.__cause__ is None and clock.pauses == []


@pytest.mark.parametrize("code", ["PreconditionFailed", "412"])
def test_a_pinned_shards_refused_if_match_is_named_as_changed_at_once_and_only_when_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    """S3's 412 as botocore's error (an s3transfer that does not turn it into its own), by its code or its
    status alone: the shard changed since its ETag was placed, said at once; unpinned, a 412 is not that
    (a stray answer in an outage: retried)."""
    import dataclasses

    from botocore.exceptions import ClientError

    import training.streaming

    def client_error(code: str) -> ClientError:
        status = {"HTTPStatusCode": 412} if code == "412" else {}
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": status}, "GetObject")  # type: ignore[typeddict-item]

    clock = Clock()
    monkeypatch.setattr(training.streaming, "time", clock)
    cache, s3 = remote_cache(tmp_path, [[b"a"]])
    cache.index.shards[0] = dataclasses.replace(cache.index.shards[0], etag='"e1"')
    asked: list[str] = []

    def refused(client: Any, bucket: str, key: str, partial: Path, config: Any, info: Any) -> None:
        asked.append(info.etag)
        raise client_error(code)

    monkeypatch.setattr(training.streaming, "_download_pinned", refused)
    with pytest.raises(BadDataError) as raised:
        cache.path(0)
    assert str(raised.value) == (
        f"shard {REMOTE}/shard-000000.tar changed in S3 after this job's dataset version was placed (its "
        'ETag is no longer "e1": pushed again with --force?); submit the job again to train on the current '
        "version"
    )
    assert asked == ['"e1"'] and clock.pauses == [] and s3.calls == []
    cache.index.shards[0] = dataclasses.replace(cache.index.shards[0], etag="")
    s3.failures = [client_error(code)]
    assert cache.path(0).read_bytes() == b"a" and clock.pauses == [1.0]


@pytest.mark.parametrize("code", ["403", "AccessDenied"])
def test_access_denied_is_raised_at_once_not_waited_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str
) -> None:
    from botocore.exceptions import ClientError

    import training.streaming

    clock = Clock()
    monkeypatch.setattr(training.streaming, "time", clock)
    cache, s3 = remote_cache(tmp_path, [[b"a"]])
    s3.failures = [client_error(code)]
    with pytest.raises(ClientError, match=code):
        cache.path(0)
    assert clock.pauses == [] and len(s3.calls) == 1


def test_an_outage_is_retried_with_doubling_pauses_up_to_30s_then_the_shard_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from boto3.exceptions import RetriesExceededError
    from botocore.exceptions import EndpointConnectionError

    import training.streaming

    clock = Clock()
    monkeypatch.setattr(training.streaming, "time", clock)
    cache, s3 = remote_cache(tmp_path, [[b"a" * 5]])
    # An error without a code (a proxy's 503 page) is an outage too.
    s3.failures = [
        client_error("SlowDown"),
        client_error(None),
        *[EndpointConnectionError(endpoint_url="http://s3")] * 4,
        # The connection lost mid-shard after the transfer's own retries.
        RetriesExceededError(EndpointConnectionError(endpoint_url="http://s3")),  # type: ignore[arg-type]
    ]
    with caplog.at_level(logging.DEBUG, logger="training"):
        assert cache.path(0).read_bytes() == b"a" * 5
    assert clock.pauses == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings[0] == (
        f"shard {REMOTE}/shard-000000.tar: An error occurred (SlowDown) when calling the GetObject "
        "operation: Unknown; retrying in 1s (S3 unreachable?)"
    )
    assert warnings[-1] == (
        f"shard {REMOTE}/shard-000000.tar: Max Retries Exceeded; retrying in 30s (S3 unreachable?)"
    )
    assert len(warnings) == 7
    assert f"shard {REMOTE}/shard-000000.tar: 5 bytes in 91.00s" in [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("kind", ["client", "connection", "transfer"])
def test_an_outage_longer_than_ten_minutes_fails_the_life_with_s3s_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    from boto3.exceptions import RetriesExceededError
    from botocore.exceptions import EndpointConnectionError

    import training.streaming

    clock = Clock()
    monkeypatch.setattr(training.streaming, "time", clock)
    cache, s3 = remote_cache(tmp_path, [[b"a"]])
    lost = EndpointConnectionError(endpoint_url="http://s3")
    errors = {"client": client_error("InternalError"), "connection": lost}
    error = errors.get(kind, RetriesExceededError(lost))  # type: ignore[arg-type]
    s3.failures = [error, error, error]
    moments = iter([100.0 + 600.0, 100.0 + 600.5])  # the deadline itself still retries; past it, no more

    def fail_at(_filename: str) -> None:
        clock.now = next(moments)

    s3.during = fail_at
    with pytest.raises(type(error)):
        cache.path(0)
    assert clock.pauses == [1.0] and len(s3.calls) == 2


@pytest.mark.parametrize("wrong", ["content", "size"])
def test_a_corrupt_download_is_deleted_and_named_in_one_line(tmp_path: Path, wrong: str) -> None:
    from training.streaming import ShardCache

    cache, s3 = remote_cache(tmp_path, [[b"abcd"]])
    info = cache.index.shards[0]
    if wrong == "content":
        (tmp_path / "bucket" / info.key).write_bytes(b"abcX")
        claimed = 4
    else:  # the right bytes, but not as many as the index says
        claimed = 5
        from trainstack_job.shards import ShardInfo

        index = ShardIndex(
            cache.index.classes, [ShardInfo(info.key, 5, info.sha256)], cache.index.samples, REMOTE
        )
        cache = ShardCache("", index, cache.settings)
        cache._client = s3
    with pytest.raises(BadDataError) as raised:
        cache.path(0)
    assert str(raised.value) == (
        f"shard {REMOTE}/shard-000000.tar is corrupt (its 4 bytes do not match the index's size {claimed} "
        "and sha256); push the dataset again with `trainstack data push DIR --format shards`"
    )
    assert [p.suffix for p in (tmp_path / "c" / "d").iterdir()] == [".lock"]


def aged(directory: Path, sizes: dict[str, int]) -> dict[str, Path]:
    """Cached shards of these sizes, used in the order given (the first least recently)."""
    directory.mkdir(parents=True, exist_ok=True)
    made = {}
    for age, (name, size) in enumerate(sizes.items()):
        made[name] = directory / f"{name}.tar"
        made[name].write_bytes(b"x" * size)
        os.utime(made[name], (1000 + age, 1000 + age))
    return made


def disk(folder: Path, free: float) -> Any:
    """The module's `shutil`: `free` bytes free on the disk of `folder`, the one folder it may ask about."""

    def disk_usage(path: Path | str) -> Any:
        assert Path(path) == folder, f"asked for the free space of {path}, not of the cache {folder}"
        return SimpleNamespace(free=free)

    return SimpleNamespace(disk_usage=disk_usage)


def evict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: str, max_bytes: int, free: int, **sizes: int
) -> list[str]:
    """What is left in the cache after fetching `keep`, with `free` bytes free on its disk."""
    import training.streaming
    from training.streaming import ShardCache

    made = aged(tmp_path / "cache", sizes)
    monkeypatch.setattr(training.streaming, "shutil", disk(tmp_path / "cache", free))
    cache = ShardCache(REMOTE + "/shards.json", ShardIndex([], [], []), CacheSettings(max_bytes=max_bytes))
    cache._evict(keep=made[keep])
    return sorted(p.stem for p in (tmp_path / "cache").iterdir())


def test_the_cache_evicts_the_least_recently_used_shards_down_to_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plenty = 10**15
    # The names sort against the order of use: the order is the use, not the name.
    left = evict(tmp_path / "a", monkeypatch, "a", 200, plenty, d=100, c=100, b=100, a=100)
    assert left == ["a", "b"]  # down to the bound exactly, no further
    left = evict(tmp_path / "b", monkeypatch, "d", 100, plenty, d=100, c=100, b=100)
    assert left == ["d"]  # the shard just fetched stays, even when it is the oldest
    assert evict(tmp_path / "c", monkeypatch, "a", 300, plenty, b=100, a=100) == ["a", "b"]


def test_the_cache_leaves_two_gb_free_on_its_disk_whatever_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.streaming import FREE_DISK_BYTES

    # 300 bytes cached, 100 short of the margin: 200 may stay.
    left = evict(tmp_path / "a", monkeypatch, "c", 10**12, FREE_DISK_BYTES - 100, a=100, b=100, c=100)
    assert left == ["b", "c"]
    assert evict(tmp_path / "b", monkeypatch, "c", 10**12, FREE_DISK_BYTES, a=100, b=100, c=100) == [
        "a",
        "b",
        "c",
    ]


def test_a_disk_that_fills_as_the_shard_is_flushed_is_disk_full_naming_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import training.streaming

    cache, _ = remote_cache(tmp_path, [[b"a" * 10]])
    directory = tmp_path / "c" / "d"
    monkeypatch.setattr(training.streaming, "shutil", disk(directory, 0))

    def full(_fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as raised:
        cache.path(0)
    assert raised.value.errno == errno.ENOSPC and str(raised.value.strerror).startswith(
        f"disk full while caching shard {REMOTE}/shard-000000.tar (0.0 GB) in {directory} (0.0 GB free); "
    )
    assert [p.suffix for p in directory.iterdir()] == [".lock"]  # nothing half-written stays


def test_eviction_skips_what_other_processes_evict_and_clears_only_dead_downloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    import training.streaming
    from training.streaming import ShardCache

    made = aged(tmp_path, {"b": 100, "c": 100, "d": 100})
    (tmp_path / "a.tar").symlink_to(tmp_path / "gone")  # listed, then gone before it is looked at
    (tmp_path / "e.part").write_bytes(b"x" * 1000)  # a download running elsewhere: its lock is held
    # What killed downloads left (boto3's temporaries): many, so that whatever order the cleanup takes them
    # in (a set of names), some come after the running download's.
    for n in range(24):
        (tmp_path / f"f{n}.part.3fa9c1d2").write_bytes(b"x")
    real_glob = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern: iter(sorted(real_glob(self, pattern))))

    def meanwhile(path: Path) -> Any:
        made["b"].unlink()  # another rank evicts the oldest while this one decides
        return disk(tmp_path, 10**15).disk_usage(path)

    monkeypatch.setattr(training.streaming, "shutil", SimpleNamespace(disk_usage=meanwhile))
    with (tmp_path / "e.lock").open("w") as running:
        fcntl.flock(running, fcntl.LOCK_EX)
        ShardCache(REMOTE, ShardIndex([], [], []), CacheSettings(max_bytes=100))._evict(keep=made["d"])
    left = ["a.tar", "d.tar", "e.lock", "e.part", *(f"f{n}.lock" for n in range(24))]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(left)


def test_a_cached_copy_is_checked_once_per_process_and_a_damaged_one_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:

    cache, s3 = remote_cache(tmp_path, [[b"a" * 10], [b"b" * 10], [b"c" * 10]])
    directory = tmp_path / "c" / "d"
    directory.mkdir(parents=True)
    good, bad, short = (directory / f"{info.sha256}.tar" for info in cache.index.shards)
    good.write_bytes(b"a" * 10)  # an earlier life's copy
    bad.write_bytes(b"B" * 10)  # the right size, not the right bytes: a crash before it reached the disk
    short.write_bytes(b"c" * 9)
    hashed = hash_counter(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="training"):
        assert cache.path(0) == good and cache.path(0) == good and s3.calls == [] and hashed == [good]
        assert cache.path(1).read_bytes() == b"b" * 10 and cache.path(2).read_bytes() == b"c" * 10
    assert [key for _, key, _, _ in s3.calls] == [
        "data/train/shard-000001.tar",
        "data/train/shard-000002.tar",
    ]
    assert [r.getMessage() for r in caplog.records] == [
        f"shard {REMOTE}/shard-00000{n}.tar: the cached copy {path} is damaged; fetching it again"
        for n, path in ((1, bad), (2, short))
    ]
    hashed.clear()
    cache.path(1)  # fetched and checked in this process: not hashed again
    assert hashed == []
    fresh = remote_cache(tmp_path / "other", [[b"z"]])[0]
    assert fresh._intact(tmp_path / "nowhere.tar", 0) is False  # evicted meanwhile: fetched again


def cached_copy(cache: Any, shard: int, data: bytes) -> Path:
    """What an earlier life (or a crash) left in the cache as shard number `shard`: `data`, no marker."""
    target = cache.settings.directory() / f"{cache.index.shards[shard].sha256}.tar"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)
    return target


def another_process(cache: Any) -> Any:
    """A ShardCache as a loader worker gets it (pickled: its own client, its own set of checked shards)."""
    import pickle

    other = pickle.loads(pickle.dumps(cache))
    other._verified, other._client = set(), cache._client
    return other


def identity(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}


def test_a_shard_checked_by_one_process_is_trusted_by_the_others_without_hashing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    cache, s3 = remote_cache(tmp_path, [[b"a" * 10], [b"b" * 10]])
    # An earlier life's copy, from before markers: hashed once, then marked.
    earlier = cached_copy(cache, 1, b"b" * 10)
    hashed = hash_counter(monkeypatch)
    downloaded = cache.path(0)
    assert cache.path(1) == earlier and hashed == [downloaded.with_suffix(".part"), earlier]
    for shard in (downloaded, earlier):
        assert json.loads(shard.with_suffix(".ok").read_text()) == identity(shard)

    hashed.clear()
    markers = {shard: shard.with_suffix(".ok").stat().st_ino for shard in (downloaded, earlier)}
    workers = [another_process(cache) for _ in range(3)]
    for worker in workers:
        assert worker.path(0) == downloaded and worker.path(1) == earlier
    assert hashed == [] and len(s3.calls) == 1  # three workers, two shards: no hash, no download
    # Nor a write: a marker that already says so is not written again by each worker (only touched).
    assert {shard: shard.with_suffix(".ok").stat().st_ino for shard in markers} == markers


def test_a_shard_written_over_after_its_marker_is_hashed_again_and_fetched_again_when_damaged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cache, s3 = remote_cache(tmp_path, [[b"a" * 10], [b"b" * 10]])
    damaged, rewritten = cache.path(0), cache.path(1)
    marked = {path: path.with_suffix(".ok").read_bytes() for path in (damaged, rewritten)}
    mtime = damaged.stat().st_mtime_ns
    damaged.write_bytes(b"A" * 10)  # written over in place: the same inode and size, another mtime
    # Set, not left to the clock: a write within the clock's tick (milliseconds) would keep the mtime.
    os.utime(damaged, ns=(mtime + 10**9, mtime + 10**9))
    # Replaced by another file of the same bytes, size and mtime: only the inode tells.
    (tmp_path / "copy").write_bytes(b"b" * 10)
    os.utime(tmp_path / "copy", ns=(rewritten.stat().st_atime_ns, rewritten.stat().st_mtime_ns))
    (tmp_path / "copy").replace(rewritten)
    for path, body in marked.items():
        assert path.with_suffix(".ok").read_bytes() == body  # the markers still say what they said

    hashed = hash_counter(monkeypatch)
    worker = another_process(cache)
    with caplog.at_level(logging.WARNING, logger="training"):
        assert worker.path(0).read_bytes() == b"a" * 10 and worker.path(1).read_bytes() == b"b" * 10
    assert [key for _, key, _, _ in s3.calls[2:]] == ["data/train/shard-000000.tar"]  # the damaged one only
    assert hashed[:2] == [damaged, damaged] and rewritten in hashed  # checked, not trusted
    assert [r.getMessage() for r in caplog.records] == [
        f"shard {REMOTE}/shard-000000.tar: the cached copy {damaged} is damaged; fetching it again"
    ]
    import json

    for path in (damaged, rewritten):  # marked again, as the files they are now
        assert json.loads(path.with_suffix(".ok").read_text()) == identity(path)


@pytest.mark.parametrize(
    "marker",
    [
        b"",
        b"\xff\xfe not json",
        b"[1, 2, 3]",
        b'{"size": 10}',
        b'{"size": 10, "mtime_ns": 1, "inode": 2}',
        b'{"size": "10", "mtime_ns": null, "inode": {}, "extra": 1}',
        "a folder",
    ],
)
def test_a_marker_of_another_file_or_not_a_marker_at_all_is_ignored_never_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marker: bytes | str
) -> None:
    cache, s3 = remote_cache(tmp_path, [[b"a" * 10]])
    good = cached_copy(cache, 0, b"a" * 10)
    if isinstance(marker, bytes):
        good.with_suffix(".ok").write_bytes(marker)
    else:
        good.with_suffix(".ok").mkdir()  # cannot be read, nor replaced: still no error
    hashed = hash_counter(monkeypatch)
    assert cache.path(0) == good and hashed == [good] and s3.calls == []


def test_a_marker_that_cannot_be_written_only_costs_the_next_process_a_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    cache, s3 = remote_cache(tmp_path, [[b"a" * 10]])

    def full(**_: Any) -> tuple[int, str]:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patched:
        patched.setattr(tempfile, "mkstemp", full)
        target = cache.path(0)
        assert cache.path(0) == target  # not marked: its recency falls back to the tar's mtime
    assert sorted(p.suffix for p in target.parent.iterdir()) == [".lock", ".tar"]
    hashed = hash_counter(monkeypatch)
    assert another_process(cache).path(0) == target and hashed == [target] and len(s3.calls) == 1
    assert target.with_suffix(".ok").exists()


def test_a_marker_a_killed_writer_left_half_written_is_in_the_cache_and_swept_once_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import json

    import training.streaming
    from training.streaming import _remove_stale_partials

    cache, _ = remote_cache(tmp_path, [[b"a" * 10], [b"b" * 10]])

    def killed(*_: Any, **__: Any) -> None:
        raise KeyboardInterrupt  # the process dies mid-write: nothing of its own cleans up

    with monkeypatch.context() as patched:
        patched.setattr(json, "dump", killed)
        with pytest.raises(KeyboardInterrupt):
            cache.path(0)
    # The next process: the copy is whole (renamed into place before the marker), hashed and marked.
    target = another_process(cache).path(0)
    (left,) = target.parent.glob("*.tmp")
    assert left.parent == target.parent and left.name.startswith(f"{target.stem}.ok-")
    os.utime(left, (1, 1))  # older than any live writer
    fresh = target.parent / f"{target.stem}.ok-live.tmp"
    fresh.write_text("")  # a writer still at work: kept
    _remove_stale_partials(target.parent)
    assert not left.exists() and fresh.exists() and target.with_suffix(".ok").exists()

    # A marker that cannot be renamed into place: its temporary file goes, and the reason is said at debug.
    def refused(self: Path, other: Any) -> Path:
        raise OSError(errno.EROFS, "read-only file system")

    with monkeypatch.context() as patched, caplog.at_level(logging.DEBUG, logger="training"):
        patched.setattr(Path, "replace", refused)
        second = cache.path(1)
    assert sorted(p.name for p in second.parent.glob(f"{second.stem}*")) == [
        f"{second.stem}.lock",
        f"{second.stem}.tar",
    ]
    assert f"shard cache: no marker for {second}: [Errno 30] read-only file system" in caplog.messages
    assert training.streaming._marker(second).exists() is False


def test_a_shard_checked_once_in_a_process_is_not_looked_at_again_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import training.streaming

    cache, _ = remote_cache(tmp_path, [[b"a" * 10], [b"b" * 10], [b"c" * 10]])
    earlier = cached_copy(cache, 2, b"c" * 10)  # an earlier life's, unmarked
    downloaded = cache.path(0)  # checked by its download
    assert cache.path(2) == earlier  # checked by its hash
    warm = another_process(cache)
    assert warm.path(1) and warm.path(0) == downloaded  # checked by its marker
    assert cache.path(1) == warm.path(1)  # the other process's download, checked by its marker
    looked: list[Path] = []
    real = training.streaming._marked

    def marked(target: Path, identity: Any) -> bool:
        looked.append(target)
        return bool(real(target, identity))

    monkeypatch.setattr(training.streaming, "_marked", marked)
    for process in (cache, warm):
        assert process.path(0) == downloaded and process.path(1).exists()
    assert cache.path(2) == earlier
    assert looked == [], "a process trusts its own check: no marker read, no hash"


def test_a_client_another_process_made_is_never_used_here_and_one_made_here_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A loader worker forked after the read-ahead made its client inherits it, with its pooled connections:
    # two processes reading one connection's answers would mix them.
    import training.streaming

    made: list[object] = []

    def client() -> object:
        made.append(object())
        return made[-1]

    monkeypatch.setattr(training.streaming, "_s3_client", client)
    cache, given = remote_cache(tmp_path, [[b"a" * 10]])
    assert cache._s3() is given and made == []  # given (a test's, pid None): kept
    cache._client_pid = os.getpid() + 1  # made by the parent before the fork
    mine = cache._s3()
    assert made == [mine] and cache._client_pid == os.getpid()
    assert cache._s3() is mine and len(made) == 1  # this process's own: kept
    worker = another_process(cache)
    worker._client, worker._client_pid = None, None
    assert worker._s3() is made[-1] and len(made) == 2  # a worker sent its copy makes its own


def test_the_s3_client_has_a_session_of_its_own_not_boto3s_shared_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The read-ahead's threads may make clients at once; boto3's default session is not thread-safe.
    import boto3

    from training.streaming import _s3_client

    monkeypatch.setattr(boto3, "DEFAULT_SESSION", None)
    assert _s3_client().meta.service_model.service_name == "s3"
    assert boto3.DEFAULT_SESSION is None


def test_the_s3_client_holds_a_connection_for_every_part_of_every_shard_in_flight() -> None:
    # botocore's default pool (10) would cap 4 shards x 8 parts at 10 connections and warn for the others.
    from training.streaming import MAX_CONCURRENT_SHARDS, PARALLEL_PARTS, _s3_client

    client = _s3_client()
    assert client.meta.config.max_pool_connections == PARALLEL_PARTS * MAX_CONCURRENT_SHARDS == 32
    assert client.meta.config.retries == {"total_max_attempts": 6, "mode": "adaptive"}  # 5 retries


def test_eviction_follows_the_markers_recency_and_deletes_each_marker_before_its_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import training.streaming
    from training.streaming import ShardCache

    # The tars' own mtimes say a, b, c, d (their downloads); their markers' say the later use: d, a, c, and
    # b was never marked (its download's time counts).
    made = aged(tmp_path, {"a": 100, "b": 100, "c": 100, "d": 100})
    for name, used in (("d", 2000), ("a", 3000), ("c", 4000)):
        made[name].with_suffix(".ok").write_text("{}")
        os.utime(made[name].with_suffix(".ok"), (used, used))
    (tmp_path / "gone.ok").write_text("{}")  # its shard was evicted after the check that marked it
    (tmp_path / "e.ok-abc123.tmp").write_text("{}")  # a killed process's temporary marker, long ago
    os.utime(tmp_path / "e.ok-abc123.tmp", (1, 1))
    (tmp_path / "f.ok-def456.tmp").write_text("{}")  # being written now: left alone
    monkeypatch.setattr(training.streaming, "shutil", disk(tmp_path, 10**15))
    deleted: list[str] = []
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        deleted.append(self.name)
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    ShardCache(REMOTE, ShardIndex([], [], []), CacheSettings(max_bytes=200))._evict(keep=made["a"])
    monkeypatch.undo()
    shards = [name for name in deleted if name.endswith((".tar", ".ok"))]
    assert shards == ["gone.ok", "b.ok", "b.tar", "d.ok", "d.tar"]  # the least recently used, marker first
    left = ["a.ok", "a.tar", "c.ok", "c.tar", "f.ok-def456.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == left


def test_a_damaged_copy_another_rank_evicts_while_it_is_checked_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import training.streaming

    cache, s3 = remote_cache(tmp_path, [[b"a" * 10]])
    target = cached_copy(cache, 0, b"A" * 10)
    real_hash = training.streaming.sha256_file
    checks = iter(["damaged", "evicted"])

    def check(path: Path) -> str:
        if path == target and next(checks, None) == "evicted":
            target.unlink()  # another rank's eviction, between the check's stat and its read
            raise FileNotFoundError(path)
        return real_hash(path)

    monkeypatch.setattr(training.streaming, "sha256_file", check)
    assert cache.path(0).read_bytes() == b"a" * 10 and len(s3.calls) == 1


def test_a_damaged_copy_another_rank_evicts_as_it_is_deleted_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl

    cache, s3 = remote_cache(tmp_path, [[b"a" * 10]])
    directory = tmp_path / "c" / "d"
    target = cached_copy(cache, 0, b"A" * 10)
    real_exists = Path.exists

    def locked() -> bool:
        with (directory / f"{target.stem}.lock").open("w") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            return False

    evicted: list[Path] = []

    def exists(self: Path) -> bool:
        there = real_exists(self)
        if self == target and there and not evicted and locked():
            # Seen there under the lock, then evicted by another rank (eviction takes none); once: the copy
            # fetched again is not evicted.
            target.unlink()
            evicted.append(target)
        return there

    monkeypatch.setattr(Path, "exists", exists)
    assert cache.path(0) == target and len(s3.calls) == 1 and evicted == [target]
    monkeypatch.undo()
    assert target.read_bytes() == b"a" * 10


def test_a_copy_evicted_after_its_check_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import training.streaming

    cache, s3 = remote_cache(tmp_path, [[b"a" * 10]])
    target = cached_copy(cache, 0, b"a" * 10)
    real_hash = training.streaming.sha256_file

    def checked_then_evicted(path: Path) -> str:
        digest = real_hash(path)
        if path == target:
            target.unlink()  # the read-ahead made room just after this check
        return digest

    monkeypatch.setattr(training.streaming, "sha256_file", checked_then_evicted)
    assert cache.path(0) == target and len(s3.calls) == 1
    assert target.read_bytes() == b"a" * 10


def test_a_killed_downloads_leftovers_are_removed_before_the_shard_is_fetched_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, s3 = remote_cache(tmp_path, [[b"a"]])
    directory = tmp_path / "c" / "d"
    directory.mkdir(parents=True)
    sha = cache.index.shards[0].sha256
    for name in (f"{sha}.part", f"{sha}.part.0a1b2c3d"):
        (directory / name).write_bytes(b"stale")
    seen: list[list[str]] = []
    s3.during = lambda _filename: seen.append(
        sorted(p.name for p in directory.iterdir() if ".part" in p.name)
    )
    real_glob = Path.glob

    def listed(self: Path, pattern: str) -> Any:
        # One more, already gone when it is deleted: another process cleared it after the listing.
        ghost = [self / f"{sha}.part.cleared"] if ".part" in pattern else []
        return iter([*real_glob(self, pattern), *ghost])

    monkeypatch.setattr(Path, "glob", listed)
    cache.path(0)
    monkeypatch.undo()
    assert seen == [[]] and sorted(p.suffix for p in directory.iterdir()) == [".lock", ".ok", ".tar"]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES])
def test_a_disk_error_while_caching_is_not_waited_out_and_disk_full_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    import training.streaming
    from training.streaming import ShardCache
    from trainstack_job.shards import ShardInfo

    clock = Clock()
    monkeypatch.setattr(training.streaming, "time", clock)
    index = shard_index(tmp_path / "bucket", [[b"a"]], source=REMOTE)
    big = ShardIndex(
        index.classes, [ShardInfo(index.shards[0].key, 1_050_000_000, "f" * 64)], index.samples, REMOTE
    )
    directory = tmp_path / "cache"
    monkeypatch.setattr(training.streaming, "shutil", disk(directory, 3.45e9))
    cache = ShardCache("", big, CacheSettings(str(directory)))
    cache._client = s3 = FakeS3(tmp_path / "bucket", [OSError(code, os.strerror(code))])
    s3.during = lambda filename: Path(f"{filename}.77aa").write_bytes(b"half")  # boto3's temporary file
    with pytest.raises(OSError) as raised:
        cache.path(0)
    assert raised.value.errno == code and clock.pauses == [] and len(s3.calls) == 1
    if code == errno.ENOSPC:
        assert raised.value.filename == str(directory) and raised.value.__cause__ is None
        assert raised.value.strerror == (
            f"disk full while caching shard {REMOTE}/shard-000000.tar (1.1 GB) in {directory} (3.5 GB free); "
            "free space there, lower data.cache_gb or set data.cache_dir to a larger disk"
        )
    else:
        assert raised.value.strerror == os.strerror(errno.EACCES)
    assert [p.suffix for p in directory.iterdir()] == [".lock"]


def test_load_index_reads_s3_or_disk_and_names_the_index_and_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import training.streaming
    from training.streaming import load_index

    index = shard_index(tmp_path, [[b"a"]])
    asked: list[dict[str, str]] = []

    class Index:
        def download_fileobj(self, bucket: str, key: str, received: Any, **options: Any) -> None:
            asked.append({"Bucket": bucket, "Key": key})
            # In 8 parallel ranges of 8 MiB, read 1 MiB at a time, as a shard is.
            config = options["Config"]
            assert (config.max_concurrency, config.multipart_chunksize, config.io_chunksize) == (
                8,
                2**23,
                2**20,
            )
            received.write((tmp_path / INDEX_NAME).read_bytes())

    monkeypatch.setattr(training.streaming, "_s3_client", Index)
    assert load_index(f"s3://bucket/data/train/{INDEX_NAME}") == index
    assert asked == [{"Bucket": "bucket", "Key": f"data/train/{INDEX_NAME}"}]
    assert load_index(str(tmp_path / INDEX_NAME)) == index
    (tmp_path / "old.json").write_text(json.dumps({**index.to_json(), "format": "v0"}))
    with pytest.raises(BadDataError) as raised:
        load_index(str(tmp_path / "old.json"))
    assert str(raised.value).startswith(f"{tmp_path / 'old.json'}: format 'v0', expected ")
    with pytest.raises(BadDataError) as raised:
        load_index(str(tmp_path / "gone.json"))
    assert str(raised.value) == (
        f"shard index {tmp_path / 'gone.json'}: cannot be read (FileNotFoundError: [Errno 2] No such file or "
        f"directory: '{tmp_path / 'gone.json'}'); push the dataset again with "
        "`trainstack data push DIR --format shards`"
    )
    assert raised.value.__cause__ is None


def test_an_s3_outage_at_the_index_read_is_waited_out_and_a_missing_index_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from botocore.exceptions import ClientError, EndpointConnectionError

    import training.streaming
    from training.streaming import OUTAGE_SECONDS, load_index

    index = shard_index(tmp_path, [[b"a"]])
    clock = [0.0]
    pauses: list[float] = []

    def sleep(seconds: float) -> None:
        pauses.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(training.streaming, "time", SimpleNamespace(monotonic=lambda: clock[0], sleep=sleep))
    failures: list[Exception] = []

    class Index:
        def download_fileobj(self, bucket: str, key: str, received: Any, **options: Any) -> None:
            if failures:
                received.write(b"half of it")  # a failed try's bytes are never parsed with the next one's
                raise failures.pop(0)
            received.write((tmp_path / INDEX_NAME).read_bytes())

    monkeypatch.setattr(training.streaming, "_s3_client", Index)
    down = EndpointConnectionError(endpoint_url="https://s3.amazonaws.com")
    # An outage of 4 tries (a code-less error among them): waited out, each retry said with its cause.
    failures[:] = [
        down,
        ClientError({}, "GetObject"),
        down,
        ClientError({"Error": {"Code": "SlowDown"}}, "GetObject"),
    ]
    with caplog.at_level("WARNING", logger="training.streaming"):
        assert load_index("s3://b/data/train/shards.json") == index
    assert pauses == [1.0, 2.0, 4.0, 8.0]
    assert caplog.messages[0] == (
        'shard index s3://b/data/train/shards.json: Could not connect to the endpoint URL: "https://s3.amazonaws.com"'
        "; retrying in 1s (S3 unreachable?)"
    )
    assert "SlowDown" in caplog.messages[3] and len(caplog.messages) == 4

    for code in ("NoSuchKey", "404", "NotFound"):
        failures[:] = [ClientError({"Error": {"Code": code}}, "GetObject")]
        with pytest.raises(BadDataError) as missing:
            load_index("s3://b/data/train/shards.json")
        assert str(missing.value) == (
            "shard index s3://b/data/train/shards.json is missing from S3; "
            "push the dataset again with `trainstack data push DIR --format shards`"
        )
    # Refused, or unreachable past the outage's limit: S3's own error (the life fails and is retried), never
    # bad data (which would stop the job).
    pauses.clear()
    for code in ("AccessDenied", "403"):
        failures[:] = [ClientError({"Error": {"Code": code}}, "GetObject")]
        with pytest.raises(ClientError):
            load_index("s3://b/data/train/shards.json")
    assert pauses == []
    pauses.clear()
    failures[:] = [down] * 100
    with pytest.raises(EndpointConnectionError):
        load_index("s3://b/data/train/shards.json")
    assert OUTAGE_SECONDS <= sum(pauses) < OUTAGE_SECONDS + 60 and max(pauses) == 30.0


def test_a_sample_whose_name_holds_a_colon_is_found_by_that_name(tmp_path: Path) -> None:
    import hashlib
    import json

    from trainstack_job.shards import SampleEntry, ShardInfo

    body = png(10) + png(20)
    (tmp_path / "shard-000000.tar").write_bytes(body)
    entries = [
        SampleEntry(0, 0, len(png(10)), 0, "c0/a:b.png"),
        SampleEntry(0, len(png(10)), len(png(20)), 1, "c1/b"),
    ]
    infos = [ShardInfo("shard-000000.tar", len(body), hashlib.sha256(body).hexdigest())]
    index = ShardIndex(["c0", "c1"], infos, entries)
    (tmp_path / INDEX_NAME).write_text(json.dumps(index.to_json()))
    folder = ShardFolder(str(tmp_path / INDEX_NAME))
    name, label = folder.samples[0]
    assert (name, label) == (f"{tmp_path}/shard-000000.tar:c0/a:b.png", 0)
    assert folder.entry(name) == entries[0] and folder.loader(name).getpixel((0, 0)) == (10, 10, 10)


def test_a_shard_folder_names_samples_by_shard_and_reads_them_as_rgb_images(tmp_path: Path) -> None:
    shards = [[png(10), png(20, "RGB")], [png(30), b""]]
    index = shard_index(tmp_path, shards)
    folder = ShardFolder(str(tmp_path / INDEX_NAME))
    assert folder.index_uri == str(tmp_path / INDEX_NAME) and folder.index == index
    assert folder.classes == ["c0", "c1"] and len(folder) == 4 and folder.shard_sizes() == [2, 2]
    assert folder.cache.settings == CacheSettings()
    assert list(folder.samples) == [
        (f"{tmp_path}/shard-000000.tar:c0/0-0.png", 0),
        (f"{tmp_path}/shard-000000.tar:c1/0-1.png", 1),
        (f"{tmp_path}/shard-000001.tar:c0/1-0.png", 0),
        (f"{tmp_path}/shard-000001.tar:c1/1-1.png", 1),
    ]
    assert folder.samples[1:3] == list(folder.samples)[1:3] and folder.samples[-1] == folder.samples[3]
    # Opening looked no sample's name up: a shard's names are looked up when this process first reads it.
    assert folder._positions == {}
    image = folder.loader(folder.samples[2][0])
    assert list(folder._positions) == [1]
    looked_up = folder._positions[1]
    assert folder.entry(folder.samples[3][0]) == folder.index.samples[3]
    assert folder._positions[1] is looked_up  # once per shard and process, not once per sample
    # A name not in the split, a shard not in it, a sample of shard 0 named as if in shard 1: none is found.
    strangers = ["shard-000001.tar:c0/9.png", "shard-000009.tar:c0/1-0.png", "shard-000001.tar:c0/0-0.png"]
    for stranger in (f"{tmp_path}/{name}" for name in strangers):
        with pytest.raises(KeyError) as missing:
            folder.entry(stranger)
        assert missing.value.args == (stranger,)
    with pytest.raises(KeyError):  # another split's (or dataset's) shard of the same key
        folder.entry("s3://elsewhere/shard-000001.tar:c0/1-0.png")
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (30, 30, 30)
    assert folder.loader(folder.samples[1][0]).getpixel((1, 1)) == (20, 0, 0)
    with pytest.raises(ValueError, match=r"^empty file \(0 bytes\)$"):
        folder.loader(folder.samples[3][0])
    settings = CacheSettings("/elsewhere", read_ahead=5)
    folder.configure(settings)
    assert folder.cache.settings is settings


def test_a_truncated_shard_is_one_line_naming_the_shard_and_the_sample(tmp_path: Path) -> None:
    shard_index(tmp_path, [[png(1), png(2)]])
    folder = ShardFolder(str(tmp_path / INDEX_NAME))
    with (tmp_path / "shard-000000.tar").open("r+b") as shard:
        shard.truncate(len(png(1)) + 3)
    with pytest.raises(BadDataError) as raised:
        folder.loader(folder.samples[1][0])
    assert str(raised.value) == (
        f"shard {tmp_path}/shard-000000.tar ends before sample c1/0-1.png: it is truncated; push the dataset "
        "again with `trainstack data push DIR --format shards`"
    )


def test_a_shard_folder_keeps_16_shards_open_and_goes_to_its_workers_without_them(tmp_path: Path) -> None:
    import pickle

    shard_index(tmp_path, [[png(n)] for n in range(18)])
    folder = ShardFolder(str(tmp_path / INDEX_NAME))
    opened: list[int] = []
    real_path = folder.cache.path

    def path(shard: int) -> Path:
        opened.append(shard)
        return real_path(shard)

    folder.cache.path = path  # type: ignore[method-assign]
    for name, _ in folder.samples[:17]:
        folder.loader(name)
    first = folder._open.get(1)
    folder.loader(folder.samples[1][0])
    assert opened == list(range(17)) and sorted(folder._open) == list(range(1, 17)) and first is not None
    folder.loader(folder.samples[0][0])  # closed as the oldest: opened again, in place of shard 1
    assert opened == [*range(17), 0] and sorted(folder._open) == [0, *range(2, 17)] and first.closed
    # A shard evicted (by another rank) between its fetch and its opening is fetched again.
    gone = iter([tmp_path / "evicted.tar"])
    folder.cache.path = lambda shard: next(gone, None) or real_path(shard)  # type: ignore[method-assign]
    assert folder.loader(folder.samples[17][0]).getpixel((0, 0)) == (17, 17, 17)
    del folder.cache.path
    worker = pickle.loads(pickle.dumps(folder))
    assert worker._open == {} and worker.loader(worker.samples[16][0]).getpixel((0, 0)) == (16, 16, 16)


def test_a_sample_error_is_the_samples_problem_in_one_line_unless_the_disk_failed(tmp_path: Path) -> None:
    from PIL import UnidentifiedImageError

    shard_index(tmp_path, [[png(1), b""]])
    folder = ShardFolder(str(tmp_path / INDEX_NAME))
    (image, _), (empty, _) = folder.samples
    assert folder.decode_problem(image, OSError(errno.EIO, "I/O error")) is None
    assert folder.decode_problem(image, UnidentifiedImageError("cannot identify")) == (
        "UnidentifiedImageError: cannot identify"
    )
    assert folder.decode_problem(image, ValueError("bad\nheader")) == "ValueError: bad header"
    # Worded as a synced folder's empty file is (training.data.decode_problem).
    assert folder.decode_problem(empty, ValueError("empty file (0 bytes)")) == "empty file (0 bytes)"
    assert folder.decode_problem("elsewhere", ValueError("x")) == "ValueError: x"


class Watched(threading.Condition):
    """The read-ahead's condition, telling the test when every fetching thread waits with nothing to do since
    the last plan or advance (each notifies all: `idle` counts the threads that waited since)."""

    def __init__(self) -> None:
        super().__init__()
        self.idle = 0

    def notify_all(self) -> None:
        self.idle = 0
        super().notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        self.idle += 1
        return super().wait(timeout)


def read_ahead(monkeypatch: pytest.MonkeyPatch, fetch: Any, shards: int) -> tuple[Any, Any]:
    """A ReadAhead and `tell(method, *args)`: calls plan/advance, returns once its threads are idle."""
    import training.streaming
    from training.streaming import ReadAhead

    watched = Watched()
    monkeypatch.setattr(
        training.streaming, "threading", SimpleNamespace(Condition=lambda: watched, Thread=threading.Thread)
    )
    ahead = ReadAhead(fetch, shards)

    def tell(method: str, *args: Any) -> None:
        with watched:
            getattr(ahead, method)(*args)
        wait_until(
            lambda: watched.idle == len(ahead._threads),
            timeout=10,
            what=f"the read-ahead idle after {method}{args}",
        )

    return ahead, tell


def test_the_read_ahead_fetches_in_the_samplers_order_and_stays_its_bound_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fetched: list[int] = []
    ahead, tell = read_ahead(monkeypatch, fetched.append, 2)
    names = {t.name: t for t in threading.enumerate() if t.ident in {a.ident for a in ahead._threads}}
    assert sorted(names) == ["shard-read-ahead-0", "shard-read-ahead-1"]  # read_ahead 2: two at once
    assert all(t.daemon for t in names.values()) and ahead.error is None  # never holds the process

    def since(step: int) -> list[int]:
        # Two threads append in whichever order their fetches end: each step's set, in the steps' order.
        return sorted(fetched[step:])

    tell("plan", [4, 4, 1, 1, 6, 6, 2, 2, 0, 0])
    assert since(0) == [1, 4, 6]  # the shard in use and the next two
    tell("advance", 2)
    assert since(3) == [2] and len(fetched) == 4
    tell("advance", 3)
    assert len(fetched) == 4  # 6 is first used at position 4
    tell("advance", 4)
    assert since(4) == [0] and len(fetched) == 5
    # The next epoch starts at its first sample; a shard is fetched again (the cache may have evicted it).
    tell("plan", [3, 6, 6, 5, 4])
    assert since(5) == [3, 5, 6] and len(fetched) == 8
    tell("plan", [3])
    assert since(8) == [3] and len(fetched) == 9


@pytest.mark.parametrize(("read_ahead_shards", "threads"), [(0, 1), (1, 1), (3, 3), (4, 4), (9, 4)])
def test_the_read_ahead_fetches_its_shards_at_once_on_up_to_four_threads(
    read_ahead_shards: int, threads: int
) -> None:
    # One shard at a time, a network limited per connection held the loader to one shard's parts' bandwidth.
    from training.streaming import MAX_CONCURRENT_SHARDS, ReadAhead

    started: list[int] = []
    release = threading.Event()
    lock = threading.Lock()

    def fetch(shard: int) -> None:
        with lock:
            started.append(shard)
        release.wait(timeout=30)

    ahead = ReadAhead(fetch, read_ahead_shards)
    try:
        assert len(ahead._threads) == threads <= MAX_CONCURRENT_SHARDS
        ahead.plan(list(range(12)))  # one sample per shard: the first in use, `read_ahead_shards` ahead
        wanted = 1 + read_ahead_shards
        wait_until(
            lambda: len(started) == min(threads, wanted), timeout=10, what=f"{threads} fetches at once"
        )
        assert sorted(started) == list(range(min(threads, wanted)))  # the soonest needed first
        release.set()
        wait_until(lambda: len(started) == wanted, timeout=10, what=f"all {wanted} wanted shards fetched")
        assert sorted(started) == list(range(wanted))  # no more than its bound, none twice
    finally:
        release.set()


def test_a_failed_read_ahead_is_logged_kept_and_the_next_shard_still_fetched(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fetched: list[int] = []
    boom = OSError("disk full")

    def fetch(shard: int) -> None:
        fetched.append(shard)
        if shard == 7:
            raise boom

    ahead, tell = read_ahead(monkeypatch, fetch, 1)
    with caplog.at_level(logging.WARNING, logger="training"):
        tell("plan", [7, 8, 9])
    assert fetched == [7, 8] and ahead.error is boom
    assert [r.getMessage() for r in caplog.records] == ["read-ahead of shard 7 failed: disk full"]
