"""ImageFolder data with per-sample seeded augmentation, a sampler that resumes mid-epoch, and the
undecodable images of a split named, skipped and counted against `data.max_bad_fraction`. A split given as
shards (data.train_dir / data.val_dir naming a shard index: training/streaming.py) is streamed from S3
through a local cache instead of read from a synced folder, with the same keys, order guarantees and
skipping."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import datasets
from torchvision import transforms as v1
from torchvision.transforms import v2

from training.config import Config
from training.dataset_layout import BadDataError, class_folders, is_hidden
from training.streaming import CacheSettings, ReadAhead, ShardFolder, index_location

log = logging.getLogger("training")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# A key the sampler hands the dataset: (epoch, sample index). Carrying the epoch with each index keeps
# augmentation a pure function of (seed, epoch, index) even with persistent workers.
SampleKey = tuple[int, int]


# PIL's ImageFile.LOAD_TRUNCATED_IMAGES stays False on purpose: a truncated file must be reported and
# skipped, not silently padded with grey and trained on.
# Substitutes tried for one unreadable training image before its slot is left empty: bounded so a dataset of
# non-images (git-lfs pointers named .jpg) fails at the threshold check instead of one worker reading it all.
MAX_SUBSTITUTES = 16
# How many paths of each split metrics.json lists (the count is always complete).
REPORTED_PATHS = 100
# What the error line names before "and N more".
NAMED_IN_ERROR = 5

# (path, why) of an image that could not be decoded.
Unreadable = tuple[str, str]


def _read_rgb(path: str) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGB")


def decode_problem(path: str, error: Exception) -> str | None:
    """Why `path` is not a usable image, or None when `error` is not the file's fault.

    PIL's decode errors (UnidentifiedImageError, "image file is truncated") are OSErrors without an errno;
    an OSError with one (EIO, EACCES) is the instance's disk or permissions, not the dataset, and must fail
    the life (exit 1, retried) rather than be counted as bad data (exit 65, never retried).
    """
    if isinstance(error, OSError) and error.errno is not None:
        return None
    try:
        if Path(path).stat().st_size == 0:
            return "empty file (0 bytes)"
    except OSError:
        return None
    return f"{type(error).__name__}: {error}".replace("\n", " ")


# Everything PIL raises for a file that is not a decodable image (SyntaxError/ValueError: broken chunks in
# some plugins; DecompressionBombError: a declared size over PIL's pixel limit).
DECODE_ERRORS = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)


class Sample(NamedTuple):
    """One loaded sample. `image` is None when no readable image could stand in for it (it is dropped)."""

    image: torch.Tensor | None
    target: int
    unreadable: tuple[Unreadable, ...]


class Batch(NamedTuple):
    """A collated micro-batch plus the unreadable files met while loading it (workers are other processes:
    the paths travel with the batch to the main process, which counts them)."""

    images: torch.Tensor
    targets: torch.Tensor
    unreadable: list[Unreadable]


def collate_samples(samples: Sequence[Sample]) -> Batch:
    kept = [s for s in samples if s.image is not None]
    unreadable = [entry for s in samples for entry in s.unreadable]
    if not kept:
        return Batch(torch.empty(0), torch.empty(0, dtype=torch.long), unreadable)
    # default_collate: in a worker it stacks straight into shared memory, saving a copy per batch.
    images = torch.utils.data.default_collate([s.image for s in kept])
    targets = torch.tensor([s.target for s in kept], dtype=torch.long)
    return Batch(images, targets, unreadable)


class VisibleImageFolder(datasets.ImageFolder):
    """ImageFolder without hidden files and folders: `.ipynb_checkpoints` is not a class, `._x.jpg`
    (macOS AppleDouble) and anything under `__MACOSX` are not images."""

    def __init__(self, root: str, **kwargs: Any) -> None:
        def visible_image(path: str) -> bool:
            return datasets.folder.has_file_allowed_extension(
                path, datasets.folder.IMG_EXTENSIONS
            ) and not is_hidden(os.path.relpath(path, root))

        super().__init__(root, loader=_read_rgb, is_valid_file=visible_image, **kwargs)

    def find_classes(self, directory: str | os.PathLike[str]) -> tuple[list[str], dict[str, int]]:
        classes = class_folders(Path(directory))
        if not classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
        return classes, {name: i for i, name in enumerate(classes)}


class TrainAugment:
    """RandomResizedCrop(size) + RandomHorizontalFlip() + ToTensor + Normalize, the ImageNet recipe, done
    directly on the PIL image: crop and resize in one Pillow call (its SIMD resize beats the tensor kernel
    on CPU), then one conversion to a normalised float tensor. Same distribution as the torchvision
    transforms (crop parameters come from torchvision's own `get_params`), without their per-op
    dispatch: 0.21 -> 0.12 ms a 64 px sample on the bench machine. Draws from torch's global CPU
    generator, which SeededImageFolder seeds per sample."""

    scale = (0.08, 1.0)
    ratio = (3 / 4, 4 / 3)

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size

    def __call__(self, image: Image.Image) -> torch.Tensor:
        top, left, height, width = v1.RandomResizedCrop.get_params(image, list(self.scale), list(self.ratio))
        image = image.resize(
            (self.image_size, self.image_size),
            Image.Resampling.BILINEAR,
            box=(left, top, left + width, top + height),
        )
        if torch.rand(1).item() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return normalized_tensor(image)


_SCALE = 1 / (255 * torch.tensor(IMAGENET_STD).view(3, 1, 1))
_SHIFT = torch.tensor(IMAGENET_MEAN).view(3, 1, 1) / torch.tensor(IMAGENET_STD).view(3, 1, 1)


def normalized_tensor(image: Image.Image) -> torch.Tensor:
    """An RGB PIL image as a contiguous CHW float tensor, scaled to [0, 1] and ImageNet-normalised."""
    chw = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)
    return chw.to(torch.float32, memory_format=torch.contiguous_format).mul_(_SCALE).sub_(_SHIFT)


def open_folder(root: str) -> VisibleImageFolder | ShardFolder:
    """The split at `root`: a shard index (streamed) or an ImageFolder directory (read from disk)."""
    index = index_location(root)
    return ShardFolder(index) if index is not None else VisibleImageFolder(root)


def _problem(folder: VisibleImageFolder | ShardFolder, path: str, error: Exception) -> str | None:
    if isinstance(folder, ShardFolder):
        return folder.decode_problem(path, error)
    return decode_problem(path, error)


def train_transform(image_size: int) -> TrainAugment:
    return TrainAugment(image_size)


def eval_transform(image_size: int) -> v2.Transform:
    return v2.Compose(
        [
            v2.Resize(int(image_size * 256 / 224), antialias=True),
            v2.CenterCrop(image_size),
            v2.PILToTensor(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation: independent of worker count, order and resumption."""
    return (((seed * 1_000_003) ^ (epoch * 7_919)) * 2_654_435_761 + index) % (2**63 - 1)


class SeededImageFolder(Dataset[Sample]):
    """An ImageFolder whose random transforms draw from a generator seeded per (seed, epoch, index).

    An image that cannot be decoded is reported with the sample and replaced by the next readable one in
    folder order: every micro-batch keeps its size (no empty batch, no BatchNorm over one sample, no DDP
    rank without gradients), and the replacement is as deterministic as the order.
    """

    def __init__(self, root: str, transform: Callable[[Image.Image], torch.Tensor], seed: int) -> None:
        self.folder = open_folder(root)
        self.transform = transform
        self.seed = seed

    @property
    def classes(self) -> list[str]:
        return list(self.folder.classes)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, key: SampleKey) -> Sample:
        epoch, index = key
        unreadable: list[Unreadable] = []
        for offset in range(min(MAX_SUBSTITUTES + 1, len(self))):
            path, target = self.folder.samples[(index + offset) % len(self)]
            try:
                image = self.folder.loader(path)
            except DECODE_ERRORS as exc:
                problem = _problem(self.folder, path, exc)
                if problem is None:
                    raise
                unreadable.append((path, problem))
                continue
            return Sample(self._augment(image, epoch, index), target, tuple(unreadable))
        return Sample(None, self.folder.samples[index][1], tuple(unreadable))

    def _augment(self, image: Image.Image, epoch: int, index: int) -> torch.Tensor:
        # The transform draws from torch's global CPU generator: seed it for this sample, then put the
        # caller's state back (torch.manual_seed + fork_rng also seed every accelerator: ~100x slower).
        saved = torch.get_rng_state()
        torch.default_generator.manual_seed(sample_seed(self.seed, epoch, index))
        try:
            return self.transform(image)
        finally:
            torch.set_rng_state(saved)


