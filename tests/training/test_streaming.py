"""A split pushed as shards is streamed: read from S3 (moto here) through a bounded local cache, in a
shard-aware order that is still a pure function of (seed, epoch), so an interrupted and resumed run on a
new instance (empty cache) ends bitwise where an uninterrupted one does; bad images in a shard are named
and skipped; a corrupt or missing shard is one line naming it and the fix."""

from __future__ import annotations

import copy
import shutil
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import pytest
import torch
from torch import nn

from tests.conftest import MotoServer
from tests.training.conftest import Dataset, hash_counter
from tests.waiting import wait_until
from training.data import (
    STREAMING,
    BatchPlan,
    EvalDataset,
    ResumableBatchSampler,
    SeededImageFolder,
    eval_loader,
    train_loader,
    train_transform,
)
from training.dataset_layout import BadDataError
from training.streaming import CacheSettings, ShardFolder, index_location
from trainstack.datapush import write_shards
from trainstack_job.shards import INDEX_NAME, ShardIndex, iter_shard

SEED = 7
PLAN = BatchPlan(global_batch=16, world_size=1, micro_batch=8)
SHARD_BYTES = 20_000  # a few KB images: ~10 shards per split
BUCKET = "shards"


@pytest.fixture(scope="module")
def shards(image_folders: Dataset, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    classes = sorted(p.name for p in image_folders.train_dir.iterdir())
    write_shards(image_folders.train_dir.parent, out, classes, SHARD_BYTES)
    return out


def upload(shards: Path) -> str:
    """The shards in the moto bucket; returns the train split's index URI."""
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    for path in sorted(shards.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), BUCKET, f"images/{path.relative_to(shards).as_posix()}")
    return f"s3://{BUCKET}/images/train/{INDEX_NAME}"


def loader(
    root: str, cache: Path, epoch: int, step: int, workers: int = 0, cache_bytes: int = 10**9
) -> tuple[ResumableBatchSampler, Any]:
    dataset = SeededImageFolder(root, train_transform(16), SEED)
    sampler = ResumableBatchSampler(len(dataset), PLAN, rank=0, seed=SEED)
    sampler.set_position(epoch, step)
    settings = CacheSettings(str(cache), max_bytes=cache_bytes, read_ahead=2, window=2)
    return sampler, train_loader(dataset, sampler, {"num_workers": workers, STREAMING: settings})


def test_shards_hold_every_image_byte_for_byte_with_its_label(image_folders: Dataset, shards: Path) -> None:
    index = ShardIndex.from_json((shards / "train" / INDEX_NAME).read_bytes(), "train")
    assert index.classes == sorted(p.name for p in image_folders.train_dir.iterdir())
    assert len(index.shards) > 4
    assert sorted(e.name for e in index.samples) == sorted(
        p.relative_to(image_folders.train_dir).as_posix() for p in image_folders.train_dir.rglob("*.png")
    )
    by_shard = {i: list(iter_shard(shards / "train" / s.key)) for i, s in enumerate(index.shards)}
    for entry in index.samples:
        original = (image_folders.train_dir / entry.name).read_bytes()
        assert index.classes[entry.label] == entry.name.split("/")[0]
        with (shards / "train" / index.shards[entry.shard].key).open("rb") as stream:
            stream.seek(entry.offset)
            assert stream.read(entry.size) == original
        # The user's helper reads the same bytes and label in shard order.
        assert any(data == original and label == entry.label for _, data, label in by_shard[entry.shard])


def test_writing_the_same_images_again_gives_the_same_shards(image_folders: Dataset, tmp_path: Path) -> None:
    classes = sorted(p.name for p in image_folders.train_dir.iterdir())
    write_shards(image_folders.train_dir.parent, tmp_path / "a", classes, SHARD_BYTES)
    write_shards(image_folders.train_dir.parent, tmp_path / "b", classes, SHARD_BYTES)
    for path in (tmp_path / "a").rglob("*"):
        if path.is_file():
            assert path.read_bytes() == (tmp_path / "b" / path.relative_to(tmp_path / "a")).read_bytes()


