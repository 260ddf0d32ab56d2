"""The micro-batch search: largest that fits under a (simulated) memory limit, OOM caught, few probes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from training.batch_size import largest_fitting, micro_batch_candidates, search_micro_batch
from training.config import ConfigError


class SimulatedDevice:
    """A real forward/backward/step on CPU that raises the CUDA OOM error past a memory limit."""

    def __init__(self, limit_bytes: int, bytes_per_sample: int) -> None:
        self.limit = limit_bytes
        self.per_sample = bytes_per_sample
        self.tried: list[int] = []
        self.model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 4))

    def try_step(self, micro_batch: int) -> None:
        self.tried.append(micro_batch)
        optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        loss = self.model(torch.randn(micro_batch, 3, 8, 8)).sum()
        loss.backward()
        optimizer.step()
        if micro_batch * self.per_sample > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def test_auto_batch_finds_the_largest_power_of_two_that_fits() -> None:
    device = SimulatedDevice(limit_bytes=300 * 2**20, bytes_per_sample=2**20)
    assert search_micro_batch(device.try_step, per_rank=None) == 256
    assert len(device.tried) <= 5  # binary search over 13 candidates, not a doubling loop to failure


def test_micro_batch_divides_the_per_rank_batch_so_accumulation_is_whole() -> None:
    device = SimulatedDevice(limit_bytes=100 * 2**20, bytes_per_sample=2**20)
    micro = search_micro_batch(device.try_step, per_rank=192)
    assert micro == 96 and 192 % micro == 0


def test_everything_fitting_means_no_accumulation() -> None:
    device = SimulatedDevice(limit_bytes=2**40, bytes_per_sample=2**20)
    assert search_micro_batch(device.try_step, per_rank=64) == 64


def test_nothing_fitting_is_one_line_naming_the_key() -> None:
    device = SimulatedDevice(limit_bytes=0, bytes_per_sample=1)
    with pytest.raises(ConfigError, match=r"^train\.micro_batch_size: not even a micro-batch of 1 fits"):
        search_micro_batch(device.try_step, per_rank=32)


def test_other_errors_are_not_mistaken_for_out_of_memory() -> None:
    def broken(_: int) -> None:
        raise ValueError("shape mismatch")

    with pytest.raises(ValueError, match="shape mismatch"):
        largest_fitting(broken, [1, 2, 4])


def test_candidates() -> None:
    assert micro_batch_candidates(12) == [1, 2, 3, 4, 6, 12]
    assert micro_batch_candidates(None, ceiling=16) == [1, 2, 4, 8, 16]
