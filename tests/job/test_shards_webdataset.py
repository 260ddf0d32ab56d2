"""A dataset pushed as shards (`trainstack data push --format shards`) is webdataset's layout: a job of your
own reads it with `webdataset` as docs/job-contract.md shows, through the same `pipe:` URLs, and gets every
sample with its label, as `trainstack_job.shards` reads them."""

from __future__ import annotations

from pathlib import Path

from tests.tools import require_module
from training.sample_data import write_dataset
from trainstack.datapush import write_shards
from trainstack_job.shards import INDEX_NAME, ShardIndex, iter_shard


def test_pushed_shards_read_by_webdataset_give_every_sample_and_label(tmp_path: Path) -> None:
    require_module("webdataset", "the shards' webdataset layout, read as a job of your own would")
    import webdataset as wds

    write_dataset(tmp_path / "images", classes=3, train_per_class=6, val_per_class=2, size=16)
    classes = sorted(p.name for p in (tmp_path / "images" / "train").iterdir())
    write_shards(tmp_path / "images", tmp_path / "shards", classes, 4_000)  # several shards a split
    index = ShardIndex.from_json((tmp_path / "shards" / "train" / INDEX_NAME).read_bytes(), "train")
    assert len(index.shards) > 1
    paths = [tmp_path / "shards" / "train" / shard.key for shard in index.shards]
    expected = [(image, label) for path in paths for _, image, label in iter_shard(path)]
    assert len(expected) == 3 * 6

    # The documentation's URLs, with `cat` standing in for `aws s3 cp ... -` (no AWS here).
    urls = [f"pipe:cat {path}" for path in paths]
    dataset = wds.WebDataset(urls, shardshuffle=False).to_tuple("jpg;png;jpeg", "cls")
    read = [(bytes(image), int(label)) for image, label in dataset]
    assert read == expected
    assert sorted({label for _, label in read}) == [0, 1, 2]
