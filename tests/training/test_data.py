"""Sampling and augmentation are pure functions of (seed, epoch, index): resumable, rank-sliced."""

from __future__ import annotations

from typing import Any

import torch
from torchvision.transforms import v2

from tests.training.conftest import Dataset
from training.data import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchPlan,
    ResumableBatchSampler,
    SeededImageFolder,
    normalized_tensor,
    train_transform,
)


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
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    assert sum(len(images) for images, _ in loader) == 2 * 16
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
    a, _ = dataset[(3, 10)]
    for key in [(3, 11), (0, 10), (4, 10)]:
        dataset[key]
    torch.manual_seed(999)
    b, _ = dataset[(3, 10)]
    c, _ = dataset[(4, 10)]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # a new epoch draws new augmentation for the same image
    before = torch.get_rng_state()
    dataset[(5, 5)]
    assert torch.equal(before, torch.get_rng_state())  # the caller's generator is untouched


def test_train_augment_matches_torchvision_conversion_and_normalisation(image_folders: Dataset) -> None:
    dataset = SeededImageFolder(str(image_folders.train_dir), train_transform(24), seed=0)
    image, _ = dataset[(0, 0)]
    assert image.shape == (3, 24, 24) and image.dtype == torch.float32 and image.is_contiguous()
    picture = dataset.folder.loader(dataset.folder.samples[0][0])
    reference = v2.Compose(
        [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )(picture)
    assert torch.allclose(normalized_tensor(picture), reference, atol=1e-5)