def test_the_shard_aware_order_is_a_seeded_permutation_that_resumes_mid_epoch(shards: Path) -> None:
    folder = ShardFolder(str(shards / "train" / INDEX_NAME))
    sizes = folder.shard_sizes()

    def sampler(epoch: int, step: int) -> ResumableBatchSampler:
        made = ResumableBatchSampler(len(folder), PLAN, rank=0, seed=SEED)
        made.use_shards(sizes, window=2, read_ahead=None)
        made.set_position(epoch, step)
        return made

    full = list(sampler(1, 0))
    assert list(sampler(1, 3)) == full[3 * PLAN.accumulation :]
    assert list(sampler(1, 0)) == full and list(sampler(2, 0)) != full
    order = sampler(1, 0)._order().tolist()
    assert sorted(order) == list(range(len(folder)))
    # The first window's samples come from two shards only: a stretch of steps reads few shards.
    shard_of = sampler(1, 0)._shard_of()
    first_window = sum(sorted(sizes)[-2:])
    assert len({shard_of[i] for i in order[: min(sizes[shard_of[order[0]]], first_window)]}) <= 2


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: Any, steps: int, accumulation: int
) -> list[torch.Tensor]:
    """`steps` optimizer steps from `batches`; returns the targets seen, for the order comparison."""
    seen = []
    iterator = iter(batches)
    for _ in range(steps):
        optimizer.zero_grad()
        for _ in range(accumulation):
            batch = next(iterator)
            seen.append(batch.targets)
            loss = nn.functional.cross_entropy(model(batch.images.flatten(1)), batch.targets) / accumulation
            loss.backward()
        optimizer.step()
    return seen


def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3 * 16 * 16, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_an_interrupted_streamed_run_resumed_on_an_empty_cache_ends_bitwise_equal(
    aws: MotoServer, shards: Path, tmp_path: Path
) -> None:
    """Two epochs uninterrupted, against: 5 steps, a checkpoint of the model, the optimizer and the loader's
    position (epoch, step), then a new instance (new cache folder, loader workers instead of the main
    process) resuming mid-epoch from it."""
    uri = upload(shards)
    model, optimizer = fresh()
    sampler, batches = loader(uri, tmp_path / "cache-a", epoch=0, step=0)
    steps = sampler.steps_per_epoch
    seen = train(model, optimizer, batches, steps, PLAN.accumulation)
    sampler.set_position(1, 0)
    seen += train(model, optimizer, batches, steps, PLAN.accumulation)

    resumed_model, resumed_optimizer = fresh()
    _, first = loader(uri, tmp_path / "cache-b", epoch=0, step=0)
    resumed_seen = train(resumed_model, resumed_optimizer, first, 5, PLAN.accumulation)
    weights = copy.deepcopy(resumed_model.state_dict())
    moments = copy.deepcopy(resumed_optimizer.state_dict())
    epoch, step = 0, 5  # the loader's position, as a checkpoint carries it
    del resumed_model, resumed_optimizer, first

    resumed_model, resumed_optimizer = fresh()
    resumed_model.load_state_dict(weights)
    resumed_optimizer.load_state_dict(moments)
    sampler, batches = loader(uri, tmp_path / "cache-c", epoch=epoch, step=step, workers=1)
    resumed_seen += train(resumed_model, resumed_optimizer, batches, steps - step, PLAN.accumulation)
    sampler.set_position(1, 0)
    resumed_seen += train(resumed_model, resumed_optimizer, batches, steps, PLAN.accumulation)

    assert [t.tolist() for t in resumed_seen] == [t.tolist() for t in seen]
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed_model.state_dict()[name]), name