@dataclass(frozen=True)
class BatchPlan:
    """How one optimizer step's global batch is split: ranks x accumulation steps x micro-batch."""

    global_batch: int
    world_size: int
    micro_batch: int

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size

    @property
    def accumulation(self) -> int:
        return self.per_rank // self.micro_batch


class ResumableBatchSampler(Sampler[list[SampleKey]]):
    """This rank's micro-batches for one epoch, starting at any optimizer step without reading skipped data.

    The order is a permutation seeded by (seed, epoch); step s uses global positions [s*G, (s+1)*G),
    rank r the r-th slice of that, split into micro-batches. A partial last global batch is dropped so
    every optimizer step sees the same number of samples.

    Over shards (`use_shards`) the permutation is shard-aware, still a function of (seed, epoch) alone: the
    shards in a seeded order, then the samples of each window of `window` consecutive shards shuffled
    together, so a stretch of steps reads a few shards rather than every shard; and a read-ahead is told
    which shards the coming batches need.
    """

    def __init__(self, num_samples: int, plan: BatchPlan, rank: int, seed: int, shuffle: bool = True) -> None:
        self.num_samples = num_samples
        self.plan = plan
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_step = 0
        self.shard_sizes: list[int] | None = None
        self.window = 1
        self.read_ahead: ReadAhead | None = None

    def use_shards(self, shard_sizes: list[int], window: int, read_ahead: ReadAhead | None) -> None:
        """Order samples shard by shard (samples numbered shard after shard, `shard_sizes` of each)."""
        if sum(shard_sizes) != self.num_samples:
            raise ValueError(f"shards hold {sum(shard_sizes)} samples, the sampler has {self.num_samples}")
        self.shard_sizes = list(shard_sizes)
        self.window = max(1, window)
        self.read_ahead = read_ahead

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.plan.global_batch

    def set_position(self, epoch: int, start_step: int) -> None:
        self.epoch = epoch
        self.start_step = start_step

    def _order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        if self.shard_sizes is None:
            return torch.randperm(self.num_samples, generator=generator)
        starts = [0]
        for size in self.shard_sizes:
            starts.append(starts[-1] + size)
        shards = torch.randperm(len(self.shard_sizes), generator=generator).tolist()
        parts = []
        for lo in range(0, len(shards), self.window):
            members = torch.cat(
                [torch.arange(starts[s], starts[s + 1]) for s in shards[lo : lo + self.window]]
            )
            parts.append(members[torch.randperm(len(members), generator=generator)])
        return torch.cat(parts)

    def _shard_of(self) -> list[int]:
        assert self.shard_sizes is not None
        return [shard for shard, size in enumerate(self.shard_sizes) for _ in range(size)]

    def __iter__(self) -> Iterator[list[SampleKey]]:
        order = self._order().tolist()
        plan = self.plan
        starts = [
            step * plan.global_batch + self.rank * plan.per_rank + micro * plan.micro_batch
            for step in range(self.start_step, self.steps_per_epoch)
            for micro in range(plan.accumulation)
        ]
        if self.read_ahead is not None:
            shard_of = self._shard_of()
            self.read_ahead.plan([shard_of[i] for lo in starts for i in order[lo : lo + plan.micro_batch]])
        for handed, lo in enumerate(starts):
            if self.read_ahead is not None:
                self.read_ahead.advance(handed * plan.micro_batch)
            yield [(self.epoch, i) for i in order[lo : lo + plan.micro_batch]]

    def __len__(self) -> int:
        return (self.steps_per_epoch - self.start_step) * self.plan.accumulation


