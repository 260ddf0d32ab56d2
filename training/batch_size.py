"""Find the largest micro-batch that fits: a full training step per try, OOM caught, with a safety margin."""

from __future__ import annotations

import copy
import gc
import logging
from collections.abc import Callable

import torch
from torch import nn

from training.config import ConfigError

log = logging.getLogger(__name__)

# Keep this share of device memory free: the allocator fragments over a long run, and eval or
# a checkpoint copy needs headroom the probe step did not.
SAFETY_MARGIN = 0.10


def fits(try_step: Callable[[int], None], micro_batch: int) -> bool:
    try:
        try_step(micro_batch)
    except torch.OutOfMemoryError:
        return False
    finally:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return True


def largest_fitting(try_step: Callable[[int], None], candidates: list[int]) -> int | None:
    """Binary search over ascending `candidates` (fitting is monotone in batch size); None if none fit."""
    lo, hi, best = 0, len(candidates) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(try_step, candidates[mid]):
            best, lo = candidates[mid], mid + 1
        else:
            hi = mid - 1
    return best


def micro_batch_candidates(per_rank: int | None, ceiling: int = 4096) -> list[int]:
    """Divisors of the per-rank batch (so accumulation is whole), or powers of two when the batch is auto."""
    if per_rank is None:
        return [2**k for k in range(ceiling.bit_length()) if 2**k <= ceiling]
    return [d for d in range(1, per_rank + 1) if per_rank % d == 0]


def search_micro_batch(try_step: Callable[[int], None], per_rank: int | None) -> int:
    """The largest micro-batch whose full step fits, or raise with the fix to try."""
    best = largest_fitting(try_step, micro_batch_candidates(per_rank))
    if best is None:
        raise ConfigError(
            [
                "train.micro_batch_size: not even a micro-batch of 1 fits in device memory; "
                "use a smaller model.name or data.image_size, or a GPU with more memory"
            ]
        )
    return best


def cuda_step_probe(
    model: nn.Module,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    image_size: int,
    num_classes: int,
    autocast: Callable[[], object],
    device: torch.device,
) -> Callable[[int], None]:
    """A try_step that runs forward, backward and optimizer step on a copy, failing past the margin."""
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * (1 - SAFETY_MARGIN))

    def try_step(micro_batch: int) -> None:
        probe = copy.deepcopy(model)
        optimizer = make_optimizer(probe)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            x = torch.randn(micro_batch, 3, image_size, image_size, device=device)
            x = x.to(memory_format=torch.channels_last)
            y = torch.randint(0, num_classes, (micro_batch,), device=device)
            for _ in range(2):  # the second step allocates the optimizer state
                with autocast():  # type: ignore[attr-defined]
                    loss = nn.functional.cross_entropy(probe(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device)
            if peak > budget:
                raise torch.OutOfMemoryError(f"peak {peak} bytes over the {budget}-byte budget")
        finally:
            del probe, optimizer

    return try_step
