"""Sampling and augmentation are pure functions of (seed, epoch, index): resumable, rank-sliced; hidden
files are never data; undecodable images are named, skipped and counted against data.max_bad_fraction."""

from __future__ import annotations

import errno
import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile
from torchvision import transforms as v1
from torchvision.transforms import v2

import training.data
from tests.training.conftest import Dataset, make_run_factory
from training.config import Config, DataConfig
from training.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    MAX_SUBSTITUTES,
    BatchPlan,
    EvalDataset,
    ResumableBatchSampler,
    Sample,
    SeededImageFolder,
    SkippedFiles,
    collate_samples,
    decode_problem,
    default_num_workers,
    eval_loader,
    eval_transform,
    ignore_interrupt,
    loader_options,
    normalized_tensor,
    sample_seed,
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


def test_skipped_samples_are_never_read(image_folders: Dataset, monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = SeededImageFolder(str(image_folders.train_dir), train_transform(16), seed=0)
    reads: list[str] = []
    original = dataset.folder.loader

    def counting_loader(path: str) -> Any:
        reads.append(path)
        return original(path)

    monkeypatch.setattr(dataset.folder, "loader", counting_loader)
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


def test_a_file_of_only_unreadable_images_leaves_the_slot_empty_naming_each_once(tmp_path: Path) -> None:
    """With nothing readable to stand in, the sample is dropped and each bad file named once."""
    bad = write_bad_images(tmp_path / "cat")
    dataset = SeededImageFolder(str(tmp_path), train_transform(16), seed=0)
    sample = dataset[(0, 1)]
    assert sample.image is None and sample.target == 0
    assert sorted(path for path, _ in sample.unreadable) == sorted(str(p) for p in bad.values())


def test_substitutes_are_bounded_then_the_slot_is_left_empty(tmp_path: Path) -> None:
    """Substitutes are tried MAX_SUBSTITUTES + 1 deep, no further, and the empty batch's error names them."""
    for i in range(MAX_SUBSTITUTES + 1):
        (tmp_path / "cat" / f"{i:02d}.jpg").parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cat" / f"{i:02d}.jpg").write_text("version https://git-lfs.github.com/spec/v1\n")
    _png(tmp_path / "cat" / "zz.png")
    dataset = SeededImageFolder(str(tmp_path), train_transform(16), seed=0)
    sample = dataset[(0, 0)]
    assert sample.image is None
    assert len(sample.unreadable) == MAX_SUBSTITUTES + 1
    # One file later, the readable one is within reach: it stands in.
    substituted = dataset[(0, 1)]
    assert substituted.image is not None and len(substituted.unreadable) == MAX_SUBSTITUTES
    batch = collate_samples([sample])
    assert batch.images.numel() == 0 and batch.targets.dtype == torch.long and len(batch.targets) == 0
    assert batch.unreadable == list(sample.unreadable)
    skipped = SkippedFiles(1.0, {"train": len(dataset)}, {"train": str(tmp_path)})
    skipped.record("train", batch.unreadable, pass_id=0)
    message = str(skipped.no_readable_image("train"))
    assert message.startswith(
        f"data.train_dir: {MAX_SUBSTITUTES + 1} images in {tmp_path} cannot be decoded, "
        f"{MAX_SUBSTITUTES + 1} of them in a row ({tmp_path / 'cat' / '00.jpg'}, "
    )
    assert f"{tmp_path / 'cat' / '04.jpg'}, ...); is the dataset made of images" in message
    assert str(tmp_path / "cat" / "05.jpg") not in message


def test_a_substitute_comes_from_the_start_when_the_end_is_unreadable(tmp_path: Path) -> None:
    """Substitutes wrap around the folder: the last sample unreadable, the first one stands in."""
    _png(tmp_path / "a" / "1.png", 50)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.jpg").write_bytes(b"")
    dataset = SeededImageFolder(str(tmp_path), train_transform(8), seed=0)
    sample = dataset[(0, 1)]
    assert sample.image is not None and sample.target == 0
    assert sample.unreadable == ((str(tmp_path / "b" / "2.jpg"), "empty file (0 bytes)"),)


def test_collating_drops_empty_slots_and_keeps_every_unreadable_path() -> None:
    """A micro-batch keeps its readable samples in order, with their targets, and every path met."""
    image = torch.zeros(3, 4, 4)
    samples = [
        Sample(image + 1, 2, (("/d/x.jpg", "empty"),)),
        Sample(None, 1, (("/d/y.jpg", "bad"), ("/d/z.jpg", "bad"))),
        Sample(image + 3, 0, ()),
    ]
    batch = collate_samples(samples)
    assert batch.images.shape == (2, 3, 4, 4)
    assert torch.equal(batch.images[0], image + 1) and torch.equal(batch.images[1], image + 3)
    assert batch.targets.tolist() == [2, 0] and batch.targets.dtype == torch.long
    assert batch.unreadable == [("/d/x.jpg", "empty"), ("/d/y.jpg", "bad"), ("/d/z.jpg", "bad")]


def test_a_disk_error_is_not_bad_data(tmp_path: Path) -> None:
    """An OSError with an errno (the disk's) or a vanished file is never called bad data."""
    image = _png(tmp_path / "cat" / "1.png")
    assert decode_problem(str(image), OSError(errno.EIO, "Input/output error")) is None
    assert decode_problem(str(tmp_path / "gone.jpg"), OSError("cannot identify image file")) is None
    assert decode_problem(str(image), SyntaxError("broken\nPNG chunk")) == "SyntaxError: broken PNG chunk"
    empty = tmp_path / "cat" / "2.jpg"
    empty.write_bytes(b"")
    assert decode_problem(str(empty), OSError("cannot identify image file")) == "empty file (0 bytes)"


@pytest.mark.parametrize("split", ["train", "val"])
def test_a_disk_error_while_reading_fails_the_read_instead_of_skipping(
    tmp_path: Path, split: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO from the loader reaches the trainer (exit 1, retried elsewhere), never a skipped image."""
    _png(tmp_path / "cat" / "1.png")
    _png(tmp_path / "cat" / "2.png")
    dataset: SeededImageFolder | EvalDataset = (
        SeededImageFolder(str(tmp_path), train_transform(8), seed=0)
        if split == "train"
        else EvalDataset(str(tmp_path), 8)
    )

    def disk_error(path: str) -> Any:
        raise OSError(errno.EIO, "Input/output error", path)

    monkeypatch.setattr(dataset.folder, "loader", disk_error)
    with pytest.raises(OSError) as raised:
        dataset[(0, 0)] if isinstance(dataset, SeededImageFolder) else dataset[0]
    assert raised.value.errno == errno.EIO


def test_a_folder_without_class_folders_is_refused(tmp_path: Path) -> None:
    """Images straight in the split folder (no classes) are an error naming the folder."""
    _png(tmp_path / "1.png")
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder in"):
        SeededImageFolder(str(tmp_path), train_transform(8), seed=0)


def test_classes_are_numbered_in_folder_order(tmp_path: Path) -> None:
    """Each class folder is its target, in sorted order, the same in both splits."""
    for name in ("dog", "cat", "emu"):
        _png(tmp_path / name / "1.png")
    train = SeededImageFolder(str(tmp_path), train_transform(8), seed=0)
    assert train.classes == ["cat", "dog", "emu"]
    assert [target for _, target in train.folder.samples] == [0, 1, 2]
    assert [EvalDataset(str(tmp_path), 8)[i].target for i in range(3)] == [0, 1, 2]


def test_sample_seeds_differ_for_every_seed_epoch_and_index() -> None:
    """No two samples, epochs or runs share an augmentation seed, and each is a valid generator seed."""
    keys = [(seed, epoch, index) for seed in range(4) for epoch in range(4) for index in range(64)]
    seeds = [sample_seed(*key) for key in keys]
    assert len(set(seeds)) == len(keys)
    assert all(isinstance(value, int) and 0 <= value < 2**63 - 1 for value in seeds)
    assert sample_seed(2**40, 2**20, 2**30) < 2**63 - 1


def _gradient(path: Path, size: int = 64) -> Path:
    """An image dark on the left, bright on the right."""
    path.parent.mkdir(parents=True, exist_ok=True)
    row = np.linspace(0, 255, size, dtype=np.uint8)
    Image.fromarray(np.repeat(np.repeat(row[None, :, None], size, axis=0), 3, axis=2)).save(path)
    return path


def test_training_augmentation_crops_at_random_and_mirrors_about_half(tmp_path: Path) -> None:
    """RandomResizedCrop + RandomHorizontalFlip: crops of many sizes, about half the samples mirrored."""
    _gradient(tmp_path / "cat" / "1.png")
    dataset = SeededImageFolder(str(tmp_path), train_transform(16), seed=0)
    images = [dataset[(epoch, 0)].image for epoch in range(200)]
    assert all(image is not None and image.shape == (3, 16, 16) for image in images)
    mirrored = [bool(image[:, :, 0].mean() > image[:, :, -1].mean()) for image in images if image is not None]
    assert 60 < sum(mirrored) < 140
    # Contrast left to right shows the crop's width: a wide range of crop sizes, not one.
    spans = {
        round(float((image[:, :, 0] - image[:, :, -1]).abs().mean()), 1)
        for image in images
        if image is not None
    }
    assert len(spans) > 20


def test_at_224_px_evaluation_is_torchvisions_imagenet_recipe(tmp_path: Path) -> None:
    """Resize the short side to 256, centre-crop 224, to tensor, normalise: the standard evaluation."""
    picture = Image.fromarray(np.random.default_rng(1).integers(0, 255, (300, 400, 3), dtype=np.uint8))
    reference = v1.Compose(
        [v1.Resize(256), v1.CenterCrop(224), v1.ToTensor(), v1.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )
    assert torch.allclose(eval_transform(224)(picture), reference(picture), atol=1e-5)


def test_training_crops_are_resized_bilinearly_without_ringing(tmp_path: Path) -> None:
    """Crops are resized bilinearly as torchvision does: no value outside the source's range."""
    pixels = np.full((64, 64, 3), 64, dtype=np.uint8)
    pixels[:, ::4] = 192
    pixels[::5, :] = 192
    Image.fromarray(pixels).save(tmp_path / "stripes.png")
    (tmp_path / "cat").mkdir()
    (tmp_path / "stripes.png").rename(tmp_path / "cat" / "stripes.png")
    dataset = SeededImageFolder(str(tmp_path), train_transform(16), seed=0)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    for epoch in range(40):
        image = dataset[(epoch, 0)].image
        assert image is not None
        values = (image * std + mean) * 255
        assert values.min() > 64 - 0.5 and values.max() < 192 + 0.5, epoch


def test_evaluation_resizes_and_centre_crops_to_the_image_size(tmp_path: Path) -> None:
    """Validation images: deterministic, image_size square, the centre kept (the border cropped away)."""
    picture = np.zeros((80, 120, 3), dtype=np.uint8)
    picture[:, :10] = 255  # a white band on the left edge only
    picture[35:45, 55:65] = 128  # a grey mark in the centre
    image = Image.fromarray(picture)
    out = eval_transform(32)(image)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    assert torch.equal(out, eval_transform(32)(image))
    white = (1 - torch.tensor(IMAGENET_MEAN)) / torch.tensor(IMAGENET_STD)
    assert not torch.isclose(out, white.view(3, 1, 1).expand_as(out), atol=0.1).all(dim=0).any()
    assert out[:, 16, 16].tolist() != out[:, 2, 2].tolist()


def test_the_sampler_without_shuffling_reads_in_folder_order() -> None:
    """shuffle=False (substitution tests, evaluation order): positions are the folder's order."""
    sampler = ResumableBatchSampler(8, BatchPlan(4, 1, 2), rank=0, seed=5, shuffle=False)
    assert micro_batches(sampler) == [[(0, 0), (0, 1)], [(0, 2), (0, 3)], [(0, 4), (0, 5)], [(0, 6), (0, 7)]]


def test_the_shuffled_order_is_a_permutation_set_by_the_seed_and_the_epoch() -> None:
    """Each epoch visits every kept sample once; the seed and the epoch change the order, nothing else."""
    plan = BatchPlan(8, 1, 4)

    def order(seed: int, epoch: int) -> list[int]:
        sampler = ResumableBatchSampler(32, plan, rank=0, seed=seed)
        sampler.set_position(epoch=epoch, start_step=0)
        keys = [key for batch in micro_batches(sampler) for key in batch]
        assert {e for e, _ in keys} == {epoch}
        return [i for _, i in keys]

    assert sorted(order(1, 0)) == list(range(32))
    assert order(1, 0) == order(1, 0)
    assert len({tuple(order(seed, epoch)) for seed in (0, 1, 2) for epoch in (0, 1, 2)}) == 9


def test_each_rank_reads_its_own_share_of_every_step() -> None:
    """Rank r reads its slice of every step's global batch in micro-batches, from any start step."""
    plan = BatchPlan(global_batch=8, world_size=2, micro_batch=2)
    assert (plan.per_rank, plan.accumulation) == (4, 2)
    rank1 = ResumableBatchSampler(20, plan, rank=1, seed=0, shuffle=False)
    assert rank1.steps_per_epoch == 2
    assert micro_batches(rank1) == [
        [(0, 4), (0, 5)],
        [(0, 6), (0, 7)],
        [(0, 12), (0, 13)],
        [(0, 14), (0, 15)],
    ]
    assert len(rank1) == 4
    rank1.set_position(epoch=3, start_step=1)
    assert micro_batches(rank1) == [[(3, 12), (3, 13)], [(3, 14), (3, 15)]]
    assert len(rank1) == 2


def test_files_met_by_earlier_lives_stay_listed() -> None:
    """Skipped files carried by a checkpoint stay listed next to the next life's own."""
    first = SkippedFiles(1.0, {"train": 100, "val": 10}, {"train": "/t", "val": "/v"})
    first.record("train", [("/t/a.jpg", "empty file (0 bytes)")], pass_id=0)
    first.record("val", [("/v/b.jpg", "truncated")], pass_id=0)
    state = first.to_state()
    first.record("train", [("/t/c.jpg", "x")], pass_id=0)
    assert state == {"train": {"/t/a.jpg": "empty file (0 bytes)"}, "val": {"/v/b.jpg": "truncated"}}
    second = SkippedFiles(1.0, {"train": 100, "val": 10}, {"train": "/t", "val": "/v"})
    second.load_state(None)
    assert second.summary() == {"train": {"count": 0, "paths": []}, "val": {"count": 0, "paths": []}}
    second.record("train", [("/t/d.jpg", "x")], pass_id=0)
    second.load_state(state)
    assert second.summary()["train"] == {"count": 2, "paths": ["/t/a.jpg", "/t/d.jpg"]}
    assert second.summary()["val"] == {"count": 1, "paths": ["/v/b.jpg"]}


def test_each_unreadable_file_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Met again in later batches or epochs, a file is counted per pass but logged once."""
    skipped = SkippedFiles(1.0, {"train": 100}, {"train": "/t"})
    with caplog.at_level("WARNING", logger="training"):
        for pass_id in (0, 0, 1):
            skipped.record("train", [("/t/a.jpg", "empty file (0 bytes)")], pass_id=pass_id)
    assert caplog.messages == ["skipped unreadable image /t/a.jpg: empty file (0 bytes)"]
    assert skipped.pass_count("train") == 1 and skipped.pass_count("val") == 0


def test_the_error_names_files_of_earlier_passes_when_this_one_met_none_here() -> None:
    """Counted by other ranks only, the threshold error still names the files this process ever met."""
    skipped = SkippedFiles(0.0, {"val": 10}, {"val": "/v"})
    skipped.record("val", [("/v/a.jpg", "x")], pass_id=0)
    skipped.record("val", [], pass_id=1)
    with pytest.raises(BadDataError) as error:
        skipped.check("val", 2)
    message = str(error.value)
    assert message.startswith("data.val_dir: 2 of the 10 images in /v cannot be decoded (found so far)")
    assert message.endswith(
        ": /v/a.jpg; replace or delete them (then `trainstack data push`), or raise data.max_bad_fraction"
    )
    skipped.check("val", 0)


def test_the_error_names_this_passs_files_not_earlier_ones() -> None:
    """Over the threshold in epoch 1, the line names what epoch 1 met, not what epoch 0 did."""
    skipped = SkippedFiles(0.0, {"train": 10}, {"train": "/t"})
    skipped.record("train", [("/t/old.jpg", "x")], pass_id=0)
    skipped.record("train", [("/t/new.jpg", "x")], pass_id=1)
    with pytest.raises(BadDataError) as error:
        skipped.check("train", 1)
    assert ": /t/new.jpg; replace" in str(error.value) and "/t/old.jpg" not in str(error.value)


def test_a_split_this_process_never_met_a_bad_file_in_still_gets_its_error_line() -> None:
    """With nothing recorded here for a split, its errors are still one line each."""
    fresh = SkippedFiles(0.0, {"train": 10, "val": 10}, {"train": "/t", "val": "/v"})
    with pytest.raises(BadDataError) as error:
        fresh.check("val", 2)
    assert str(error.value).startswith("data.val_dir: 2 of the 10 images in /v cannot be decoded")
    assert str(fresh.no_readable_image("val")).startswith("data.val_dir: 0 images in /v cannot be decoded")
    earlier = SkippedFiles(0.0, {"train": 10}, {"train": "/t"})
    earlier.load_state({"train": {"/t/a.jpg": "empty file (0 bytes)"}})
    with pytest.raises(BadDataError) as error:
        earlier.check("train", 1)
    assert ": /t/a.jpg; replace" in str(error.value)


def test_exactly_the_named_count_adds_no_more() -> None:
    """Five files are all named: no "and 0 more"."""
    skipped = SkippedFiles(0.0, {"train": 100}, {"train": "/t"})
    skipped.record("train", [(f"/t/{i}.jpg", "x") for i in range(5)], pass_id=0)
    with pytest.raises(BadDataError) as error:
        skipped.check("train", 5)
    assert "/t/0.jpg, /t/1.jpg, /t/2.jpg, /t/3.jpg, /t/4.jpg; replace" in str(error.value)
    assert "more" not in str(error.value)


def test_a_dataset_inside_a_hidden_folder_is_still_read(tmp_path: Path) -> None:
    """Only hidden names inside the split count: a dataset under ~/.cache is data."""
    root = tmp_path / ".cache" / "train"
    _png(root / "cat" / "1.png")
    _png(root / "cat" / ".thumbs" / "2.png")
    train = SeededImageFolder(str(root), train_transform(8), seed=0)
    assert [Path(path).name for path, _ in train.folder.samples] == ["1.png"]
    assert len(EvalDataset(str(root), 8)) == 1


def test_workers_ignore_ctrl_c_and_leave_the_stop_to_the_main_process() -> None:
    """A DataLoader worker ignores SIGINT (the whole process group gets it); the trainer stops at a step."""
    previous = signal.getsignal(signal.SIGINT)
    try:
        ignore_interrupt(3)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize(
    ("cpus", "world_size", "on_gpu", "workers"),
    [
        (16, 1, False, 2),
        (7, 1, False, 0),
        (16, 1, True, 8),
        (16, 2, True, 7),
        (7, 2, True, 2),
        (4, 2, True, 1),
        (2, 4, True, 1),
    ],
)
def test_auto_workers_feed_a_gpu_with_spare_cores_and_leave_a_cpu_its_cores(
    cpus: int, world_size: int, on_gpu: bool, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU: every core but one of this rank's share, 1 to 8; on a CPU: an eighth of the cores."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(cpus)))
    chosen = default_num_workers(world_size, on_gpu)
    assert chosen == workers and isinstance(chosen, int)


def test_without_a_cpu_affinity_the_cpu_count_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the OS has no affinity call (macOS), the core count decides; an unknown count is one core."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert default_num_workers(1, on_gpu=True) == 8
    assert default_num_workers(1, on_gpu=False) == 2
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert default_num_workers(1, on_gpu=True) == 1
    assert default_num_workers(1, on_gpu=False) == 0


def test_loader_options_follow_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers, pinning, Ctrl-C handling, persistence and prefetch follow the config."""
    monkeypatch.setattr(
        training.data, "default_num_workers", lambda world, gpu: 3 if (world, gpu) == (2, True) else 0
    )
    config = Config(data=DataConfig(num_workers="auto", prefetch_factor=6))
    assert loader_options(config, world_size=2, on_gpu=True) == {
        "num_workers": 3,
        "pin_memory": True,
        "worker_init_fn": ignore_interrupt,
        "persistent_workers": True,
        "prefetch_factor": 6,
    }
    config = Config(data=DataConfig(num_workers=0, prefetch_factor=6))
    assert loader_options(config, world_size=2, on_gpu=False) == {"num_workers": 0, "pin_memory": False}
    config = Config(data=DataConfig(num_workers=1))
    assert loader_options(config, world_size=2, on_gpu=False) == {
        "num_workers": 1,
        "pin_memory": False,
        "worker_init_fn": ignore_interrupt,
        "persistent_workers": True,
        "prefetch_factor": DataConfig().prefetch_factor,
    }


def test_grey_and_transparent_images_are_read_as_rgb(tmp_path: Path) -> None:
    """A greyscale or RGBA file is converted to three channels, for training and evaluation alike."""
    (tmp_path / "cat").mkdir()
    Image.fromarray(np.full((20, 20), 90, dtype=np.uint8)).save(tmp_path / "cat" / "grey.png")
    Image.fromarray(np.full((20, 20, 4), 90, dtype=np.uint8)).save(tmp_path / "cat" / "rgba.png")
    train = SeededImageFolder(str(tmp_path), train_transform(8), seed=0)
    val = EvalDataset(str(tmp_path), 8)
    for index in range(2):
        image = train[(0, index)].image
        assert image is not None and image.shape == (3, 8, 8)
        evaluated = val[index].image
        assert evaluated is not None and evaluated.shape == (3, 8, 8)


def test_the_training_loader_runs_with_the_options_chosen(image_folders: Dataset) -> None:
    """Workers, pinned memory and prefetch reach the training DataLoader as loader_options chose them."""
    dataset = SeededImageFolder(str(image_folders.train_dir), train_transform(16), seed=0)
    sampler = ResumableBatchSampler(len(dataset), BatchPlan(16, 1, 8), rank=0, seed=0)
    options = {"num_workers": 2, "pin_memory": False, "persistent_workers": True, "prefetch_factor": 3}
    loader = train_loader(dataset, sampler, options)
    assert (loader.num_workers, loader.persistent_workers, loader.prefetch_factor) == (2, True, 3)
    assert loader.batch_sampler is sampler


def test_each_rank_evaluates_its_own_shard_once(tmp_path: Path) -> None:
    """Each rank evaluates every world_size-th image once, in order, without persistent workers."""
    for i in range(5):
        _png(tmp_path / "cat" / f"{i}.png", 40 * i)
    dataset = EvalDataset(str(tmp_path), 8)
    seen = []
    for rank in (0, 1):
        loader = eval_loader(dataset, 2, rank=rank, world_size=2, options={"num_workers": 0})
        assert loader.batch_size == 2
        seen.append([len(batch.targets) for batch in loader])
    assert seen == [[2, 1], [2]]
    whole = eval_loader(dataset, 8, rank=0, world_size=1, options={"num_workers": 0})
    (batch,) = list(whole)
    first = EvalDataset(str(tmp_path), 8)[0].image
    assert first is not None and torch.equal(batch.images[0], first)
    workers = eval_loader(
        dataset, 2, 0, 1, {"num_workers": 1, "persistent_workers": True, "prefetch_factor": 2}
    )
    assert workers.num_workers == 1 and not workers.persistent_workers


# -- streamed splits (shards): the read-ahead's schedule, a bad shard sample, the evaluation's cache --------


class RecordingReadAhead:
    """Stands in for ReadAhead (no thread, no cache): what the sampler tells it, in order."""

    def __init__(self) -> None:
        self.plans: list[list[int]] = []
        self.advances: list[int] = []

    def plan(self, shards: list[int]) -> None:
        self.plans.append(list(shards))

    def advance(self, position: int) -> None:
        self.advances.append(position)


def test_the_read_ahead_is_told_each_upcoming_samples_shard_and_each_handed_out_position() -> None:
    """The read-ahead fetches in the order the sampler reads: one plan per epoch holding the shard of every
    sample still to come (from the resumed step on), then, before each micro-batch is handed out, how many
    samples came before it. A wrong plan or position still yields the right samples, only late."""
    plan = BatchPlan(global_batch=4, world_size=1, micro_batch=2)
    sizes = [4, 4, 4]
    sampler = ResumableBatchSampler(12, plan, rank=0, seed=7)
    recorder = RecordingReadAhead()
    sampler.use_shards(sizes, window=1, read_ahead=recorder)  # type: ignore[arg-type]
    sampler.set_position(epoch=1, start_step=1)
    shard_of = [shard for shard, size in enumerate(sizes) for _ in range(size)]

    handed: list[list[tuple[int, int]]] = []
    for batch in sampler:
        # Told before the batch is handed out, not after: the fetch of its shard may already be due.
        assert recorder.advances[-1] == len(handed) * plan.micro_batch
        handed.append(batch)

    assert len(handed) == 4  # steps 1 and 2 of 3, two micro-batches each
    assert recorder.plans == [[shard_of[i] for batch in handed for _, i in batch]]
    assert recorder.advances == [0, 2, 4, 6]
    assert all(type(position) is int for position in recorder.advances)


@pytest.fixture()
def shard_splits(tmp_path: Path) -> Path:
    """A local ImageFolder pushed as shards (`out/train`, `out/val`): val/cat holds an image, a file that is
    not one and an empty one."""
    from trainstack.datapush import write_shards

    root = tmp_path / "images"
    for split in ("train", "val"):
        _png(root / split / "cat" / "1.png", 10)
        _png(root / split / "dog" / "1.png", 200)
    (root / "val" / "cat" / "2.png").write_bytes(b"not a png")
    (root / "val" / "cat" / "3.png").write_bytes(b"")
    write_shards(root, tmp_path / "shards", ["cat", "dog"], 1_000)
    return tmp_path / "shards"


def test_a_bad_validation_image_in_a_shard_is_named_by_shard_and_name_and_dropped(shard_splits: Path) -> None:
    """A bad image read from a shard is reported as one from a folder is: its name (the shard and the image),
    why, and its class; an empty one reads "empty file (0 bytes)" as it does from disk."""
    dataset = EvalDataset(str(shard_splits / "val"), 16)
    names = [name for name, _ in dataset.folder.samples]
    bad = names.index(next(n for n in names if n.endswith(":cat/2.png")))
    empty = names.index(next(n for n in names if n.endswith(":cat/3.png")))

    sample = dataset[bad]

    assert sample.image is None and sample.target == 0  # cat
    ((name, problem),) = sample.unreadable
    assert name.startswith(f"{shard_splits / 'val'}/shard-") and name.endswith(".tar:cat/2.png")
    assert problem.startswith("UnidentifiedImageError: cannot identify image file")
    assert dataset[empty].unreadable == ((names[empty], "empty file (0 bytes)"),)
    (batch,) = list(eval_loader(dataset, 8, rank=0, world_size=1, options={"num_workers": 0}))
    assert batch.targets.tolist() == [0, 1]
    assert sorted(path for path, _ in batch.unreadable) == sorted([names[bad], names[empty]])


def test_the_evaluation_loader_gives_a_streamed_split_the_settings_it_is_handed_or_the_defaults(
    shard_splits: Path,
) -> None:
    """The evaluation loader caches where the config says (STREAMING's settings), never passes them on to
    the DataLoader as an argument, and falls back to the defaults when none are given."""
    from training.data import STREAMING
    from training.streaming import CacheSettings, ShardFolder

    dataset = EvalDataset(str(shard_splits / "val"), 16)
    assert isinstance(dataset.folder, ShardFolder)
    settings = CacheSettings("/scratch/shard-cache", max_bytes=10**9, read_ahead=1, window=3)
    handed = {"num_workers": 0, STREAMING: settings}

    loader = eval_loader(dataset, 8, rank=0, world_size=1, options=handed)

    assert dataset.folder.cache.settings is settings
    assert STREAMING in handed  # the caller's options are not changed
    assert sum(len(batch.targets) for batch in loader) == 2
    eval_loader(dataset, 8, rank=0, world_size=1, options={"num_workers": 0})
    assert dataset.folder.cache.settings == CacheSettings()


def test_a_split_streamed_from_local_shards_gets_the_shard_order_and_no_read_ahead(
    shard_splits: Path,
) -> None:
    """Shards on the local disk need no fetching: the sampler orders by shard, no read-ahead thread runs."""
    dataset = SeededImageFolder(str(shard_splits / "train"), train_transform(16), seed=0)
    sampler = ResumableBatchSampler(len(dataset), BatchPlan(2, 1, 2), rank=0, seed=0)

    batches = list(train_loader(dataset, sampler, {"num_workers": 0}))

    assert sampler.shard_sizes == dataset.folder.shard_sizes() and sampler.read_ahead is None
    assert [len(batch.targets) for batch in batches] == [2]


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