def size_unless_evicted(path: Path) -> int:
    """The file's size, 0 when the read-ahead evicted it since it was listed."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_a_warm_cache_is_read_without_s3_and_the_cache_stays_bounded(
    aws: MotoServer, shards: Path, tmp_path: Path
) -> None:
    uri = upload(shards)
    index = ShardIndex.from_json((shards / "train" / INDEX_NAME).read_bytes(), "train")
    largest = max(s.size for s in index.shards)
    bound = 3 * largest
    _, batches = loader(uri, tmp_path / "small", epoch=0, step=0, cache_bytes=bound)
    for _ in batches:
        cached = sum(size_unless_evicted(p) for p in (tmp_path / "small").glob("*.tar"))
        # The bound, plus at most the shards being fetched at once: the read-ahead's 2 (each is evicted for
        # just after its rename).
        assert cached <= bound + 2 * largest
    _, batches = loader(uri, tmp_path / "warm", epoch=0, step=0)
    expected = [b.images for b in batches]
    # The next life on the same disk: shards come from the cache (content-addressed), even with S3 gone.
    dataset = SeededImageFolder(uri, train_transform(16), SEED)  # the index is read first, as in a life
    for shard in boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="images/train/shard-")["Contents"]:
        boto3.client("s3").delete_object(Bucket=BUCKET, Key=shard["Key"])
    sampler = ResumableBatchSampler(len(dataset), PLAN, rank=0, seed=SEED)
    settings = CacheSettings(str(tmp_path / "warm"), read_ahead=2, window=2)
    again = [b.images for b in train_loader(dataset, sampler, {"num_workers": 0, STREAMING: settings})]
    assert all(torch.equal(a, b) for a, b in zip(again, expected, strict=True))


def test_the_read_ahead_fetches_the_next_shards_before_they_are_read(
    aws: MotoServer, shards: Path, tmp_path: Path
) -> None:
    uri = upload(shards)
    _, batches = loader(uri, tmp_path / "cache", epoch=0, step=0)
    iterator = iter(batches)
    next(iterator)
    # The first batch needs at most two shards (one window); the read-ahead fetches two more.
    wait_until(
        lambda: len(list((tmp_path / "cache").glob("*.tar"))) >= 3,
        timeout=60,
        what="the read-ahead fetching shards beyond those of the first batch",
    )


def test_a_corrupt_or_missing_shard_is_one_line_naming_it_and_the_fix(
    aws: MotoServer, shards: Path, tmp_path: Path
) -> None:
    uri = upload(shards)
    index = ShardIndex.from_json((shards / "train" / INDEX_NAME).read_bytes(), "train")
    s3 = boto3.client("s3")
    for shard in index.shards:
        s3.put_object(Bucket=BUCKET, Key=f"images/train/{shard.key}", Body=b"garbage")
    dataset = SeededImageFolder(uri, train_transform(16), SEED)
    assert isinstance(dataset.folder, ShardFolder)
    dataset.folder.configure(CacheSettings(str(tmp_path / "cache")))
    with pytest.raises(
        BadDataError, match=r"^shard s3://shards/images/train/shard-\d+\.tar is corrupt .*--format"
    ):
        dataset[(0, 0)]
    for shard in index.shards:
        s3.delete_object(Bucket=BUCKET, Key=f"images/train/{shard.key}")
    with pytest.raises(BadDataError, match=r"^shard s3://shards/images/train/shard-\d+\.tar is missing"):
        dataset[(0, 0)]
    with pytest.raises(BadDataError) as raised:
        SeededImageFolder(f"s3://{BUCKET}/nowhere/", train_transform(16), SEED)
    assert str(raised.value) == (
        f"shard index s3://{BUCKET}/nowhere/shards.json is missing from S3; "
        "push the dataset again with `trainstack data push DIR --format shards`"
    )


def test_an_index_placed_with_etags_is_downloaded_pinned_unhashed_and_a_shard_changed_since_is_named(
    aws: MotoServer, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent places each shard's ETag (bootstrap/datasync.py): every GET of it carries If-Match, no HEAD
    goes first, and the bytes are not hashed again (half the download's CPU); a shard replaced since is
    refused by S3 and named; a transfer manager that cannot pin hashes as before."""
    import training.streaming
    from bootstrap.datasync import placed_index

    upload(shards)
    s3 = boto3.client("s3")
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="images/train/")["Contents"]
    etags = {item["Key"].removeprefix("images/train/"): item["ETag"] for item in listed}
    local = tmp_path / "data" / "train"
    local.mkdir(parents=True)
    body = (shards / "train" / INDEX_NAME).read_bytes()
    (local / INDEX_NAME).write_bytes(placed_index(body, f"s3://{BUCKET}/images/train", tmp_path / "c", etags))
    hashed = hash_counter(monkeypatch)
    sent: list[tuple[str, str | None]] = []
    real_client = training.streaming._s3_client

    def watched() -> Any:
        client = real_client()
        client.meta.events.register(
            "before-send.s3",
            lambda request, **_: sent.append((request.method, request.headers.get("If-Match"))),
        )
        return client

    monkeypatch.setattr(training.streaming, "_s3_client", watched)
    dataset = SeededImageFolder(str(local), train_transform(16), SEED)
    assert isinstance(dataset.folder, ShardFolder)
    dataset.folder.configure(CacheSettings(str(tmp_path / "cache")))
    cache, shard = dataset.folder.cache, dataset.folder.index.shards

    assert cache.path(0).read_bytes() == (shards / "train" / shard[0].key).read_bytes()
    assert sent and set(sent) == {("GET", shard[0].etag.encode())}  # one GET per part, no HEAD
    assert hashed == []
    assert (cache.settings.directory() / f"{shard[0].sha256}.ok").exists()  # trusted by the next process

    original = (shards / "train" / shard[1].key).read_bytes()
    s3.put_object(Bucket=BUCKET, Key=f"images/train/{shard[1].key}", Body=original[::-1])  # same size
    with pytest.raises(BadDataError) as raised:
        cache.path(1)
    assert str(raised.value) == (
        f"shard s3://{BUCKET}/images/train/{shard[1].key} changed in S3 after this job's dataset version "
        f"was placed (its ETag is no longer {shard[1].etag}: pushed again with --force?); submit the job "
        "again to train on the current version"
    )
    assert not list((tmp_path / "cache").glob(f"{shard[1].sha256}.*[!k]"))  # no copy, no partial left

    monkeypatch.setattr(training.streaming, "_can_pin", lambda: False)  # an s3transfer before 0.11
    assert cache.path(2).read_bytes() == (shards / "train" / shard[2].key).read_bytes()
    assert [path.name for path in hashed] == [f"{shard[2].sha256}.part"]


