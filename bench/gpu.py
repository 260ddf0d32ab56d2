"""GPU throughput: the trainer's step (auto precision, channels_last, auto micro-batch, compiled or not)
against the naive fp32 loop, on synthetic ResNet-50 data. Run through bench/gpu.sh."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from training.batch_size import cuda_step_probe, search_micro_batch
from training.config import Config
from training.loop import make_optimizer
from training.model import build_model
from training.precision import choose_precision

NUM_CLASSES = 1000
# Anchor: NVIDIA DeepLearningExamples ConvNets, ResNet-50 AMP training, 1x A100-80G, batch 256.
ANCHOR_IMG_PER_S = 2470


def measure(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def naive(
    model_name: str, device: torch.device, image_size: int, batch: int, warmup: int, steps: int
) -> dict[str, float]:
    """The seeds' loop: fp32, NCHW, a fixed batch halved until it fits."""
    while batch >= 1:
        try:
            return _naive_at(model_name, device, image_size, batch, warmup, steps)
        except torch.OutOfMemoryError:
            _release(device)
            batch //= 2
    raise RuntimeError("naive loop: not even a batch of 1 fits")


def _naive_at(
    model_name: str, device: torch.device, image_size: int, batch: int, warmup: int, steps: int
) -> dict[str, float]:
    model = build_model(model_name, NUM_CLASSES, torch.device("cpu")).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, image_size, image_size, device=device)
    y = torch.randint(0, NUM_CLASSES, (batch,), device=device)

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    _reset_peak(device)
    seconds = measure(step, device, warmup, steps)
    return {"img_per_s": batch * steps / seconds, "micro_batch": batch, "peak_gib": _peak(device)}


def trainer(
    model_name: str,
    device: torch.device,
    image_size: int,
    compile_model: bool,
    max_batch: int,
    warmup: int,
    steps: int,
) -> dict[str, float]:
    """The trainer's components: precision auto, channels_last, micro-batch search, optional compile."""
    config = Config()
    precision = choose_precision("auto", device)
    model = build_model(model_name, NUM_CLASSES, device)
    if device.type == "cuda":
        probe = cuda_step_probe(
            model, lambda m: make_optimizer(m, config), image_size, NUM_CLASSES, precision.autocast, device
        )
        micro = min(search_micro_batch(probe, per_rank=None), max_batch)
    else:
        micro = max_batch
    optimizer = make_optimizer(model, config)
    scaler = precision.grad_scaler()
    runner: nn.Module = torch.compile(model) if compile_model else model  # type: ignore[assignment]
    x = torch.randn(micro, 3, image_size, image_size, device=device)
    if device.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, NUM_CLASSES, (micro,), device=device)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)

    def step() -> None:
        with precision.autocast():
            loss = criterion(runner(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    _reset_peak(device)
    seconds = measure(step, device, warmup + (20 if compile_model else 0), steps)
    return {
        "img_per_s": micro * steps / seconds,
        "micro_batch": micro,
        "peak_gib": _peak(device),
        "precision": precision.precision,  # type: ignore[dict-item]
    }


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--naive-batch", type=int, default=128)
    parser.add_argument(
        "--max-batch", type=int, default=256, help="cap on the auto micro-batch (NVIDIA's 256)"
    )
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = True
    if device.type == "cuda":
        print(f"GPU: {torch.cuda.get_device_name(device)}  torch {torch.__version__}")
    results = {
        "naive fp32": naive(args.model, device, args.image_size, args.naive_batch, args.warmup, args.steps)
    }
    for compile_model in (False, True):
        label = f"trainer{' compiled' if compile_model else ''}"
        results[label] = trainer(
            args.model, device, args.image_size, compile_model, args.max_batch, args.warmup, args.steps
        )
        _release(device)
    base = results["naive fp32"]["img_per_s"]
    print(f"{'loop':<20}{'img/s':>10}{'vs naive':>10}{'micro-batch':>13}{'peak GiB':>10}  precision")
    for label, r in results.items():
        print(
            f"{label:<20}{r['img_per_s']:>10.0f}{r['img_per_s'] / base:>9.2f}x{r['micro_batch']:>13.0f}"
            f"{r['peak_gib']:>10.1f}  {r.get('precision', 'fp32')}"
        )
    print(f"anchor: NVIDIA DeepLearningExamples ResNet-50 AMP, 1x A100-80G: {ANCHOR_IMG_PER_S} img/s")


if __name__ == "__main__":
    main()
