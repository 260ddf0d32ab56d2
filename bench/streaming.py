"""`python -m bench.streaming`: time to the first batch and steady samples/s of the built-in trainer's
loader, for the same dataset read three ways, side by side in one run, against moto on this machine:

- sync: the dataset pushed as files, synced whole to local disk (bootstrap/datasync.py, as every instance
  life does today), then read from the ImageFolder;
- stream: the dataset pushed as shards (`trainstack data push --format shards`), streamed from S3 into an
  empty cache (training/streaming.py): a new instance;
- stream-warm: the same, with the cache the previous case left (a later life on the same instance store).

Time to first batch counts from the start of the case (sync included) to the loader's first micro-batch;
steady samples/s is over the rest of one epoch. The images are random-noise PNGs of about `--image-kb`
(incompressible, like JPEGs), so bytes, not decoding tricks, set the pace. moto serves S3 from memory at
local speed: the network is not the limit here (see the results file for what that means).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

BUCKET = "bench-streaming"


@dataclass(frozen=True)
class CaseResult:
    case: str
    first_batch_s: float
    steady_samples_per_s: float
    samples: int
    prepare_s: float  # the sync (sync case) or the index read (stream cases), part of first_batch_s


def write_images(root: Path, gigabytes: float, image_kb: int, classes: int, seed: int = 0) -> int:
    """root/{train,val}/<class>/<n>.png of random noise, about `gigabytes` in all (val: a tenth of train)."""
    side = max(8, int((image_kb * 1000 / 3) ** 0.5))
    count = max(classes * 2, int(gigabytes * 1e9 / (side * side * 3)))
    rng = np.random.default_rng(seed)
    for split, n in (("train", count), ("val", max(classes, count // 10))):
        for index in range(n):
            folder = root / split / f"class_{index % classes}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{index:07d}.png", compress_level=0)
    return count


def upload_tree(s3: Any, root: Path, prefix: str) -> None:
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(max_concurrency=16)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            s3.upload_file(str(path), BUCKET, prefix + path.relative_to(root).as_posix(), Config=config)


def read_epoch(
    root: str, settings: Any, workers: int, batch: int, image_size: int
) -> tuple[float, int, float]:
    """(seconds to the first micro-batch, samples, seconds for the rest) over one epoch of the loader."""
    from training.data import (
        STREAMING,
        BatchPlan,
        ResumableBatchSampler,
        SeededImageFolder,
        train_loader,
        train_transform,
    )

    started = time.monotonic()
    dataset = SeededImageFolder(root, train_transform(image_size), seed=0)
    sampler = ResumableBatchSampler(len(dataset), BatchPlan(batch, 1, batch), rank=0, seed=0)
    options: dict[str, Any] = {"num_workers": workers, STREAMING: settings}
    if workers:
        options["prefetch_factor"] = 4
    loader = iter(train_loader(dataset, sampler, options))
    first = next(loader)
    first_at = time.monotonic()
    samples = 0
    for micro in loader:
        samples += len(micro.images)
    del first
    return first_at - started, samples, time.monotonic() - first_at


def run(
    work: Path,
    gigabytes: float,
    image_kb: int,
    shard_mb: float,
    workers: int,
    batch: int,
    image_size: int,
    window: int,
    read_ahead: int,
) -> dict[str, Any]:
    import boto3

    from bootstrap.datasync import DataSync
    from bootstrap.eventlog import EventLog
    from demo.moto_server import moto_server
    from training.streaming import CacheSettings
    from trainstack.datapush import write_shards

    images = work / "images"
    count = write_images(images, gigabytes, image_kb, classes=10)
    classes = sorted(p.name for p in (images / "train").iterdir())
    write_shards(images, work / "shards", classes, int(shard_mb * 1e6))
    dataset_bytes = sum(p.stat().st_size for p in (images / "train").rglob("*.png"))
    results: list[CaseResult] = []
    with moto_server() as endpoint:
        saved = {
            k: os.environ.get(k) for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        }
        os.environ |= {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        try:
            s3 = boto3.client("s3")
            s3.create_bucket(Bucket=BUCKET)
            upload_tree(s3, images, "files/")
            upload_tree(s3, work / "shards", "shards/")

            # sync: the whole dataset to local disk first, then the ImageFolder.
            started = time.monotonic()
            synced = work / "synced"
            DataSync(s3, BUCKET, "files/", "us-east-1", EventLog()).sync(synced, tool="boto3")
            sync_s = time.monotonic() - started
            first, samples, rest = read_epoch(str(synced / "train"), None, workers, batch, image_size)
            results.append(CaseResult("sync", sync_s + first, samples / rest, samples, sync_s))

            cache = CacheSettings(str(work / "cache"), max_bytes=10**12, read_ahead=read_ahead, window=window)
            uri = f"s3://{BUCKET}/shards/train/shards.json"
            for case in ("stream", "stream-warm"):
                first, samples, rest = read_epoch(uri, cache, workers, batch, image_size)
                results.append(CaseResult(case, first, samples / rest, samples, 0.0))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "dataset_bytes": dataset_bytes,
        "train_images": count,
        "shards": len(json.loads((work / "shards" / "train" / "shards.json").read_text())["shards"]),
        "shard_mb": shard_mb,
        "workers": workers,
        "batch": batch,
        "window": window,
        "read_ahead": read_ahead,
        "cases": [asdict(r) for r in results],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.streaming", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=0.1, help="training images, GB (default 0.1)")
    parser.add_argument("--image-kb", type=int, default=110, help="bytes of one image, KB (default 110)")
    parser.add_argument("--shard-mb", type=float, default=16, help="shard size, MB (default 16)")
    parser.add_argument("--workers", type=int, default=2, help="loader workers (default 2)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=64, help="the crop the trainer makes (default 64)")
    parser.add_argument("--window", type=int, default=2, help="data.shuffle_window_shards (default 2)")
    parser.add_argument("--read-ahead", type=int, default=2, help="data.read_ahead_shards (default 2)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-streaming-") as work:
        report = run(
            Path(work),
            args.gb,
            args.image_kb,
            args.shard_mb,
            args.workers,
            args.batch,
            args.image_size,
            args.window,
            args.read_ahead,
        )
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text)
    print(text)
    print(f"{'case':<12} {'first batch s':>14} {'steady samples/s':>17}")
    for case in report["cases"]:
        print(f"{case['case']:<12} {case['first_batch_s']:>14.2f} {case['steady_samples_per_s']:>17.1f}")


if __name__ == "__main__":
    main()