def test_a_bad_image_in_a_shard_is_named_by_shard_and_name_and_replaced(
    image_folders: Dataset, tmp_path: Path
) -> None:
    root = tmp_path / "images"
    shutil.copytree(image_folders.train_dir.parent, root, ignore=shutil.ignore_patterns(".*"))
    (root / "train" / "class_1" / "00003.png").write_bytes(b"not a png")
    write_shards(root, tmp_path / "shards", sorted(p.name for p in (root / "train").iterdir()), SHARD_BYTES)
    train = str(tmp_path / "shards" / "train")
    assert index_location(train) == f"{train}/{INDEX_NAME}"
    dataset = SeededImageFolder(train, train_transform(16), SEED)
    bad = next(i for i, (name, _) in enumerate(dataset.folder.samples) if name.endswith("class_1/00003.png"))

    sample = dataset[(0, bad)]

    assert sample.image is not None  # the next readable image stands in
    ((name, problem),) = sample.unreadable
    assert name.startswith(f"{train}/shard-") and name.endswith(".tar:class_1/00003.png")
    assert problem.startswith("UnidentifiedImageError")
    val = EvalDataset(str(tmp_path / "shards" / "val"), 16)
    assert val.folder.classes == dataset.folder.classes
    assert sum(len(b.images) for b in eval_loader(val, 8, 0, 1, {"num_workers": 0})) == len(val)