class EvalDataset(Dataset[Sample]):
    """The validation folder, deterministic transforms, keyed by plain index; an unreadable image is
    reported and dropped (nothing trains on it, so no stand-in is needed)."""

    def __init__(self, root: str, image_size: int) -> None:
        self.folder = open_folder(root)
        self.transform = eval_transform(image_size)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> Sample:
        path, target = self.folder.samples[index]
        try:
            image = self.folder.loader(path)
        except DECODE_ERRORS as exc:
            problem = _problem(self.folder, path, exc)
            if problem is None:
                raise
            return Sample(None, target, ((path, problem),))
        return Sample(self.transform(image), target, ())


@dataclass
class SkippedFiles:
    """The unreadable images met so far, per split ("train", "val"): each logged once, listed in
    metrics.json, and each pass over a split (an epoch, an evaluation) checked against
    `data.max_bad_fraction` of the split's size."""

    max_fraction: float
    split_sizes: dict[str, int]
    split_dirs: dict[str, str]
    found: dict[str, dict[str, str]] = field(default_factory=dict)
    _pass: dict[str, tuple[int, set[str]]] = field(default_factory=dict)

    def record(self, split: str, unreadable: Iterable[Sequence[str]], pass_id: int) -> None:
        """Note the files met by one batch of pass `pass_id` (the epoch) of `split`."""
        current, seen = self._pass.get(split, (pass_id, set()))
        if current != pass_id:
            seen = set()
        self._pass[split] = (pass_id, seen)
        known = self.found.setdefault(split, {})
        for path, problem in unreadable:
            seen.add(path)
            if path not in known:
                known[path] = problem
                log.warning("skipped unreadable image %s: %s", path, problem)

    def pass_count(self, split: str) -> int:
        """Distinct unreadable files met in the current pass over `split` (by this process)."""
        return len(self._pass.get(split, (0, set()))[1])

    def check(self, split: str, count: int) -> None:
        """Raise BadDataError when `count` unreadable files (the pass's, all ranks) exceed the threshold."""
        size = self.split_sizes[split]
        if count <= self.max_fraction * size:
            return
        key = f"data.{split}_dir"
        met = sorted(self._pass.get(split, (0, set()))[1]) or sorted(self.found.get(split, {}))
        named = ", ".join(met[:NAMED_IN_ERROR])
        more = f" and {count - NAMED_IN_ERROR} more" if count > NAMED_IN_ERROR else ""
        raise BadDataError(
            f"{key}: {count} of the {size} images in {self.split_dirs[split]} cannot be decoded "
            f"(found so far), over data.max_bad_fraction={self.max_fraction:g}: {named}{more}; "
            "replace or delete them (then `trainstack data push`), or raise data.max_bad_fraction"
        )

    def no_readable_image(self, split: str) -> BadDataError:
        """The error for a micro-batch left empty: no readable image within MAX_SUBSTITUTES of any sample."""
        met = sorted(self._pass.get(split, (0, set()))[1])
        return BadDataError(
            f"data.{split}_dir: {len(met)} images in {self.split_dirs[split]} cannot be decoded, "
            f"{MAX_SUBSTITUTES + 1} of them in a row ({', '.join(met[:NAMED_IN_ERROR])}, ...); "
            "is the dataset made of images (not git-lfs pointers)? replace them and `trainstack data push`"
        )

    def summary(self) -> dict[str, dict[str, Any]]:
        """metrics.json's `skipped_files`: per split the count and the first REPORTED_PATHS paths, sorted."""
        return {
            split: {
                "count": len(self.found.get(split, {})),
                "paths": sorted(self.found.get(split, {}))[:REPORTED_PATHS],
            }
            for split in self.split_sizes
        }

    def to_state(self) -> dict[str, dict[str, str]]:
        """What a checkpoint carries, so metrics.json also lists files met by earlier lives."""
        return {split: dict(paths) for split, paths in self.found.items()}

    def load_state(self, state: dict[str, dict[str, str]] | None) -> None:
        for split, paths in (state or {}).items():
            self.found.setdefault(split, {}).update(paths)


