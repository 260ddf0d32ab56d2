"""Process-group setup under torchrun, and the few collectives the loop needs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainstack_job.contract import JobEnv


@dataclass(frozen=True)
class World:
    rank: int
    local_rank: int
    size: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def collective_timeout(env: Mapping[str, str]) -> timedelta:
    """How long a rank waits in one collective before giving up.

    On one machine: long enough for rank 0 to restore a checkpoint from S3 or upload one (run by hand
    with checkpoint.uri) while the others wait. Across machines a peer can vanish without a word (an
    instance killed with no notice): the survivors must fail within minutes, not bill half an hour, so the
    agent can regroup them; there rank 0 only writes locally (the agent uploads), which takes seconds.
    """
    return timedelta(minutes=10 if env.get(JobEnv.RDZV_ENDPOINT.value) else 30)


def init_world(device_type: str) -> World:
    """Join torchrun's process group when launched by it; a single process otherwise."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if size > 1 and not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, timeout=collective_timeout(os.environ))
    return World(rank=rank, local_rank=local_rank, size=size)


def any_rank(world: World, flags: list[bool], device: torch.device) -> list[bool]:
    """Element-wise OR of boolean flags across ranks, so every rank takes the same branch."""
    if not world.distributed:
        return flags
    tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def sum_across(world: World, values: list[float], device: torch.device) -> list[float]:
    if not world.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return [float(v) for v in tensor.tolist()]


def max_across(world: World, values: list[int], device: torch.device) -> list[int]:
    """Element-wise maximum of integers across ranks."""
    return _reduce_ints(world, values, device, dist.ReduceOp.MAX)


def min_across(world: World, values: list[int], device: torch.device) -> list[int]:
    """Element-wise minimum of integers across ranks."""
    return _reduce_ints(world, values, device, dist.ReduceOp.MIN)


def _reduce_ints(world: World, values: list[int], device: torch.device, op: Any) -> list[int]:
    if not world.distributed:
        return values
    # int64 on the collective's device (NCCL reduces only CUDA tensors): steps and ranks, exactly.
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=op)
    return [int(v) for v in tensor.tolist()]


def broadcast_object(world: World, value: object, src: int = 0) -> object:
    """`value` of rank `src` on every rank, pickled (tensors go as torch.save bytes: Trainer._restore)."""
    if not world.distributed:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def shutdown(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()