def test_an_s3_outage_while_streaming_is_waited_out_and_nothing_is_lost(
    aws: MotoServer, shards: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from botocore.exceptions import EndpointConnectionError

    import training.streaming

    uri = upload(shards)
    dataset = SeededImageFolder(uri, train_transform(16), SEED)
    assert isinstance(dataset.folder, ShardFolder)
    dataset.folder.configure(CacheSettings(str(tmp_path / "cache")))
    cache = dataset.folder.cache
    real = boto3.client("s3")
    failures = [
        EndpointConnectionError(endpoint_url="http://s3"),
        EndpointConnectionError(endpoint_url="http://s3"),
    ]

    class Flaky:
        def download_file(self, *args: Any, **kwargs: Any) -> None:
            if failures:
                raise failures.pop()
            real.download_file(*args, **kwargs)

    cache._client = Flaky()
    pauses: list[float] = []
    # The module's clock only: moto's threads keep the real sleep.
    clock = SimpleNamespace(monotonic=time.monotonic, sleep=pauses.append)
    monkeypatch.setattr(training.streaming, "time", clock)

    sample = dataset[(0, 0)]

    assert sample.image is not None and sample.unreadable == ()
    assert pauses == [1.0, 2.0]  # backed off, then went on
    reference = SeededImageFolder(str(shards / "train"), train_transform(16), SEED)[(0, 0)]
    assert reference.image is not None and torch.equal(sample.image, reference.image)


def test_the_trainers_config_check_takes_a_shard_index_for_a_data_folder(tmp_path: Path) -> None:
    """What the agent places for a streamed split is a folder holding only shards.json (or an s3:// index):
    the config check leaves it to the streaming reader instead of refusing it as an empty ImageFolder."""
    from training.config import build_config
    from training.dataset_layout import data_dir_problems
    from trainstack_job.shards import INDEX_NAME

    train = tmp_path / "train"
    train.mkdir()
    (train / INDEX_NAME).write_text("{}", encoding="utf-8")
    config = build_config({"data": {"train_dir": str(train), "val_dir": "s3://bucket/datasets/x/val/"}})
    assert data_dir_problems(config) == []
    empty = tmp_path / "empty"
    empty.mkdir()
    config = build_config({"data": {"train_dir": str(empty), "val_dir": "s3://bucket/datasets/x/val/"}})
    assert [p.split(":")[0] for p in data_dir_problems(config)] == ["data.train_dir"]


def test_the_shuffle_window_is_part_of_the_optimisation_only_when_it_changes_the_order() -> None:
    from training.config import build_config

    default = build_config({})
    assert (
        default.optimisation_hash()
        == build_config({"data": {"shuffle_window_shards": 4}}).optimisation_hash()
    )
    assert (
        default.optimisation_hash()
        != build_config({"data": {"shuffle_window_shards": 8}}).optimisation_hash()
    )


def test_a_streamed_split_gets_the_configs_cache_settings_and_a_plain_one_gets_none(tmp_path: Path) -> None:
    """What the loaders cache and read ahead with is the config's, cache_gb in bytes (10^9 per GB, what
    the disk's free space is compared with); an ImageFolder on disk is given no streaming settings."""
    from training.config import build_config
    from training.data import STREAMING, loader_options
    from training.streaming import CacheSettings

    streamed = build_config(
        {
            "data": {
                "train_dir": "s3://bucket/datasets/x/train/",
                "val_dir": str(tmp_path),
                "cache_dir": "/scratch/shard-cache",
                "cache_gb": 1.5,
                "read_ahead_shards": 3,
                "shuffle_window_shards": 6,
                "num_workers": 0,
            }
        }
    )
    assert loader_options(streamed, world_size=1, on_gpu=False)[STREAMING] == CacheSettings(
        cache_dir="/scratch/shard-cache", max_bytes=1_500_000_000, read_ahead=3, window=6
    )
    plain = build_config({"data": {"train_dir": str(tmp_path), "val_dir": str(tmp_path), "num_workers": 0}})
    assert STREAMING not in loader_options(plain, world_size=1, on_gpu=False)


def test_the_sample_order_is_pinned_so_a_checkpoint_of_an_earlier_version_resumes_on_the_same_order() -> None:
    """A checkpoint records (epoch, step) only: the order behind them must stay the one it was taken with, or
    a resumed job trains on other samples than an uninterrupted one. Pinned for seed 7, epoch 1: the
    ImageFolder's permutation, and the streamed order shard by shard (window 1: each group of 4 is one
    shard's samples) and by windows of two shards."""
    from training.data import BatchPlan

    def order(shards: list[int] | None, window: int = 1) -> list[int]:
        sampler = ResumableBatchSampler(12, BatchPlan(4, 1, 4), rank=0, seed=7)
        if shards is not None:
            sampler.use_shards(shards, window=window, read_ahead=None)
        sampler.set_position(1, 0)
        return list(sampler._order().tolist())

    assert order(None) == [9, 5, 0, 10, 2, 11, 4, 6, 3, 8, 1, 7]
    assert order([4, 4, 4], window=1) == [3, 2, 0, 1, 5, 4, 7, 6, 10, 8, 11, 9]
    assert order([4, 4, 4], window=2) == [7, 0, 1, 4, 5, 6, 3, 2, 8, 10, 9, 11]
    assert order([4, 4, 4], window=0) == order([4, 4, 4], window=1), "a window is at least one shard"


def test_shards_that_do_not_hold_the_datasets_samples_are_refused_naming_both_counts() -> None:
    from training.data import BatchPlan

    sampler = ResumableBatchSampler(12, BatchPlan(4, 1, 4), rank=0, seed=7)
    with pytest.raises(ValueError, match=r"^shards hold 11 samples, the sampler has 12$"):
        sampler.use_shards([4, 4, 3], window=1, read_ahead=None)


def test_a_streamed_val_split_is_evaluated_through_the_configs_cache(
    aws: MotoServer, shards: Path, tmp_path: Path
) -> None:
    """The evaluation loader hands a streamed split the config's cache settings, as the training loader
    does: its shards land in data.cache_dir, not in a folder of its own choosing, and every sample is read."""
    from training.data import EvalDataset, eval_loader

    index = upload(shards).replace("/train/", "/val/")
    dataset = EvalDataset(index, 16)
    settings = CacheSettings(str(tmp_path / "cache"), max_bytes=10**9, read_ahead=1, window=2)
    batches = list(
        eval_loader(dataset, 8, rank=0, world_size=1, options={"num_workers": 0, STREAMING: settings})
    )
    assert sum(len(batch.targets) for batch in batches) == len(dataset)
    cached = sorted(path.name for path in (tmp_path / "cache").glob("*.tar"))
    assert cached and len(cached) == len(dataset.folder.shard_sizes())