def ignore_interrupt(_worker_id: int) -> None:
    """Ctrl-C reaches the whole process group: leave it to the main process, which stops at a step
    boundary; a worker dying on it would break that step instead. (SIGTERM is left alone: it is sent
    to the trainer's pid only, and multiprocessing uses it to end workers at exit.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def default_num_workers(world_size: int, on_gpu: bool) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if not on_gpu:
        # Training on CPU, the model already uses every core: workers would only take cores from it.
        # Loading is a small share of a CPU step, so give it about an eighth of the machine.
        return cpus // 8
    # Feeding a GPU: every core but one for this rank's share of the machine, up to 8.
    return max(1, min(8, cpus // max(1, world_size) - 1))


def loader_options(config: Config, world_size: int, on_gpu: bool) -> dict[str, Any]:
    workers = config.data.num_workers
    num_workers = default_num_workers(world_size, on_gpu) if workers == "auto" else int(workers)
    options: dict[str, Any] = {"num_workers": num_workers, "pin_memory": on_gpu}
    if num_workers > 0:
        options["worker_init_fn"] = ignore_interrupt
    if num_workers > 0:
        options |= {"persistent_workers": True, "prefetch_factor": config.data.prefetch_factor}
    # Taken out again by train_loader / eval_loader: how a streamed split caches and reads ahead.
    if any(index_location(root) for root in (config.data.train_dir, config.data.val_dir) if root):
        options[STREAMING] = CacheSettings(
            cache_dir=config.data.cache_dir,
            max_bytes=int(config.data.cache_gb * 10**9),
            read_ahead=config.data.read_ahead_shards,
            window=config.data.shuffle_window_shards,
        )
    return options


# The loader_options key of a streamed split's CacheSettings (not a DataLoader argument).
STREAMING = "streaming"


def train_loader(
    dataset: SeededImageFolder, sampler: ResumableBatchSampler, options: dict[str, Any]
) -> DataLoader[Sample]:
    options = dict(options)
    settings = options.pop(STREAMING, None) or CacheSettings()
    folder = dataset.folder
    if isinstance(folder, ShardFolder):
        # Before the DataLoader starts its workers: they get the dataset (and these settings) when it does.
        folder.configure(settings)
        read_ahead = ReadAhead(folder.cache.path, settings.read_ahead) if folder.cache.remote else None
        sampler.use_shards(folder.shard_sizes(), settings.window, read_ahead)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_samples, **options)


def eval_loader(
    dataset: EvalDataset, batch_size: int, rank: int, world_size: int, options: dict[str, Any]
) -> DataLoader[Sample]:
    shard = list(range(rank, len(dataset), world_size))
    options = dict(options)
    settings = options.pop(STREAMING, None) or CacheSettings()
    if isinstance(dataset.folder, ShardFolder):
        dataset.folder.configure(settings)
    options = {**options, "persistent_workers": False} if options.get("num_workers") else options
    return DataLoader(
        torch.utils.data.Subset(dataset, shard),
        batch_size=batch_size,
        shuffle=False,
        collate_fn=collate_samples,
        **options,
    )
