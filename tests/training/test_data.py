"""Sampling and augmentation are pure functions of (seed, epoch, index): resumable, rank-sliced; hidden
files are never data; undecodable images are named, skipped and counted against data.max_bad_fraction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from torchvision.transforms import v2

from tests.training.conftest import Dataset, make_run_factory
from training.config import Config, DataConfig
from training.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchPlan,
    EvalDataset,
    ResumableBatchSampler,
    SeededImageFolder,
    SkippedFiles,
    eval_loader,
    normalized_tensor,
    train_loader,
    train_transform,
)
from training.dataset_layout import BadDataError, data_dir_problems, is_hidden
from training.sample_data import write_dataset


def micro_batches(sampler: ResumableBatchSampler) -> list[list[tuple[int, int]]]:
    return list(iter(sampler))


def test_resuming_mid_epoch_yields_exactly_the_remaining_micro_batches() -> None:
    plan = BatchPlan(global_batch=8, world_size=1, micro_batch=4)
    full = ResumableBatchSampler(50, plan, rank=0, seed=3)
    full.set_position(epoch=2, start_step=0)
    resumed = ResumableBatchSampler(50, plan, rank=0, seed=3)
    resumed.set_position(epoch=2, start_step=4)
    assert micro_batches(resumed) == micro_batches(full)[4 * plan.accumulation :]
    assert len(resumed) == (50 // 8 - 4) * 2


def test_skipped_samples_are_never_read(image_folders: Dataset) -> None:
    dataset = SeededImageFolder(str(image_folders.train_dir), train_transform(16), seed=0)
    reads: list[str] = []
    original = dataset.folder.loader

    def counting_loader(path: str) -> Any:
        reads.append(path)
        return original(path)

    dataset.folder.loader = counting_loader
    sampler = ResumableBatchSampler(len(dataset), BatchPlan(16, 1, 8), rank=0, seed=0)
    sampler.set_position(epoch=0, start_step=6)
    loader = train_loader(dataset, sampler, {"num_workers": 0})
    assert sum(len(batch.images) for batch in loader) == 2 * 16
    assert len(reads) == 2 * 16


def test_ranks_split_each_global_batch_like_one_process_with_accumulation() -> None:
    one = ResumableBatchSampler(64, BatchPlan(16, world_size=1, micro_batch=8), rank=0, seed=1)
    ranks = [
        ResumableBatchSampler(64, BatchPlan(16, world_size=2, micro_batch=8), rank=r, seed=1) for r in (0, 1)
    ]
    single = micro_batches(one)
    rank0, rank1 = (micro_batches(r) for r in ranks)
    assert single[0::2] == rank0 and single[1::2] == rank1


def test_epochs_have_different_orders_and_drop_the_partial_batch() -> None:
    sampler = ResumableBatchSampler(20, BatchPlan(8, 1, 8), rank=0, seed=0)
    first = micro_batches(sampler)
    sampler.set_position(epoch=1, start_step=0)
    second = micro_batches(sampler)
    assert len(first) == len(second) == 2
    assert [i for _, i in first[0]] != [i for _, i in second[0]]


def test_augmentation_depends_on_the_sample_not_on_order_or_global_rng(image_folders: Dataset) -> None:
    dataset = SeededImageFolder(str(image_folders.train_dir), train_transform(24), seed=7)
    torch.manual_seed(1)
    a = dataset[(3, 10)].image
    for key in [(3, 11), (0, 10), (4, 10)]:
        dataset[key]
    torch.manual_seed(999)
    b = dataset[(3, 10)].image
    c = dataset[(4, 10)].image
    assert a is not None and b is not None and c is not None
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # a new epoch draws new augmentation for the same image
    before = torch.get_rng_state()
    dataset[(5, 5)]
    assert torch.equal(before, torch.get_rng_state())  # the caller's generator is untouched


def test_train_augment_matches_torchvision_conversion_and_normalisation(image_folders: Dataset) -> None:
    dataset = SeededImageFolder(str(image_folders.train_dir), train_transform(24), seed=0)
    image = dataset[(0, 0)].image
    assert image is not None
    assert image.shape == (3, 24, 24) and image.dtype == torch.float32 and image.is_contiguous()
    picture = dataset.folder.loader(dataset.folder.samples[0][0])
    reference = v2.Compose(
        [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )(picture)
    assert torch.allclose(normalized_tensor(picture), reference, atol=1e-5)


# -- hidden files ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "hidden"),
    [
        ("train/cat/1.jpg", False),
        ("train/.ipynb_checkpoints/1.jpg", True),
        ("train/cat/._1.jpg", True),
        ("__MACOSX/train/cat/1.jpg", True),
        (".DS_Store", True),
        ("./train/cat/1.jpg", False),
        ("train/cat.v2/1.jpg", False),
    ],
)
def test_a_path_is_hidden_when_any_component_is(path: str, hidden: bool) -> None:
    assert is_hidden(path) is hidden
    assert is_hidden(Path(path)) is hidden


def _png(path: Path, value: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((20, 20, 3), value, dtype=np.uint8)).save(path)
    return path


def test_hidden_folders_are_not_classes_and_hidden_files_not_images(tmp_path: Path) -> None:
    for split in ("train", "val"):
        for name in ("cat", "dog"):
            _png(tmp_path / split / name / "1.png")
        _png(tmp_path / split / ".ipynb_checkpoints" / "1.png")
        _png(tmp_path / split / "__MACOSX" / "cat" / "2.png")
        (tmp_path / split / "cat" / "._1.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
        _png(tmp_path / split / "dog" / ".thumbs" / "1.png")
    train = SeededImageFolder(str(tmp_path / "train"), train_transform(16), seed=0)
    val = EvalDataset(str(tmp_path / "val"), 16)
    assert train.classes == ["cat", "dog"]
    assert [Path(p).relative_to(tmp_path).as_posix() for p, _ in train.folder.samples] == [
        "train/cat/1.png",
        "train/dog/1.png",
    ]
    assert len(val) == 2
    config = Config(data=DataConfig(train_dir=str(tmp_path / "train"), val_dir=str(tmp_path / "val")))
    assert data_dir_problems(config) == []


def test_a_class_folder_holding_only_hidden_files_is_reported_empty(tmp_path: Path) -> None:
    for split in ("train", "val"):
        _png(tmp_path / split / "cat" / "1.png")
        _png(tmp_path / split / "dog" / ".ipynb_checkpoints" / "1.png")
    config = Config(data=DataConfig(train_dir=str(tmp_path / "train"), val_dir=str(tmp_path / "val")))
    assert data_dir_problems(config) == [
        f"data.train_dir: class folders without images in {tmp_path / 'train'}: dog",
        f"data.val_dir: class folders without images in {tmp_path / 'val'}: dog",
    ]


# -- undecodable images -----------------------------------------------------------------------------------


def write_bad_images(folder: Path) -> dict[str, Path]:
    """A truncated JPEG (a valid one cut in half), a zero-byte .jpg and a text file named .jpg."""
    folder.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(0).integers(0, 255, (48, 48, 3), dtype=np.uint8)
    whole = folder / "whole.jpg"
    Image.fromarray(pixels).save(whole, quality=95)
    data = whole.read_bytes()
    whole.unlink()
    bad = {
        "truncated": folder / "truncated.jpg",
        "empty": folder / "empty.jpg",
        "text": folder / "pointer.jpg",
    }
    bad["truncated"].write_bytes(data[: len(data) // 2])
    bad["empty"].write_bytes(b"")
    bad["text"].write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0\n")
    return bad


def test_truncated_images_are_never_padded() -> None:
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_unreadable_training_images_are_named_and_replaced_by_the_next_readable(tmp_path: Path) -> None:
    _png(tmp_path / "cat" / "a.png", 10)
    _png(tmp_path / "cat" / "z.png", 20)
    bad = write_bad_images(tmp_path / "cat")  # empty.jpg, pointer.jpg, truncated.jpg sort between a and z
    dataset = SeededImageFolder(str(tmp_path), train_transform(16), seed=0)
    sampler = ResumableBatchSampler(len(dataset), BatchPlan(5, 1, 5), rank=0, seed=0, shuffle=False)
    # A worker process: the paths must cross the process boundary with the batch.
    batches = list(train_loader(dataset, sampler, {"num_workers": 1}))
    assert len(batches) == 1
    batch = batches[0]
    assert batch.images.shape == (5, 3, 16, 16)  # the micro-batch keeps its size
    reasons = dict((path, why) for path, why in batch.unreadable)
    assert set(reasons) == {str(p) for p in bad.values()}
    assert reasons[str(bad["empty"])] == "empty file (0 bytes)"
    assert "truncated" in reasons[str(bad["truncated"])]
    assert "cannot identify image file" in reasons[str(bad["text"])]


def test_unreadable_validation_images_are_dropped_and_named(tmp_path: Path) -> None:
    _png(tmp_path / "cat" / "a.png")
    bad = write_bad_images(tmp_path / "cat")
    loader = eval_loader(EvalDataset(str(tmp_path), 16), 8, rank=0, world_size=1, options={"num_workers": 0})
    (batch,) = list(loader)
    assert len(batch.targets) == 1 and batch.images.shape == (1, 3, 16, 16)
    assert sorted(path for path, _ in batch.unreadable) == sorted(str(p) for p in bad.values())


def test_the_threshold_is_a_fraction_of_the_split_and_its_error_names_the_files() -> None:
    skipped = SkippedFiles(0.01, {"train": 300, "val": 50}, {"train": "/d/train", "val": "/d/val"})
    skipped.record("train", [("/d/train/a/1.jpg", "empty file (0 bytes)")], pass_id=0)
    skipped.record("train", [("/d/train/a/2.jpg", "truncated"), ("/d/train/a/3.jpg", "x")], pass_id=0)
    skipped.check("train", 3)  # 3 of 300 is exactly 1%: tolerated
    skipped.record("train", [("/d/train/b/4.jpg", "x")], pass_id=0)
    with pytest.raises(BadDataError) as error:
        skipped.check("train", skipped.pass_count("train"))
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("data.train_dir: 4 of the 300 images in /d/train cannot be decoded")
    assert "/d/train/a/1.jpg, /d/train/a/2.jpg, /d/train/a/3.jpg, /d/train/b/4.jpg" in message
    assert "data.max_bad_fraction=0.01" in message
    # A new epoch counts its own pass; the report keeps every file ever met.
    skipped.record("train", [("/d/train/a/1.jpg", "empty file (0 bytes)")], pass_id=1)
    assert skipped.pass_count("train") == 1
    assert skipped.summary() == {
        "train": {
            "count": 4,
            "paths": ["/d/train/a/1.jpg", "/d/train/a/2.jpg", "/d/train/a/3.jpg", "/d/train/b/4.jpg"],
        },
        "val": {"count": 0, "paths": []},
    }


def test_the_error_lists_the_first_files_and_the_count_of_the_rest() -> None:
    skipped = SkippedFiles(0.0, {"train": 1000}, {"train": "/d/train"})
    skipped.record("train", [(f"/d/train/c/{i:02d}.jpg", "x") for i in range(12)], pass_id=0)
    with pytest.raises(BadDataError, match=r"/d/train/c/04.jpg and 7 more; "):
        skipped.check("train", 12)


def test_metrics_lists_at_most_100_paths_but_counts_all() -> None:
    skipped = SkippedFiles(1.0, {"val": 1000}, {"val": "/d/val"})
    skipped.record("val", [(f"/d/val/c/{i:03d}.jpg", "x") for i in range(150)], pass_id=0)
    assert skipped.summary()["val"]["count"] == 150
    assert len(skipped.summary()["val"]["paths"]) == 100


# -- a real trainer on a dataset with bad images ------------------------------------------------------------


@pytest.fixture(scope="module")
def damaged_folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Dataset, list[Path], list[Path]]:
    """32 good training images + 3 bad ones, 8 good validation images + 3 bad ones, hidden folders beside."""
    root = tmp_path_factory.mktemp("damaged")
    train, val = write_dataset(root, classes=2, train_per_class=16, val_per_class=4, size=32)
    bad_train = list(write_bad_images(train / "class_0").values())
    bad_val = list(write_bad_images(val / "class_1").values())
    _png(train / ".ipynb_checkpoints" / "1.png")
    return Dataset(train, val), bad_train, bad_val


def test_training_completes_past_bad_images_and_metrics_lists_them(
    tmp_path: Path, damaged_folders: tuple[Dataset, list[Path], list[Path]]
) -> None:
    dataset, bad_train, bad_val = damaged_folders
    run = make_run_factory(tmp_path, dataset)("data.max_bad_fraction=0.3", "train.epochs=1")
    code, output = run.life()
    assert code == 0, output
    metrics = json.loads((run.output / "metrics.json").read_text())
    assert metrics["classes"] == ["class_0", "class_1"]  # .ipynb_checkpoints is not a class
    assert metrics["skipped_files"]["val"] == {"count": 3, "paths": sorted(str(p) for p in bad_val)}
    assert metrics["skipped_files"]["train"] == {"count": 3, "paths": sorted(str(p) for p in bad_train)}
    for path in bad_train + bad_val:
        assert f"skipped unreadable image {path}" in output
    assert "skipped unreadable images: train 3, val 3; listed in metrics.json" in output


def test_too_many_bad_images_stop_the_job_with_exit_65_naming_them(
    tmp_path: Path, damaged_folders: tuple[Dataset, list[Path], list[Path]]
) -> None:
    dataset, bad_train, _ = damaged_folders
    run = make_run_factory(tmp_path, dataset)("train.epochs=1")  # default data.max_bad_fraction=0.01
    code, output = run.life()
    assert code == 65, output
    (line,) = [line for line in output.splitlines() if line.startswith("data error: ")]
    assert line.startswith("data error: data.train_dir: ")
    assert f"of the 35 images in {dataset.train_dir} cannot be decoded (found so far)" in line
    assert any(str(path) in line for path in bad_train)
    assert "Traceback" not in output
    assert not (run.output / "metrics.json").exists()
